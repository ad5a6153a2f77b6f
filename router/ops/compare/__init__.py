"""`pgmesh compare` and `pgmesh repair`: every node's replicated rows against every other's.

  job.py       the command: a PySpark job over exported snapshots, then a recheck of what differed
  plan.py      the tables compared, and key ranges (one per Spark task) over them
  lanes.py     the first pass's key ranges, shared between the command's own threads and Spark
  worker.py    one task: read its key ranges on every node, name the keys whose rows differ
  multiset.py  a table without a key compared as a multiset of whole rows
  repair.py    `pgmesh repair`: every persistent difference resolved and written
  copies.py    repairing a table without a key: as many copies of each row as the winner holds
"""
