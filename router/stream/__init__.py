"""From a node to the link queues: the first half of the data path.

`connection` (the replication I/O shell: the only code that speaks the replication protocol through
libpq; on a plain socket it hands the stream to `wire`, which reads and writes it past libpq) -> `source`
(positions, assembly into whole transactions, spilling large ones via `spool`) -> `fanout` (echo filter,
the router's `log`, one bounded `linkqueue` per link out of the node). `items` holds what the source
hands out besides transactions and its options; `slots` reads and confirms the node's slot; `seen` keeps
what the node had applied from each other node (the vector stamped on its transactions); `state` holds a
source's state machine and its counters.

Must not: talk to a target, decide conflicts, or know how a transaction is applied.
"""
