"""The bench suite: every system on every workload, one report (`python -m bench --all`).

- `runner`: the command line, the runs across systems, the summary and suite.json.
- `report`: RESULTS.md and the plots, from suite.json.
- `profile`: where the CPU goes inside each workload's timed window (`python -m bench.suite.profile`).

Owns nothing itself. Must not: define a system or a workload (`bench.harness`).
"""
