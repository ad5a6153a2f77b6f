"""What one Spark task of the initial copy does: relay one ctid range from donor to target as COPY bytes.

Owns: the task's two sessions (donor: REPEATABLE READ READ ONLY importing the exported snapshot, with
the job's lock_timeout; target: `session_replication_role = replica`, `synchronous_commit = off`, one
transaction), the SQL of both COPY statements (binary, or text for a table the planner found a type in
that binary COPY cannot carry: `CopyTask.binary`, or between servers of different major versions), the
byte relay between them, the tagged error a failed task raises (the driver turns it back into a
`PgmeshError`), the per-task counters sent to the driver, and the test-only failure hook.

Must not: decode rows into Python values, import pyspark at module level (this module is imported by the
driver too; only `TaskContext` is imported, inside a running task), log or raise a DSN, or commit
anything on the target unless the whole range was copied: a failed task rolls back, so Spark's retry of
it cannot duplicate rows.

The relay reads the donor's COPY OUT with libpq's non-blocking PQgetCopyData on psycopg's `PGconn`
(one call per row, no generator per row) and writes the target through psycopg's `Copy` in 128 kB
blocks. `for data in copy_out: copy_in.write(data)` does the same work with about 1 us more Python per
row on each side, which on a 2-core machine is a third of the copy's CPU.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

import msgspec
import psycopg
from psycopg import pq, sql

from router.cluster.copy.plan import BlockRange, CopyTask
from router.errors import describe
from router.stream.items import binary_formats_match

__all__ = [
    "CHUNK_BYTES",
    "ERROR_TAG",
    "CopyJob",
    "Counters",
    "TaskFailure",
    "TaskOutcome",
    "between",
    "copy_in_sql",
    "copy_out_sql",
    "run_partition",
    "run_task",
    "upsert_sql",
]

logger = logging.getLogger(__name__)

CHUNK_BYTES: Final = 128 * 1024  # psycopg's largest write that it does not split (and copy) again
ERROR_TAG: Final = "pgmesh-copy-error:"
SNAPSHOT_HINT: Final = (
    "the exported snapshot must stay importable for the whole copy: keep the connection that exported it "
    "(or the replication connection that created the slot) open and idle until copy_snapshot returns"
)
# Text COPY reads back what the donor wrote whatever either node's settings (as pg_dump sets them): dates
# in ISO (unambiguous under any DateStyle), intervals in the postgres style, floats exactly.
_TEXT_SETTINGS_SQL: Final = (
    "SELECT pg_catalog.set_config('datestyle', 'ISO', false),"
    " pg_catalog.set_config('intervalstyle', 'postgres', false),"
    " pg_catalog.set_config('extra_float_digits', '3', false)"
)
_COPY_OUT = pq.ExecStatus.COPY_OUT
_COMMAND_OK = pq.ExecStatus.COMMAND_OK


class CopyJob(msgspec.Struct, frozen=True):
    """What every task of one copy shares. Its repr never shows the DSNs."""

    donor_dsn: str
    target_dsn: str
    snapshot: str
    application_name: str
    tables: int  # how many tables the copy has (the length of the per-table counters)
    lock_timeout_ms: int = 0  # > 0: the donor session's lock_timeout (a task never waits unbounded)
    fail_once_marker: str | None = None  # test-only: see `_claim_failure`
    # `pgmesh push`: the target writes as its own sessions do (constraints, triggers; replicated from
    # there), not under `session_replication_role = replica` (a receive-only target: replica)
    own_writes: bool = False

    def __repr__(self) -> str:
        return f"CopyJob(snapshot={self.snapshot!r}, application_name={self.application_name!r})"


class TaskOutcome(msgspec.Struct, frozen=True):
    """A finished task: rows (the target's COPY count) and bytes (of the COPY stream) copied."""

    table: int
    schema: str
    name: str
    rows: int
    bytes: int
    attempt: int  # Spark's attempt number of the attempt that succeeded: 0 unless retried


class Counters:
    """Spark accumulator parameter over a list of ints: [tasks, rows, bytes, tasks done per table...].

    Duck-typed like pyspark's AccumulatorParam, so this module does not import pyspark.
    """

    # Method names are pyspark's.
    def zero(self, value: list[int]) -> list[int]:
        return [0] * len(value)

    def addInPlace(self, value1: list[int], value2: list[int]) -> list[int]:
        for i, v in enumerate(value2):
            value1[i] += v
        return value1


class TaskFailure(Exception):
    """A task failed. Its text starts with a tagged record (role, relation, SQL state, message, hint)
    that survives Spark's exception wrapping; `TaskFailure.last_in(text)` reads it back on the driver."""

    def __init__(
        self, role: str, relation: str, message: str, sqlstate: str | None = None, hint: str | None = None
    ) -> None:
        self.record = {"role": role, "relation": relation, "message": message, "sqlstate": sqlstate,
                       "hint": hint}
        super().__init__(f"{ERROR_TAG} {json.dumps(self.record)}")

    @staticmethod
    def last_in(text: str) -> dict[str, Any] | None:
        """The record of the last TaskFailure mentioned in `text` (a Spark error), if any."""
        start = text.rfind(ERROR_TAG)
        if start < 0:
            return None
        try:
            record, _ = json.JSONDecoder().raw_decode(text[start + len(ERROR_TAG):].lstrip())
        except ValueError:
            return None
        return record if isinstance(record, dict) else None


class _InjectedFailure(Exception):
    """The test hook's failure (see `_claim_failure`)."""


class _DonorError(Exception):
    """The donor's COPY OUT failed (raised inside the relay, where both sessions are in use)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(describe(error))
        self.error = error


# ---------------------------------------------------------------------------------------------------------
# SQL


def _range_condition(block_range: BlockRange) -> sql.Composable:
    conditions: list[sql.Composable] = []
    if block_range.first > 0:
        conditions.append(sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({block_range.first},0)")))
    if block_range.end is not None:
        conditions.append(sql.SQL("ctid < {}::tid").format(sql.Literal(f"({block_range.end},0)")))
    if not conditions:
        return sql.SQL("")
    return sql.SQL(" WHERE ") + sql.SQL(" AND ").join(conditions)


def _format(task: CopyTask) -> sql.SQL:
    return sql.SQL("binary" if task.binary else "text")


def between(task: CopyTask, donor_version: int, target_version: int) -> CopyTask:
    """`task` as it copies between servers of these versions (server_version_num): text where the
    majors differ (binary formats are matched only within one: router.stream.items.binary_formats_match)."""
    if task.binary and not binary_formats_match(donor_version, [target_version]):
        return msgspec.structs.replace(task, binary=False)
    return task


def copy_out_sql(task: CopyTask) -> sql.Composed:
    """`COPY (SELECT cols FROM ONLY rel WHERE ctid range) TO STDOUT (FORMAT binary)` (a TID Range Scan);
    `FORMAT text` for a task whose table holds a type binary COPY cannot carry (`CopyTask.binary`), or
    between servers of different major versions (`run_task`: binary formats are matched only within one,
    router.stream.items.binary_formats_match). A task with a `query`: the columns of its rows."""
    columns = sql.SQL(", ").join(map(sql.Identifier, task.columns))
    if task.query is not None:  # the operator's SQL, as given (composed, never formatted: braces stay)
        return sql.Composed([
            sql.SQL("COPY (SELECT "), columns, sql.SQL(" FROM ("), sql.SQL(task.query),
            sql.SQL("\n) AS pgmesh_push) TO STDOUT (FORMAT "), _format(task), sql.SQL(")"),
        ])
    return sql.SQL("COPY (SELECT {} FROM ONLY {}{}) TO STDOUT (FORMAT {})").format(
        sql.SQL(", ").join(map(sql.Identifier, task.columns)),
        sql.Identifier(task.schema, task.name),
        _range_condition(task.range),
        _format(task),
    )


def copy_in_sql(task: CopyTask) -> sql.Composed:
    """COPY into the table, or (a task with `keys`) into the session's PUSH_TABLE (`upsert_sql`)."""
    into = sql.Identifier(PUSH_TABLE) if task.keys else sql.Identifier(task.schema, task.name)
    return sql.SQL("COPY {} ({}) FROM STDIN (FORMAT {})").format(
        into, sql.SQL(", ").join(map(sql.Identifier, task.columns)), _format(task),
    )


PUSH_TABLE: Final = "pgmesh_push"


def upsert_sql(task: CopyTask) -> tuple[sql.Composed, sql.Composed]:
    """A task with `keys`: the temporary table its COPY fills (the table's columns, dropped at commit),
    and the statement that writes its rows into the table: inserted, or updated where a row with the key
    differs (an identical row is left alone: nothing to replicate)."""
    table = sql.Identifier(task.schema, task.name)
    columns = sql.SQL(", ").join(map(sql.Identifier, task.columns))
    create = sql.SQL("CREATE TEMPORARY TABLE {} ON COMMIT DROP AS SELECT {} FROM {} WITH NO DATA").format(
        sql.Identifier(PUSH_TABLE), columns, table)
    others = [c for c in task.columns if c not in task.keys]
    if others:
        mine = sql.SQL(", ").join(sql.SQL("t.") + sql.Identifier(c) for c in others)
        theirs = sql.SQL(", ").join(sql.SQL("excluded.") + sql.Identifier(c) for c in others)
        action = sql.SQL("DO UPDATE SET ({}) = ROW({}) WHERE ROW({}) IS DISTINCT FROM ROW({})").format(
            sql.SQL(", ").join(map(sql.Identifier, others)), theirs, mine, theirs)
    else:
        action = sql.Composed([sql.SQL("DO NOTHING")])
    write = sql.SQL(
        "INSERT INTO {} AS t ({}) OVERRIDING SYSTEM VALUE SELECT {} FROM {} ON CONFLICT ({}) {}"
    ).format(
        table, columns, columns, sql.Identifier(PUSH_TABLE),
        sql.SQL(", ").join(map(sql.Identifier, task.keys)), action)
    return create, write


# ---------------------------------------------------------------------------------------------------------
# The task


def run_partition(job: CopyJob, counters: Any, tasks: Iterable[CopyTask]) -> Iterator[TaskOutcome]:
    """Spark's `mapPartitions` function: run each task of the partition (one, as the driver plans it),
    adding [1 task, rows, bytes, 1 for its table] to the `Counters` accumulator after each."""
    for task in tasks:
        try:
            outcome = run_task(job, task)
        except TaskFailure:
            raise
        except Exception as exc:  # anything else still reaches the driver as a record, not a traceback
            raise TaskFailure("", task.relation, f"a copy task failed: {describe(exc)}") from None
        if counters is not None:
            update = [0] * (3 + job.tables)
            update[0], update[1], update[2] = 1, outcome.rows, outcome.bytes
            update[3 + task.table] = 1
            counters.add(update)
        yield outcome


def run_task(job: CopyJob, task: CopyTask) -> TaskOutcome:
    """Copy one block range; on any failure roll the target back and raise `TaskFailure`."""
    attempt = _attempt_number()
    donor = _connect(job.donor_dsn, job, "donor", task)
    try:
        target = _connect(job.target_dsn, job, "target", task)
        try:
            task = between(task, donor.info.server_version, target.info.server_version)
            _open_snapshot(donor, job, task)
            _prepare_target(target, job, task)
            rows, nbytes = _copy_range(donor, target, job, task)
        finally:
            target.close()
    finally:
        donor.close()
    return TaskOutcome(task.table, task.schema, task.name, rows, nbytes, attempt)


def _attempt_number() -> int:
    try:
        from pyspark import TaskContext
    except ImportError:  # called outside Spark (a unit test)
        return 0
    context = TaskContext.get()
    return int(context.attemptNumber()) if context is not None else 0


def _fail(role: str, task: CopyTask, exc: BaseException, hint: str | None = None) -> TaskFailure:
    state = exc.sqlstate if isinstance(exc, psycopg.Error) else None
    return TaskFailure(role, task.relation, describe(exc), state, hint)


def _connect(dsn: str, job: CopyJob, role: str, task: CopyTask) -> psycopg.Connection[Any]:
    try:
        # both ends in UTF8: a donor and a new node whose databases' encodings differ convert through it
        # (binary COPY's text values are in the client encoding too)
        return psycopg.connect(dsn, autocommit=True, application_name=job.application_name,
                               client_encoding="UTF8")
    except psycopg.Error as exc:
        raise _fail(role, task, exc, f"cannot connect to the {role}") from None


def _open_snapshot(donor: psycopg.Connection[Any], job: CopyJob, task: CopyTask) -> None:
    try:
        if job.lock_timeout_ms > 0:  # COPY's ACCESS SHARE may queue behind an application's TRUNCATE
            donor.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(job.lock_timeout_ms)))
        if not task.binary:
            donor.execute(_TEXT_SETTINGS_SQL)
        donor.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        donor.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(job.snapshot)))
    except psycopg.Error as exc:
        # a snapshot no longer importable: 22023 before PostgreSQL 18, 42704 (undefined object) on 18
        hint = SNAPSHOT_HINT if exc.sqlstate in ("22023", "42704", "0A000", "25001") else None
        raise _fail("donor", task, exc, hint) from None


