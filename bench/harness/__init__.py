"""What the benches measure with: one class per replicated system, the watcher, the workloads, a run.

- `system`: the interface every system implements; `subscriptions` (native logical replication,
  pglogical), `pgmesh` (two and three nodes), `bucardo`: one class per system.
- `nodes`: server settings, pgbench, markers, CPU readings, the uvloop runner.
- `watcher`: the helper process that polls the targets (markers, lag probes, visibility, convergence).
- `workloads`: each workload defined once (tpcb, bulk, inserts, visibility, lag, multimaster) and timed.
- `runs`: one system, one run on fresh nodes (`run_once`), failures recorded.

Owns nothing itself. Must not: run anything when imported, or import from `tests` (the throw-away
clusters come from `router.testing`). Used by `bench.suite` and `bench.micro`.
"""
