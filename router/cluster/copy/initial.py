"""The initial copy of `pgmesh join`: every row an exported snapshot shows on the donor, into the target,
as a PySpark batch of parallel ctid-range COPY relays.

Owns: the copy's API (`copy_snapshot` and its records), reading the tables' leaf relations, sizes and
COPY format (binary unless a column's type cannot take it) on the donor under the snapshot, planning
(through `router.cluster.copy.plan`), running the tasks on Spark (`router.cluster.copy.worker` is what
each task does), progress reports, stopping a running job from another thread (`CopyAbort`: the join
gives way to the application's locks), and turning a failed job into one `PgmeshError` naming the node
role, the table and the SQL state.

Must not: create schema, indexes, slots or replication origins (the caller copies the pre-data schema
before and builds indexes and constraints after, e.g. `pg_dump --section=pre-data` / `post-data`), hold
the snapshot (the caller keeps it importable), import pyspark at module level, or put a DSN in any
message.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import msgspec
import psycopg
from psycopg import sql

from router.cluster.copy.plan import DEFAULT_BLOCK_SIZE, CopyTask, Leaf, plan_tasks
from router.cluster.copy.progress import CopyProgress, Poller, ProgressBar
from router.cluster.copy.spark import local_parallelism, reuse_spark, spark_session, stop_spark
from router.cluster.copy.worker import (
    SNAPSHOT_HINT,
    CopyJob,
    Counters,
    TaskFailure,
    TaskOutcome,
    run_partition,
)
from router.errors import PgmeshError, describe

__all__ = [
    "CopyAbort",
    "CopyProgress",
    "CopyReport",
    "CopyTable",
    "ProgressBar",
    "TableResult",
    "copy_snapshot",
    "plan_leaves",
    "read_leaves",
    "report",
    "reuse_spark",
    "run_job",
    "stop_spark",
]

logger = logging.getLogger(__name__)

APPLICATION_NAME_PREFIX: Final = "pgmesh copy "
_ERROR_LINE: Final = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception): ")
_LEAVES_SQL: Final = """
SELECT n.nspname, c.relname, c.relkind,
       pg_catalog.pg_relation_size(c.oid) / pg_catalog.current_setting('block_size')::bigint
FROM pg_catalog.pg_partition_tree(%s::oid::regclass) t
JOIN pg_catalog.pg_class c ON c.oid = t.relid
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE t.isleaf
ORDER BY t.level, n.nspname, c.relname
"""
_SIZE_SQL: Final = (
    "SELECT pg_catalog.pg_relation_size(%s::oid) / pg_catalog.current_setting('block_size')::bigint"
)
# The types among a table's copied columns that binary COPY cannot carry, looking into array elements,
# domains' base types, composites' attributes and ranges' subtypes: a type without send or receive
# function (aclitem, a user's base type made without them), and int2vector / oidvector, whose receive
# functions refuse the empty value their send functions write ("invalid int2vector data").
_TEXT_ONLY_TYPES_SQL: Final = """
WITH RECURSIVE used(type) AS (
    SELECT a.atttypid FROM pg_catalog.pg_attribute a
    WHERE a.attrelid = %s::oid AND a.attnum > 0 AND NOT a.attisdropped AND a.attname = ANY(%s::text[])
  UNION
    SELECT inner_type.oid FROM used JOIN pg_catalog.pg_type t ON t.oid = used.type
    CROSS JOIN LATERAL (
        SELECT t.typelem WHERE t.typelem <> 0
        UNION ALL SELECT t.typbasetype WHERE t.typbasetype <> 0
        UNION ALL SELECT f.atttypid FROM pg_catalog.pg_attribute f
                  WHERE t.typrelid <> 0 AND f.attrelid = t.typrelid AND f.attnum > 0 AND NOT f.attisdropped
        UNION ALL SELECT r.rngsubtype FROM pg_catalog.pg_range r WHERE t.oid IN (r.rngtypid, r.rngmultitypid)
    ) inner_type(oid)
)
SELECT pg_catalog.format_type(t.oid, NULL)
FROM used JOIN pg_catalog.pg_type t ON t.oid = used.type
WHERE t.typsend::oid = 0 OR t.typreceive::oid = 0
   OR t.oid IN ('pg_catalog.int2vector'::pg_catalog.regtype, 'pg_catalog.oidvector'::pg_catalog.regtype)
ORDER BY 1
"""
_ROOT_SQL: Final = """
SELECT c.oid, c.relkind FROM pg_catalog.pg_class c
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s AND c.relname = %s
"""


class CopyTable(msgspec.Struct, frozen=True):
    """A table to copy: a plain table, or a partitioned table (each leaf partition is copied into the
    partition of the same name on the target). `columns` are copied in this order and must have the
    same names and types on both sides; leave out generated columns. The COPY format is binary, or text
    when a column's type cannot take binary COPY (decided when planning: `plan_leaves`)."""

    schema: str
    name: str
    columns: tuple[str, ...]

    @property
    def relation(self) -> str:
        return f"{self.schema}.{self.name}"


