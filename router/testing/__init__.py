"""Throw-away clusters and convergence checks, shared by the tests, the bench and `pgmesh demo`:
`localnodes` (initdb/pg_ctl on free loopback ports, from `ports`), `mesh` (a configured, initialised mesh
of them and helpers that wait on conditions), `compare` (row fingerprints per table per node), `proxy`
(a TCP forwarder that cuts, stalls and restores a network link), `routers` (router processes of their
own, for standby routers).

Only `router.ops.demo`, tests and bench import this package (tests/unit/test_architecture.py checks).
"""
