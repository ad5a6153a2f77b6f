"""DDL replication: `capture` (the event trigger and what it installs, `sql/capture.sql`), `messages`
(the logical message it emits and the applier reads), `reconcile` (rows fitted to a target after a
replicated rename or drop), `drift` (the nodes' replicated tables compared: schema drift holds links).
`pgmesh ddl`, a command run cluster-wide behind a barrier, is an operator command (router.ops.ddl).

Must not: apply DDL itself outside the applier's transaction order.
"""
