"""One join attempt's copy under its snapshot, in rounds: the lock holder, the schema (once), the rows; and
what happens when the join gives way to the application (docs/join.md, "Locks").

While the rows are copied, the lock holder keeps ACCESS SHARE on every table to copy, so an application's
TRUNCATE or ALTER TABLE on the donor waits for the copy. When one has waited too long (`give_way`), the
round stops: the copy's sessions end, the tables it was filling are emptied on the new node, and the next
round copies again *under the same snapshot*. Its lock holder finds the tables truncated since the
snapshot (router.cluster.copy.locks): they need no copy, since the new node replays the TRUNCATE and what
follows, and they are neither copied nor locked any more. So an application that truncates a table
every few seconds meets the join once per table, and the join never gives up on it. A table rewritten by
ALTER TABLE since the snapshot cannot be read under it any more: that is the error of the attempt (SQL
state 40001: a new snapshot). Rounds that give way and find no table truncated since are bounded
(JOIN_ATTEMPTS in a row): then the attempt fails with the give-way error (55P03: a new snapshot).

Owns: the rounds, emptying the new node's tables between them, ending the copy's sessions left there.
Must not: take the snapshot or the positions, or decide whether a new attempt is made
(router.ops.join and router.errors.retry_join do), or put a DSN in a message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import psycopg
from psycopg import sql

from router.cluster.copy.initial import CopyAbort, CopyReport, CopyTable, copy_snapshot
from router.cluster.copy.locks import SnapshotLocks, give_way
from router.cluster.copy.schema import SchemaRestore, dump_and_restore_pre_data
from router.config.model import Config, NodeConfig
from router.errors import JOIN_ATTEMPTS, PgmeshError, describe
from router.nodes.connect import Conn

__all__ = ["Copied", "Rounds", "copy_in_rounds", "end_copy_sessions"]

logger = logging.getLogger(__name__)


class Rounds(NamedTuple):
    """What a join attempt copies: from `donor` into `new` (`target`: the join's session there), every
    table of `tables` that `snapshot` shows; `tag` prefixes the application_name of the join's sessions."""

    config: Config
    donor: NodeConfig
    new: NodeConfig
    target: Conn
    snapshot: str
    tables: Sequence[tuple[str, str]]
    tag: str
    lock_wait_s: float
    tmp: Path


class Copied(NamedTuple):
    """The copy of the round that finished, the schema restore's rest, the tables not copied because
    they were truncated after the snapshot, and how many rounds it took."""

    report: CopyReport
    restore: SchemaRestore
    truncated: tuple[str, ...]
    rounds: int


async def copy_in_rounds(
    job: Rounds, progress: Callable[[Any], None] | None = None, fail_copy: bool = False
) -> Copied:
    """Rounds until one copies everything it locked (module docstring)."""
    restore: SchemaRestore | None = None
    truncated: list[tuple[str, str]] = []
    rounds = idle = 0
    while True:
        rounds += 1
        abort = CopyAbort()
        watch = asyncio.create_task(
            give_way(job.donor.dsn, job.tag, abort, lock_wait_s=job.lock_wait_s, node=job.donor.name)
        )
        locks: SnapshotLocks | None = None
        try:
            wanted = [t for t in job.tables if tuple(t) not in truncated]
            locks = await asyncio.to_thread(  # the tables as the snapshot sees them, locked and planned
                SnapshotLocks.open, job.donor.dsn, job.snapshot, wanted, lock_wait_s=job.lock_wait_s,
                application_name=f"{job.tag}-locks", node=job.donor.name,
            )
            if locks.truncated:
                truncated += locks.truncated
                idle = 0
            if restore is None:
                restore = await dump_and_restore_pre_data(
                    job.new, job.donor, job.snapshot, job.tmp, job.tag, job.lock_wait_s
                )
            abort.check()
            if fail_copy:
                raise PgmeshError("the copy was stopped (test hook)", node=job.new.name)
            sync = job.config.sync
            report = await asyncio.to_thread(
                copy_snapshot, job.donor.dsn, job.new.dsn, job.snapshot, locks.tables,
                spark_master=sync.spark_master, partitions_per_table=sync.partitions_per_table,
                spark_conf=sync.spark_conf, progress=progress, leaves=locks.leaves, abort=abort,
                application_name=f"{job.tag}-copy", lock_wait_s=job.lock_wait_s,
            )
            abort.check()
            if rounds > 1:  # a task of a stopped round must not have written after it was stopped
                await _check_counts(job.target, report, truncated, job.new.name)
            return Copied(report, restore, tuple(f"{s}.{n}" for s, n in truncated), rounds)
        except (PgmeshError, psycopg.Error) as exc:
            if abort.error is None:
                if isinstance(exc, psycopg.Error):  # a donor session's (its lock_timeout ran out...)
                    raise PgmeshError(f"reading the donor failed: {describe(exc)}", node=job.donor.name,
                                      sqlstate=exc.sqlstate) from None
                raise
            cause = abort.error  # the join gave way: that is why this step failed
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            if locks is not None:
                await asyncio.to_thread(locks.close)  # the application's statements go on
        idle += 1
        if idle >= JOIN_ATTEMPTS:
            raise cause
        logger.warning("join of %s, round %d: %s; copying again under the same snapshot", job.new.name,
                       rounds, cause)
        await end_copy_sessions(job.target, job.tag)
        if locks is not None and restore is not None:
            await _empty(job.target, locks.tables, job.new.name)


async def _check_counts(
    target: Conn, report: CopyReport, truncated: Sequence[tuple[str, str]], node: str
) -> None:
    """After rounds that were stopped: the new node holds exactly the rows the last round copied, and
    none of the tables left to the stream. A Spark task of a stopped round is killed within seconds,
    but one that committed after the round's clean-up would have doubled rows: then a new snapshot."""
    expected = {(t.schema, t.name): t.rows for t in report.tables} | {name: 0 for name in truncated}
    for (schema, name), rows in expected.items():
        cur = await target.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, name)))
        found = int((await cur.fetchone() or (0,))[0])
        if found != rows:
            raise PgmeshError(
                f"the new node holds {found} rows where the copy wrote {rows}: a stopped round's task wrote"
                " after it was stopped", node=node, relation=f"{schema}.{name}", sqlstate="40001",
                hint="the join tries again with a new snapshot",
            )


async def _empty(target: Conn, tables: Sequence[CopyTable], node: str) -> None:
    """Empty the tables a stopped round was filling on the new node (no constraints there yet)."""
    if not tables:
        return
    names = sql.SQL(", ").join(sql.Identifier(t.schema, t.name) for t in tables)
    try:
        await target.execute(sql.SQL("TRUNCATE {}").format(names))
    except psycopg.Error as exc:
        raise PgmeshError(f"emptying the copied tables failed: {describe(exc)}", node=node,
                          sqlstate=exc.sqlstate, hint="run `pgmesh join` again") from None


async def end_copy_sessions(target: Conn, tag: str) -> None:
    """End the copy's sessions left on the new node by a stopped attempt or round (a cancelled Spark
    task's session ends when it notices its client went): their locks would hold up the clean-up."""
    query = (
        "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE starts_with(application_name, %s) AND pid <> pg_backend_pid()"
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        cur = await target.execute(query, [tag])
        if await cur.fetchone() is None:
            return
        await asyncio.sleep(0.2)
