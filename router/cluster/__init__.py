"""The cluster's membership and what pgmesh puts on its nodes: `checks` (pre-flight of `pgmesh init`),
`install` (objects installed and removed), `membership` (join and part), `sync/` (the PySpark initial
copy, imported only by `pgmesh join`), `pgbin` (finding PostgreSQL's programs), `sqlfiles` (the .sql
files shipped as package data), `clocks` (each node's clock offset from the router's, the links' hold).

Must not: stream or apply changes.
"""
