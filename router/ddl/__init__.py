"""DDL replication: `capture` (the event trigger and what it installs, `sql/capture.sql`), `messages`
(the logical message it emits and the applier reads), `reconcile` (rows fitted to a target after a
replicated rename or drop), `drift` (the nodes' replicated tables compared: schema drift holds links),
`command` (`pgmesh ddl`: a command cluster-wide behind a barrier; the only way in under `[ddl] mode =
"locked"`).

Must not: apply DDL itself outside the applier's transaction order.
"""
