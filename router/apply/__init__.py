"""From a link queue to the target: the second half of the data path.

`applier` runs one link's loop; the helpers it calls get a narrow `link.LinkSession`, never the
applier: `large` and `parts` (a transaction too big for a batch, applied in parts), `side` (a streamed
transaction applied ahead of its commit), `lanes` with `parallel` (disjoint transactions on several
sessions), `careful` (row by row when a guarded statement found a conflict). `scripts` and
`statements` build the SQL, `sessions` opens and sets up target sessions, `state` holds a link's state
machine and counters.

Must not: read a source stream (it only sees whole transactions and spill files), or choose a retry
policy (`router.errors` does).
"""