def _prepare_target(target: psycopg.Connection[Any], job: CopyJob, task: CopyTask) -> None:
    try:
        if not job.own_writes:
            target.execute("SET session_replication_role = replica")
        target.execute("SET synchronous_commit = off")
        if not task.binary:
            target.execute(_TEXT_SETTINGS_SQL)
    except psycopg.Error as exc:
        raise _fail("target", task, exc, "the target's role needs SET on session_replication_role"
                    " (GRANT SET ON PARAMETER session_replication_role, docs/security.md)") from None


def _copy_range(
    donor: psycopg.Connection[Any], target: psycopg.Connection[Any], job: CopyJob, task: CopyTask
) -> tuple[int, int]:
    """One target transaction: COPY FROM STDIN fed by the donor's COPY OUT; (rows, bytes)."""
    try:
        with target.transaction():
            cursor = target.cursor()
            if task.keys:
                create, write = upsert_sql(task)
                cursor.execute(create)
            with cursor.copy(copy_in_sql(task)) as copy_in:
                nbytes = _relay(donor, copy_out_sql(task).as_bytes(donor), copy_in.write)
            if task.keys:
                cursor.execute(write)
            rows = cursor.rowcount
            if job.fail_once_marker is not None and _claim_failure(job.fail_once_marker):
                raise _InjectedFailure("test hook: this attempt fails after its COPY, before COMMIT")
    except _DonorError as exc:
        raise _fail("donor", task, exc.error) from None
    except psycopg.Error as exc:
        raise _fail("target", task, exc) from None
    except _InjectedFailure as exc:
        raise TaskFailure("target", task.relation, str(exc)) from None
    return rows, nbytes


