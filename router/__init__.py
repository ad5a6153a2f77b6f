"""pgmesh's router: the process between the nodes, and every operator command.

Data flows one way, and the folders say so: a node -> `stream` -> `apply` -> the target node; the
target's commits flow back through `progress` to the slots. Around that path:

  stream      a node's replication connection, source, spool, router log, fan-out and link queues
  apply       one applier per link and the helpers it hands a narrow `LinkSession`
  progress    durable positions and the applied mark: what a slot may confirm
  conflicts   pure decisions (`resolve`) and what they need on every node
  ddl         DDL capture, its message, reconciling rows, schema drift
  sequences   global sequences
  cluster     a library about nodes: facts, checks, install, grants, keys, members, the Spark copy
  service     `pgmesh run`: supervisor, wiring, watchers, admin, metrics
  ops         every operator command: join, part, compare, repair, ddl, skip, the CLI
  testing     throw-away clusters for the tests, the bench and `pgmesh demo`
  config      the configuration as msgspec types that carry their own constraints
  nodes       one connect helper, one connection type, the DSN, SQL files
  errors.py   every error, and the one place that decides retry, pause or fail
  failpoints.py  named fail points at the places where races live, armed only by tests
  __main__.py `python -m router` is `pgmesh`

Layers, low to high (tests/unit/test_architecture.py holds them): errors, failpoints < conflicts.resolve,
config, nodes < progress < stream < ddl, sequences, conflicts < apply < cluster < service < testing < ops
< __main__.
"""
