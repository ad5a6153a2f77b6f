"""A library about nodes, below the service and the operator commands: `facts` (what a node tells
`pgmesh init`, read once), `checks` (init's pre-flight checks, pure rules on those facts), `install`
(what pgmesh puts on a node and removes), `script` (`init --print-sql`), `grants` (the run role's
privileges), `keys` (a table's key and unique indexes, compared by shape), `origins` (other replication
origins on a node), `standbys` (physical standbys and failover), `synchronous` (synchronous_standby_names),
`partial` and `receive` (nodes that hold part of the data or only receive), `members` (the parted record),
`joining` (a joining node's record and slot pins), `clocks` (each node's clock offset from the router's)
`copy/` (the PySpark initial copy, imported only by `pgmesh join`) and `compare/` (reading rows across
nodes by key ranges and hashes, for `pgmesh compare`, `pgmesh repair` and continuous verification).

Must not: stream or apply changes, or import the service or the operator commands.
"""
