"""From a link queue to the target: the second half of the data path.

`applier` runs one link's loop; the helpers it calls get a narrow `link.LinkSession`, never the
applier: `large` and `parts` (a transaction too big for a batch, applied in parts), `side` (a streamed
transaction applied ahead of its commit), `lanes` with `parallel` (disjoint transactions on several
sessions), `careful` (row by row when a guarded statement found a conflict), `decide` (conflicts decided
in the transaction's own round trip), `uniques` (secondary unique key clashes), `toast` (unchanged TOAST
values read on the source). `sender` sends a batch one of two ways: through `pipe` (the extended
protocol in libpq's pipeline mode), each transaction encoded once for all its source's links by `encode`
and bound to the statements `shapes` prepares in each session; or as SQL scripts, which `scripts`,
`statements` and `prepared` build. `sessions` opens and
sets up target sessions; `fence` is the lease fence of this process's sessions; `clock` is what an
applier sees of the node clocks; `skip` leaves out one named transaction (`pgmesh skip`); `quarantine`
sets a change the target refuses aside (`on_refused = "quarantine"`), with the later changes of its key;
`state` holds a link's state machine and counters. `recorder` records a node's own deletes (tombstones)
from its stream.

Must not: read a source stream (it only sees whole transactions and spill files), or choose a retry
policy (`router.errors` does).
"""
