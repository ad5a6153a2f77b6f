"""`pgmesh compare`: every node's replicated rows against every other's (router.cluster.compare.job)."""
