"""The side session of one link: a streamed transaction applied on the target before its commit.

A streamed transaction announced before its commit (router.stream.items.EarlyStream, handed over by
`LinkQueue.get_side`) is applied on a second session (the "side" session) as its spill file grows, in
one open target transaction, while the applier's main session goes on with what commits before it.
When its commit comes to the head of the queue, the main session hands the origin over and the side
session commits it there, in commit order (`SideSession.finish`). The two sessions never wait for each
other: the main session starts no batch that touches a table the side transaction holds (it rolls the
side transaction back first: `SideSession.gate`), and the side session takes no table the main session
is writing. Anything unusual (a subtransaction aborted after part of it spilled, a TRUNCATE, DDL, a
conflict, an abort, a reconnect) rolls the side transaction back, and the transaction is applied the
normal way at its commit.

Must not: commit anything out of commit order, or hold a transaction open while its link is paused,
stopped or reconnecting (the applier drops the side session then). It works on its link's `LinkSession`
(router.apply.link), never on the applier, and counts what it did in the link's `stats.early_streams*`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import asyncpg

from protocol.messages import Message, Relation, Truncate
from protocol.transactions import SpilledChange, Transaction
from router.apply.large import LargeApply
from router.apply.link import LinkSession
from router.apply.parts import growing_parts
from router.apply.prepared import Prepared
from router.apply.scripts import COMMIT_CHECKS
from router.apply.sessions import LET_ORIGIN_GO, take_origin
from router.apply.statements import quote_literal, xact_setup_sql
from router.ddl.messages import has_ddl
from router.errors import LostBeforeCommit, describe
from router.progress.positions import LinkProgress
from router.stream.items import EarlyStream
from router.stream.linkqueue import LinkQueue
from router.stream.spool import SpillFile

__all__ = ["SideSession", "SideTransaction"]

logger = logging.getLogger(__name__)


class _SideStop(Exception):
    """The side session gives up on its transaction (it is applied the normal way at its commit)."""


class SideTransaction:
    """A streamed transaction applied before its commit on a session of its own (SideSession._apply)."""

    __slots__ = ("conn", "finishing", "generation", "item", "prepared", "tables", "task", "why")

    def __init__(self, item: EarlyStream, generation: int) -> None:
        self.item = item
        self.generation = generation  # LinkQueue.cleared when it began
        self.conn: asyncpg.Connection | None = None
        # No decision functions: the commit time is not known before the commit (the announcement's is
        # zero), and a conflict decided against it loses (its change is dropped) wherever the local row
        # is newer than 2000-01-01. Guarded statements raise at a conflict instead: the side transaction
        # is rolled back and the transaction decided at its commit, with its commit time.
        self.prepared = Prepared()
        self.tables: set[tuple[str, str]] = set()  # every table it may have locked
        self.task: asyncio.Task[None] | None = None
        self.finishing = False  # the main session is committing it (or taking it over)
        self.why: str | None = None  # why it stopped short

    @property
    def spill(self) -> SpillFile:
        return self.item.spill


def _side_check(part: list[SpilledChange]) -> None:
    """What the side session does not take: a TRUNCATE (an exclusive lock for the whole stream), a
    logical message (DDL goes the careful way). A subtransaction's changes it takes: one aborted after
    they spilled is listed in the commit's `aborted_subxids`, and the side transaction is then rolled
    back (`SideSession._apply`)."""
    for change in part:
        kind = type(change)
        if kind is Truncate or kind is Message:
            raise _SideStop("it has a TRUNCATE or a logical message")


class SideSession:
    """At most one streamed transaction of a link applied ahead of its commit (`current`). It takes the
    announcements from the link's `queue`, drops one the target has already (`progress`), and starts none
    while the link is paused (`resumed` not set) or applies with a delay."""

    __slots__ = ("_large", "_link", "_main_idle", "_main_tables", "_progress", "_queue", "_resumed",
                 "current", "enabled")

    def __init__(self, link: LinkSession, large: LargeApply, queue: LinkQueue, progress: LinkProgress,
                 resumed: asyncio.Event) -> None:
        self._link = link
        self._large = large
        self._queue = queue
        self._progress = progress
        self._resumed = resumed
        replication = link.config.replication
        self.enabled = replication.early_apply and replication.apply_delay_ms <= 0
        self.current: SideTransaction | None = None
        self._main_tables: frozenset[tuple[str, str]] = frozenset()  # the main session's batch writes these
        self._main_idle = asyncio.Event()

    def main_done(self) -> None:
        """The main session's batch is over: it writes no table now."""
        self._main_tables = frozenset()
        self._main_idle.set()

    def _wanted(self) -> bool:
        return (self.enabled and self._link.conn is not None and self._resumed.is_set()
                and self.current is None)

    async def watch(self) -> None:
        """Start a side session on each announced streamed transaction (one at a time); drop one whose
        commit will not come to this link (aborted, resent, the link re-reads, applied already)."""
        link = self._link
        while True:
            item = await self._queue.get_side(1.0)
            self._check()
            if item is None:
                continue
            if not self._wanted() or item.spill.abandoned or item.spill.deleted:
                item.spill.drop_ref()
                continue
            side = self.current = SideTransaction(item, self._queue.cleared)
            link.stats.early_streams += 1
            side.task = asyncio.create_task(self._run(side), name=f"side apply {link.name}")

    def _check(self) -> None:
        side = self.current
        if side is None or side.finishing:
            return
        final = side.spill.final
        if side.spill.abandoned:
            self.drop("the source transaction was aborted, or it will be sent again")
        elif self._queue.cleared != side.generation:
            self.drop("the link re-reads its source")
        elif final is not None and final.end_lsn <= self._progress.applied:
            self.drop("the target has it already")

    async def _run(self, side: SideTransaction) -> None:
        try:
            await self._apply(side)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            side.why = str(exc) if isinstance(exc, _SideStop) else describe(exc)
            conn, side.conn = side.conn, None
            if conn is not None:
                conn.terminate()  # rolls its transaction back
            if not side.finishing and self.current is side:
                self.drop(side.why)

    async def _apply(self, side: SideTransaction) -> None:
        """Apply the announced transaction as its spill file grows, in one target transaction left
        open (the main session commits it: `finish`). Returns once all of it is applied."""
        link = self._link
        spill, txn = side.spill, side.item.txn
        conn = side.conn = await link.open_other()
        # Its rows are written under an origin of their own (the main session holds the source's): the
        # target's walsender streams them as an echo, not as a transaction of this node.
        early = link.config.early_origin_name(link.source)
        await conn.execute("SELECT pg_catalog.pg_replication_origin_create($1)"
                           " WHERE pg_catalog.pg_replication_origin_oid($1) IS NULL", early)
        await take_origin(conn, early)
        relations = dict(txn.relations)
        tombstones: dict[str, int] = {}
        first = True
        try:
            async with contextlib.aclosing(growing_parts(txn, relations)) as parts:
                async for part, final in parts:
                    if spill.abandoned:
                        raise LostBeforeCommit(txn)
                    if final is not None and final.aborted_subxids:
                        raise _SideStop("a subtransaction of it was aborted")
                    _side_check(part)
                    await self._take_tables(side, relations)
                    await self._large.apply_part(txn, part, relations, tombstones, first, False,
                                                 setup=False, side=(conn, side.prepared))
                    first = False
        except LostBeforeCommit:
            raise _SideStop("the source transaction was aborted, or it will be sent again") from None
        if first:
            raise _SideStop("nothing of it was applied before its commit")

    async def _take_tables(self, side: SideTransaction, relations: dict[int, Relation]) -> None:
        """Before the side session locks a table, wait until the main session's batch is not writing it."""
        new = {(r.schema, r.name) for r in relations.values()} - side.tables
        while new & self._main_tables:
            self._main_idle.clear()
            await self._main_idle.wait()
        side.tables |= new

    def gate(self, batch: list[Transaction]) -> None:
        """The main session is about to apply `batch`: if what comes before the side transaction's commit
        writes a table the side transaction holds (or runs DDL), the side transaction is rolled back,
        else the side session keeps off those tables until the batch is done."""
        side = self.current
        if side is None or side.finishing:
            return
        names: set[tuple[str, str]] = set()
        for txn in batch:
            if txn.spill is side.spill:
                break
            if has_ddl(txn):
                self.drop("DDL comes before its commit")
                return
            names.update((r.schema, r.name) for r in txn.relations.values())
        if names & side.tables:
            self.drop("a transaction that commits before it writes the same tables")
            return
        self._main_tables = frozenset(names)
        self._main_idle.set()  # the side session re-checks: what it waited for may be free now

    async def commit(self, txn: Transaction) -> bool:
        """`txn`'s commit is next: if the side session applied it ahead, commit it there now; False when
        it did not, or cannot (the caller applies `txn` the normal way)."""
        side = self.current
        if side is None or txn.spill is None or side.spill is not txn.spill:
            return False
        committed = await self._finish(side, txn)
        if committed:
            self._link.stats.copied_transactions += 1
        return committed

    async def _finish(self, side: SideTransaction, txn: Transaction) -> bool:
        """Commit the side session's transaction now, under the origin (handed over by the main
        session); False when it cannot be."""
        link = self._link
        main = link.conn
        assert main is not None
        side.finishing = True
        committed = False
        self._main_tables = frozenset()  # the main session writes nothing until this is done
        self._main_idle.set()
        try:
            if side.task is not None:
                await asyncio.wait({side.task})
            conn = side.conn
            if side.why is not None or conn is None:
                return False
            await link.let_origin_go()
            try:
                await conn.execute(
                    f"{COMMIT_CHECKS};\n"  # what could fail at COMMIT fails before the origin is taken
                    "SELECT pg_catalog.pg_replication_origin_session_reset();\n"
                    f"SELECT pg_catalog.pg_replication_origin_session_setup({quote_literal(link.origin)});\n"
                    f"{xact_setup_sql(txn, mark=link.mark)};\nCOMMIT;\n"
                    "SELECT pg_catalog.pg_replication_origin_session_reset()"
                    # 16+: the stream shows no echo of it; this stands for it (router.stream.seen)
                    + (f";\nSELECT {note}" if (note := link.applied_message([txn])) else "")
                )
                committed = True
            except asyncpg.PostgresError as exc:
                side.why = f"its commit failed: {describe(exc)}"
                with contextlib.suppress(Exception):
                    await conn.execute(f"ROLLBACK;\n{LET_ORIGIN_GO}")
            except (OSError, asyncpg.InterfaceError) as exc:
                side.why = f"its session was lost while committing: {describe(exc)}"
                conn.terminate()
                side.conn = None
                await link.take_origin()
                committed = await link.origin_progress() >= txn.end_lsn
            return committed
        finally:
            self.drop(side.why, committed=committed)
            await link.take_origin()

    def drop(self, why: str | None, *, committed: bool = False) -> None:
        """End the side session: its transaction committed, or rolled back (`why`)."""
        side, self.current = self.current, None
        if side is None:
            return
        self._main_idle.set()
        task = side.task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        conn, side.conn = side.conn, None
        if conn is not None:
            conn.terminate()
        side.spill.drop_ref()
        link = self._link
        if committed:
            link.stats.early_streams_committed += 1
            return
        link.stats.early_streams_dropped += 1
        logger.info("link %s: streamed transaction %s no longer applied ahead of its commit: %s", link.name,
                    side.item.txn.xid, why or "stopped")
