"""Progress of an initial copy, as the driver sees it, and the CLI's one-line progress bar.

Owns: the `CopyProgress` record, the `Poller` thread that builds one every interval from the job's
accumulator (finished tasks: rows, bytes, tables done) plus the rows and bytes of the COPYs still running
on the target (`pg_stat_progress_copy`, matched by the tasks' application_name), and `ProgressBar`.

Must not: slow the copy down or fail it: the target is polled over one connection at most twice a
second, and any error there only drops the in-flight part of the figures. Never prints a DSN.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TextIO

import msgspec
import psycopg

__all__ = ["MB", "CopyProgress", "Poller", "ProgressBar"]

logger = logging.getLogger(__name__)

MB: Final = 1024 * 1024
POLL_INTERVAL_S: Final = 0.5
IN_FLIGHT_SQL: Final = (
    "SELECT coalesce(sum(p.bytes_processed), 0)::bigint, coalesce(sum(p.tuples_processed), 0)::bigint"
    " FROM pg_catalog.pg_stat_progress_copy p JOIN pg_catalog.pg_stat_activity a ON a.pid = p.pid"
    " WHERE a.application_name = %s AND p.command = 'COPY FROM'"
)


class CopyProgress(msgspec.Struct, frozen=True):
    """Where a copy stands. `bytes` are binary COPY stream bytes (what crossed the wire)."""

    tables_done: int
    tables_total: int
    tasks_done: int
    tasks_total: int
    bytes: int
    rows: int
    elapsed: float  # seconds since copy_snapshot was called (Spark start-up included)
    copy_elapsed: float = 0.0  # seconds since the copy job itself started
    final: bool = False  # the last report of the copy

    @property
    def bytes_per_second(self) -> float:
        """The copy job's average rate so far (Spark start-up excluded)."""
        return self.bytes / self.copy_elapsed if self.copy_elapsed > 0 else 0.0


class ProgressBar:
    """A progress callback for the CLI: one line on stderr, rewritten in place, ended by the final report.

    `copy  3/5 tables  41/64 tasks  812.3 MB  7,100,000 rows  95.2 MB/s` (MB = 2^20 bytes).
    """

    __slots__ = ("_stream", "_width", "label")

    def __init__(self, stream: TextIO | None = None, label: str = "copy") -> None:
        self._stream = stream
        self._width = 0
        self.label = label

    @staticmethod
    def render(progress: CopyProgress, label: str = "copy") -> str:
        return (
            f"{label}  {progress.tables_done}/{progress.tables_total} tables"
            f"  {progress.tasks_done}/{progress.tasks_total} tasks"
            f"  {progress.bytes / MB:,.1f} MB  {progress.rows:,} rows"
            f"  {progress.bytes_per_second / MB:,.1f} MB/s"
        )

    def __call__(self, progress: CopyProgress) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        line = self.render(progress, self.label)
        pad = " " * max(0, self._width - len(line))
        self._width = len(line)
        stream.write(f"\r{line}{pad}")
        if progress.final:
            stream.write("\n")
            self._width = 0
        stream.flush()


class Poller:
    """Calls `callback` every POLL_INTERVAL_S from its own thread until `stop()`, then once more (final).

    `counters` is the job's accumulator: [tasks, rows, bytes, tasks done per table...]; `table_tasks`
    says how many tasks each table has (a table with none is done from the start).
    """

    __slots__ = ("_app", "_callback", "_conn", "_counters", "_dsn", "_job_started", "_last", "_started",
                 "_stop", "_table_tasks", "_thread")

    def __init__(
        self,
        callback: Callable[[CopyProgress], None],
        counters: Any,
        table_tasks: Sequence[int],
        *,
        target_dsn: str,
        application_name: str,
        started: float,
    ) -> None:
        self._callback = callback
        self._counters = counters
        self._table_tasks = list(table_tasks)
        self._dsn = target_dsn
        self._app = application_name
        self._started = started
        self._job_started = started
        self._conn: psycopg.Connection[Any] | None = None
        self._last = (0, 0)  # bytes, rows already reported: the figures never go backwards
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pgmesh copy progress", daemon=True)

    def start(self) -> None:
        """Start polling; the copy job starts now."""
        self._job_started = time.monotonic()
        self._thread.start()

    def stop(self, counts: Sequence[int] | None = None) -> None:
        """Stop polling and report the final figures (`counts`: the job's exact totals, when it succeeded)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        try:
            self._callback(self.snapshot(final=True, counts=counts))
        finally:
            self._close()

    def _run(self) -> None:
        while not self._stop.wait(POLL_INTERVAL_S):
            try:
                self._callback(self.snapshot())
            except Exception:
                logger.warning("copy progress callback failed; no more progress reports", exc_info=True)
                return

    def snapshot(self, *, final: bool = False, counts: Sequence[int] | None = None) -> CopyProgress:
        values = list(counts) if counts is not None else list(self._counters.value)
        tasks, rows, nbytes, per_table = values[0], values[1], values[2], values[3:]
        if not final:
            live_bytes, live_rows = self._in_flight()
            nbytes, rows = max(nbytes + live_bytes, self._last[0]), max(rows + live_rows, self._last[1])
            self._last = (nbytes, rows)
        pairs = zip(per_table, self._table_tasks, strict=True)
        tables_done = sum(1 for done, total in pairs if done >= total)
        return CopyProgress(
            tables_done=tables_done,
            tables_total=len(self._table_tasks),
            tasks_done=tasks,
            tasks_total=sum(self._table_tasks),
            bytes=nbytes,
            rows=rows,
            elapsed=time.monotonic() - self._started,
            copy_elapsed=time.monotonic() - self._job_started,
            final=final,
        )

    def _in_flight(self) -> tuple[int, int]:
        """Bytes and rows of the target COPYs still running (0, 0 when the target cannot be read)."""
        try:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(self._dsn, autocommit=True, connect_timeout=5,
                                             application_name="pgmesh copy progress")
            row = self._conn.execute(IN_FLIGHT_SQL, [self._app]).fetchone()
        except psycopg.Error as exc:
            logger.debug("copy progress: cannot read the target's COPY progress: %s", exc.sqlstate)
            self._close()
            return 0, 0
        return (int(row[0]), int(row[1])) if row is not None else (0, 0)

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
