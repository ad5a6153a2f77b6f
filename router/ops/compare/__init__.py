"""`pgmesh compare` and `pgmesh repair`: every node's replicated rows against every other's.
The reading and fixing pieces they share with the router's continuous verification are in
router.cluster.compare.

  job.py       the command: a PySpark job over exported snapshots, then a recheck of what differed
  lanes.py     the first pass's key ranges, shared between the command's own threads and Spark
  repair.py    `pgmesh repair`: every persistent difference resolved and written (or planned: --dry-run)
  progress.py  repair's progress line, summary and run-time hints on stderr
"""
