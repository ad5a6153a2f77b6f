"""pgmesh's benches: `harness/` (systems, watcher, workloads), `suite/` (`python -m bench --all`),
`micro/` (`python -m bench.micro.<name>`), `results/` and `RESULTS.md` (what was measured, with the
commands). Owns nothing itself; must not run anything when imported.
"""