def _claim_failure(marker: str) -> bool:
    """Test-only hook: True for the one attempt that creates `marker` (atomically), False afterwards."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as exc:
        if exc.errno == errno.EEXIST:
            return False
        raise
    os.close(fd)
    return True


# ---------------------------------------------------------------------------------------------------------
# The relay


def _relay(donor: psycopg.Connection[Any], copy_out: bytes, write: Callable[[bytes], None]) -> int:
    """Run `copy_out` on the donor and pass every byte to `write` in CHUNK_BYTES blocks; the byte count."""
    pgconn = donor.pgconn
    encoding = donor.info.encoding
    try:
        pgconn.send_query(copy_out)
        _flush(pgconn)
        result = _next_result(pgconn)
        if result is None or result.status != _COPY_OUT:
            _drain(pgconn)
            raise _result_error(result, encoding)
    except psycopg.Error as exc:
        raise _DonorError(exc) from None
    get = pgconn.get_copy_data
    parts: list[memoryview] = []
    size = total = 0
    while True:
        nbytes, data = get(1)
        if nbytes > 0:
            parts.append(data)
            size += nbytes
            if size >= CHUNK_BYTES:
                write(b"".join(parts))
                total += size
                parts, size = [], 0
        elif nbytes == 0:
            _wait(pgconn, write=False)
            pgconn.consume_input()
        else:
            break
    if parts:
        write(b"".join(parts))
        total += size
    try:
        _finish_copy_out(pgconn, nbytes, encoding)
    except psycopg.Error as exc:
        raise _DonorError(exc) from None
    return total


def _finish_copy_out(pgconn: pq.abc.PGconn, last: int, encoding: str) -> None:
    """After PQgetCopyData returned `last` (-1 end, -2 error): the COPY's own result must be COMMAND_OK."""
    if last == -2:
        raise psycopg.OperationalError(f"COPY OUT failed: {pgconn.get_error_message(encoding)}")
    result = _next_result(pgconn)
    _drain(pgconn)
    if result is None or result.status != _COMMAND_OK:
        raise _result_error(result, encoding)


def _result_error(result: pq.abc.PGresult | None, encoding: str) -> psycopg.Error:
    if result is None:
        return psycopg.OperationalError("the donor returned no result for COPY")
    return psycopg.errors.error_from_result(result, encoding=encoding)


def _wait(pgconn: pq.abc.PGconn, *, write: bool) -> None:
    fd = pgconn.socket
    if write:
        select.select([fd], [fd], [])
    else:
        select.select([fd], [], [])


def _flush(pgconn: pq.abc.PGconn) -> None:
    while pgconn.flush() != 0:
        _wait(pgconn, write=True)
        pgconn.consume_input()


def _next_result(pgconn: pq.abc.PGconn) -> pq.abc.PGresult | None:
    while pgconn.is_busy():
        _wait(pgconn, write=False)
        pgconn.consume_input()
    return pgconn.get_result()


def _drain(pgconn: pq.abc.PGconn) -> None:
    while _next_result(pgconn) is not None:
        pass
