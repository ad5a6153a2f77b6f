"""Continuous verification (`[verify]`, docs/verify.md): the active router compares the replicated tables
across nodes in rolling key ranges at a bounded rate, rechecks what differed behind the replication
barrier it knows itself, and reports the rows that still differ.

  scope.py     what a pass compares: the published tables (or `[verify] tables`), their keys and ranges
  sessions.py  the verification's own sessions on every node: a range read under one snapshot per node,
               each node's barrier position, keys read again
  findings.py  what a pass found of a table: its divergent keys and, per node, the rows it holds apart
  verifier.py  the task: a pass every `interval`, the rate bound, the barrier and the recheck, the log
               line, status and metrics

Must not: write to a node, share a session with the links, or run anywhere but on the active router.
"""