class TableResult(msgspec.Struct, frozen=True):
    """One table's share: rows (the target's COPY counts), bytes (of the COPY stream), tasks run."""

    schema: str
    name: str
    rows: int
    bytes: int
    tasks: int


class CopyReport(msgspec.Struct, frozen=True):
    """The whole copy. `seconds` is the wall time of `copy_snapshot` (Spark start-up included);
    `retries` counts failed task attempts that Spark retried."""

    tables: tuple[TableResult, ...]
    rows: int
    bytes: int
    seconds: float
    tasks: int
    retries: int


class CopyAbort:
    """Stops a running copy from another thread: `request(error)` cancels its Spark job (tasks are
    interrupted, their sessions close and roll back), and `copy_snapshot` raises `error`. Requesting
    again is harmless (and cancels a job that started after the first request)."""

    __slots__ = ("_context", "_group", "_lock", "error")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.error: PgmeshError | None = None
        self._context: Any = None
        self._group: str | None = None

    def request(self, error: PgmeshError) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
            context, group = self._context, self._group
        if context is not None and group is not None:
            context.cancelJobGroup(group)

    def check(self) -> None:
        """Raise the requested error, if any."""
        if self.error is not None:
            raise self.error

    def _attach(self, context: Any, group: str) -> None:
        with self._lock:
            self._context, self._group = context, group
        self.check()

    def _detach(self) -> None:
        with self._lock:
            self._context = self._group = None


def copy_snapshot(
    donor_dsn: str,
    target_dsn: str,
    snapshot: str,
    tables: Sequence[CopyTable],
    *,
    spark_master: str = "local[*]",
    partitions_per_table: int = 0,
    spark_conf: Mapping[str, str] | None = None,
    progress: Callable[[CopyProgress], None] | None = None,
    max_task_failures: int = 4,
    leaves: Sequence[Leaf] | None = None,
    abort: CopyAbort | None = None,
    application_name: str | None = None,
    lock_wait_s: float = 0.0,
    _fail_once_marker: str | None = None,
) -> CopyReport:
    """Copy every row of `tables` that `snapshot` (exported on the donor) shows into the target.

    Blocking: run it in a thread. The snapshot must stay importable until this returns: the caller
    keeps the connection that exported it (`pg_export_snapshot()` in an open REPEATABLE READ
    transaction, or the replication connection that created the slot with `SNAPSHOT 'export'`) open
    and idle for the whole call. Every task imports it (`SET TRANSACTION SNAPSHOT`).

    The target must already hold the tables (same names, columns and types; the pre-data schema) and
    should hold no indexes or constraints yet (build them after: post-data); the tables should be
    empty: rows are appended. Each task loads in one target transaction with
    `session_replication_role = replica` (no user triggers, no FK checks) and `synchronous_commit =
    off`, so a failed attempt leaves nothing behind and Spark retries it (up to `max_task_failures`
    attempts per task). Target sessions need SET on session_replication_role (docs/security.md).

    `partitions_per_table` > 0 splits each relation (each leaf partition of a partitioned table) into
    that many ctid ranges; 0 chooses from its size (one task below 8 MB). `progress` is called about
    twice a second from a helper thread, and once at the end (`final`) from this one; `ProgressBar()`
    is one for a terminal.

    `leaves` are the relations and sizes to plan from, read by the caller under the snapshot
    (`plan_leaves`, e.g. in the session that holds the tables' locks: router.cluster.copy.locks);
    without them a session of its own reads them (`read_leaves`). `lock_wait_s` > 0 is every donor
    session's `lock_timeout`; `abort` stops the copy from another thread; `application_name` names the
    tasks' sessions on both nodes (default "pgmesh copy <snapshot>"). `_fail_once_marker` is a test
    hook only: the first task attempt that creates this file fails after its COPY, before COMMIT.

    Raises `PgmeshError` (node "donor" or "target", the table, the SQL state) when a task still fails
    after its retries, a table is missing, or the snapshot cannot be imported.
    """
    started = time.monotonic()
    _check_arguments(snapshot, tables, partitions_per_table)
    if not tables:
        return CopyReport((), 0, 0, time.monotonic() - started, 0, 0)
    if leaves is None:
        leaves = read_leaves(donor_dsn, snapshot, tables, lock_wait_s=lock_wait_s)
    job = CopyJob(
        donor_dsn=donor_dsn,
        target_dsn=target_dsn,
        snapshot=snapshot,
        application_name=(application_name or APPLICATION_NAME_PREFIX + snapshot)[:63],
        tables=len(tables),
        lock_timeout_ms=max(0, round(lock_wait_s * 1000)),
        fail_once_marker=_fail_once_marker,
    )
    if abort is not None:
        abort.check()
    with spark_session(spark_master, spark_conf, max_task_failures=max_task_failures,
                       worker_modules=(run_partition.__module__,)) as spark:
        parallelism = local_parallelism(spark_master) or int(spark.sparkContext.defaultParallelism)
        tasks = plan_tasks(leaves, [t.columns for t in tables], requested=partitions_per_table,
                           parallelism=parallelism)
        logger.info("initial copy: %d tables, %d relations, %d tasks, snapshot %s",
                    len(tables), len(leaves), len(tasks), snapshot)
        outcomes = run_job(spark.sparkContext, job, tasks, len(tables), progress, started, max_task_failures,
                            abort)
    return report(tables, tasks, outcomes, time.monotonic() - started)


