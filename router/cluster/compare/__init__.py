"""Reading and fixing replicated rows across nodes: the pieces `pgmesh compare` and `pgmesh repair`
(router.ops.compare) and the router's continuous verification share.

  plan.py      the tables compared, and key ranges (one per task) over them
  worker.py    one task: read its key ranges on every node, name the keys whose rows differ
  multiset.py  a table without a key compared as a multiset of whole rows
  copies.py    repairing a table without a key: as many copies of each row as the winner holds
  verdict.py   who wins a differing key: the conflict path's versions and rules, tombstones included
  fix.py       a table's differing keys repaired set-based: bulk reads, a staging table, a few statements
"""
