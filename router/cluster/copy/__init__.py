"""The PySpark batches of pgmesh: the initial copy of a joining node (`router.cluster.copy.initial`).

Nothing here is imported at router start-up, and importing these modules does not import pyspark: the
JVM starts only when a job runs (`router.cluster.copy.spark`).

  plan.py      relation sizes -> ctid block ranges, one per Spark task (pure)
  worker.py    one task: donor COPY OUT -> target COPY IN for one block range, one target transaction
  spark.py     the SparkSession (retries, quiet, no UI), kept between jobs only inside `reuse_spark()`
  progress.py  progress records, the poller, the CLI's progress bar
  copy.py      `copy_snapshot`: plan, run, report
  locks.py     the lock holder that plans under its locks, and the watch that gives way to the application
  schema.py    the schema at the snapshot: pg_dump, pg_restore pre-data and post-data
"""
