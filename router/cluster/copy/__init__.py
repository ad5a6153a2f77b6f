"""The PySpark batches of pgmesh: the initial copy of a joining node, and `pgmesh push`.

Nothing here is imported at router start-up, and importing these modules does not import pyspark: the
JVM starts only when a job runs (`router.cluster.copy.spark`).

  initial.py   the initial copy of `pgmesh join`: plan, run, report (`copy_snapshot`)
  rounds.py    one join attempt's copy under its snapshot, in rounds; giving way to the application
  plan.py      relation sizes -> ctid block ranges, one per Spark task (pure)
  worker.py    one task: donor COPY OUT -> target COPY IN for one block range, one target transaction
  spark.py     the SparkSession (retries, quiet, no UI), kept between jobs only inside `reuse_spark()`
  progress.py  progress records, the poller, the CLI's progress bar
  locks.py     the lock holder that plans under its locks, and the watch that gives way to the application
  schema.py    the schema at the snapshot: pg_dump, pg_restore pre-data and post-data
  push.py      `pgmesh push`: a one-shot copy of a table's (or a query's) rows into a live node
"""
