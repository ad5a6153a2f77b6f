"""What an operator runs: `cli` (argument parsing only), `control` (init, run, status, pause, resume,
conflicts, sequences), `join` and `part` (a node joins or leaves the cluster), `compare` (`pgmesh compare`
and `pgmesh repair`), `ddl` (`pgmesh ddl`: a statement cluster-wide), `barrier` (wait until every member
applied what the others committed), `skip` (`pgmesh skip`: a link leaves out one transaction), `tail`
(`pgmesh tail`: a node's transactions, decoded), `quarantine` (`pgmesh quarantine list | replay |
discard`: the changes a node refused and set aside), `demo` (`pgmesh demo` over throw-away local nodes).
"""