def _check_arguments(snapshot: str, tables: Sequence[CopyTable], partitions_per_table: int) -> None:
    if not snapshot:
        raise PgmeshError("no snapshot to copy from", hint=SNAPSHOT_HINT)
    if partitions_per_table < 0:
        raise PgmeshError(f"partitions_per_table must be >= 0, not {partitions_per_table}")
    seen: set[tuple[str, str]] = set()
    for table in tables:
        if not table.columns:
            raise PgmeshError("no columns to copy", relation=table.relation)
        if (table.schema, table.name) in seen:
            raise PgmeshError("table listed twice: its rows would be copied twice", relation=table.relation)
        seen.add((table.schema, table.name))


def read_leaves(
    donor_dsn: str, snapshot: str, tables: Sequence[CopyTable], *, lock_wait_s: float = 0.0
) -> list[Leaf]:
    """The relations that hold each table's rows (itself, or its leaf partitions) and their sizes in
    blocks, read on the donor in a transaction that imports `snapshot` (waiting at most `lock_wait_s`
    for each table's ACCESS SHARE lock, when > 0)."""
    try:
        with psycopg.connect(donor_dsn, autocommit=True, application_name="pgmesh copy plan") as conn:
            if lock_wait_s > 0:
                conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(round(lock_wait_s * 1000))))
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            try:
                conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
            except psycopg.Error as exc:
                raise PgmeshError(f"cannot import snapshot {snapshot!r}: {describe(exc)}", node="donor",
                                  sqlstate=exc.sqlstate, hint=SNAPSHOT_HINT) from None
            leaves = plan_leaves(conn, tables)
            conn.execute("COMMIT")
    except psycopg.Error as exc:
        raise PgmeshError(f"cannot plan the copy: {describe(exc)}", node="donor",
                          sqlstate=exc.sqlstate) from None
    return leaves


def plan_leaves(
    conn: psycopg.Connection[Any], tables: Sequence[CopyTable], *, node: str = "donor"
) -> list[Leaf]:
    """`read_leaves` on a session that already imported the snapshot (and, best, holds the tables'
    locks: reading a size takes ACCESS SHARE, which would otherwise queue behind a TRUNCATE). Each
    leaf also carries its table's COPY format, from the column types the snapshot sees (`Leaf.binary`)."""
    relation = None
    try:
        row = conn.execute("SELECT pg_catalog.current_setting('block_size')::int").fetchone()
        block_size = int(row[0]) if row is not None else DEFAULT_BLOCK_SIZE
        leaves: list[Leaf] = []
        for index, table in enumerate(tables):
            relation = table.relation
            leaves.extend(_table_leaves(conn, index, table, block_size))
    except psycopg.Error as exc:
        raise PgmeshError(f"cannot plan the copy: {describe(exc)}", node=node, relation=relation,
                          sqlstate=exc.sqlstate) from None
    names = [(leaf.schema, leaf.name) for leaf in leaves]
    for name in names:
        if names.count(name) > 1:
            raise PgmeshError("listed twice (as a table and as a partition of another listed table)",
                              node="donor", relation=".".join(name))
    return leaves


def _table_leaves(conn: psycopg.Connection[Any], index: int, table: CopyTable, block_size: int) -> list[Leaf]:
    root = conn.execute(_ROOT_SQL, [table.schema, table.name]).fetchone()
    if root is None:
        raise PgmeshError("no such table on the donor", node="donor", relation=table.relation)
    oid, relkind = root
    if relkind not in ("r", "p"):
        raise PgmeshError(f"not a table (relkind {relkind!r}): only tables and partitioned tables can be "
                          "copied", node="donor", relation=table.relation)
    binary = _binary_copy(conn, oid, table)
    if relkind == "r":  # a plain table (or itself a partition): pg_partition_tree would list it alone
        row = conn.execute(_SIZE_SQL, [oid]).fetchone()
        return [Leaf(index, table.schema, table.name, int(row[0]) if row else 0, block_size, binary)]
    leaves: list[Leaf] = []
    for schema, name, kind, nblocks in conn.execute(_LEAVES_SQL, [oid]).fetchall():
        if kind != "r":
            raise PgmeshError(f"partition {schema}.{name} is not a plain table (relkind {kind!r}); "
                              "foreign partitions cannot be copied", node="donor", relation=table.relation)
        leaves.append(Leaf(index, schema, name, int(nblocks), block_size, binary))
    return leaves


