"""DDL replication: `capture` (the event trigger and what it installs, `sql/capture.sql`), `messages`
(the logical message it emits and the applier reads), `reconcile` (rows fitted to a target after a
replicated rename or drop), `command` (`pgmesh ddl`: a command cluster-wide behind a barrier).

Must not: apply DDL itself outside the applier's transaction order.
"""
