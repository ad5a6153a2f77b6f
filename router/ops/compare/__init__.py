"""`pgmesh compare`: every node's replicated rows against every other's (router.ops.compare.job)."""