def _binary_copy(conn: psycopg.Connection[Any], oid: int, table: CopyTable) -> bool:
    """Whether `table` copies in binary COPY (faster): False when a copied column's type, or a type
    inside it, cannot make the round trip (`_TEXT_ONLY_TYPES_SQL`); then the table copies as text."""
    text_only = [row[0] for row in conn.execute(_TEXT_ONLY_TYPES_SQL, [oid, list(table.columns)]).fetchall()]
    if text_only:
        logger.info("table %s copies in text COPY, not binary: it holds %s, which binary COPY cannot carry",
                    table.relation, ", ".join(text_only))
    return not text_only


def run_job(  # (also `pgmesh push`'s: router.cluster.copy.push)
    sc: Any,
    job: CopyJob,
    tasks: Sequence[CopyTask],
    ntables: int,
    progress: Callable[[CopyProgress], None] | None,
    started: float,
    max_task_failures: int,
    abort: CopyAbort | None = None,
) -> list[TaskOutcome]:
    counters = sc.accumulator([0] * (3 + ntables), Counters())
    table_tasks = [0] * ntables
    for task in tasks:
        table_tasks[task.table] += 1
    poller = None
    if progress is not None:
        poller = Poller(progress, counters, table_tasks, target_dsn=job.target_dsn,
                        application_name=job.application_name, started=started)
        poller.start()
    outcomes: list[TaskOutcome] = []
    try:
        if tasks:
            if abort is not None:  # a job group that `abort` can cancel from another thread
                sc.setJobGroup(job.application_name, "pgmesh initial copy", interruptOnCancel=True)
                abort._attach(sc, job.application_name)
            rdd = sc.parallelize(list(tasks), len(tasks))
            outcomes = rdd.mapPartitions(functools.partial(run_partition, job, counters)).collect()
    except Exception as exc:
        if poller is not None:
            poller.stop()
        if abort is not None and abort.error is not None:
            raise abort.error from None
        raise _job_error(exc, max_task_failures) from None
    finally:
        if abort is not None:
            abort._detach()
    if poller is not None:
        exact = [len(outcomes), sum(o.rows for o in outcomes), sum(o.bytes for o in outcomes)]
        per_table = [0] * ntables
        for outcome in outcomes:
            per_table[outcome.table] += 1
        poller.stop([*exact, *per_table])
    return outcomes


def _job_error(exc: BaseException, max_task_failures: int) -> PgmeshError:
    """One PgmeshError from a failed Spark job: the last task failure it carries, or a summary."""
    text = str(exc)
    record = TaskFailure.last_in(text)
    if record is not None:
        role = str(record.get("role") or "")
        return PgmeshError(
            f"initial copy failed on the {role}: {record.get('message')} (a task failed"
            f" {max_task_failures} time(s); Spark gave up)",
            node=role or None,
            relation=record.get("relation"),
            sqlstate=record.get("sqlstate"),
            hint=record.get("hint"),
        )
    logger.debug("Spark copy job failed", exc_info=exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.match(line)]
    summary = errors[-1] if errors else (lines[0] if lines else type(exc).__name__)
    return PgmeshError(f"the Spark copy job failed: {summary[:300]}",
                       hint="see the Spark output above; check Java (17+) and that Spark workers can run")


def report(
    tables: Sequence[CopyTable], tasks: Sequence[CopyTask], outcomes: Sequence[TaskOutcome], seconds: float
) -> CopyReport:
    rows = [0] * len(tables)
    nbytes = [0] * len(tables)
    ntasks = [0] * len(tables)
    for task in tasks:
        ntasks[task.table] += 1
    for outcome in outcomes:
        rows[outcome.table] += outcome.rows
        nbytes[outcome.table] += outcome.bytes
    results = tuple(
        TableResult(t.schema, t.name, rows[i], nbytes[i], ntasks[i]) for i, t in enumerate(tables)
    )
    return CopyReport(
        tables=results,
        rows=sum(rows),
        bytes=sum(nbytes),
        seconds=seconds,
        tasks=len(tasks),
        retries=sum(o.attempt for o in outcomes),
    )
