"""Parallel apply of one link: a batch's first transactions on several target sessions ("lanes") at once.

`router.apply.parallel.plan_lanes` decides which transaction may run in which lane (pure planning); here the
lanes are opened (lane 0 is the link's main session, the others are opened on first use and live
until the link disconnects), the transactions run, and their commits are kept in source commit order:
each transaction holds a session advisory lock from before any lane starts until just after its
COMMIT, a transaction whose predecessor ran in another lane waits for that lock and then checks that
the origin's progress reached the predecessor's end, and every lane takes the source's replication
origin just to commit (PostgreSQL 15: one session per origin at a time). What got applied is read
back from the origin's progress.

Must not: decide conflicts, retry, pause, or record what was applied. A lane that fails rolls back and
frees what it holds (its successors see it did not commit, and stop); `Lanes.apply` says how many of the
batch are applied and whether one failed, and the applier records them and applies the rest one by one,
as without lanes. It works on its link's `LinkSession` (router.apply.link), never on the applier.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import zlib
from typing import NamedTuple

import asyncpg

from protocol.lsn import format_lsn
from protocol.transactions import Transaction
from router.apply.decide import Decisions
from router.apply.link import LinkSession
from router.apply.parallel import plan_lanes
from router.apply.parts import is_large
from router.apply.prepared import Prepared
from router.apply.scripts import transaction_segments
from router.apply.sessions import LET_ORIGIN_GO
from router.apply.statements import quote_literal
from router.errors import ApplyError, describe
from router.progress.applied import position_sql

__all__ = ["LaneRun", "Lanes"]

logger = logging.getLogger(__name__)

_NOT_COMMITTED = "pgmesh: the transaction before this one did not commit; "


class _Lane:
    """One session of a link's parallel apply, with its own prepared statements."""

    __slots__ = ("conn", "prepared")

    def __init__(self, conn: asyncpg.Connection, decisions: Decisions) -> None:
        self.conn = conn
        self.prepared = Prepared(decisions)


class LaneRun(NamedTuple):
    """What one `Lanes.apply` did: the batch's first `applied` transactions committed; `failed`: a lane
    failed (the transaction after those goes the careful way, alone, before lanes run again)."""

    applied: int
    failed: bool


class Lanes:
    """The parallel apply of one link (`lanes` sessions, the link's main session included)."""

    __slots__ = ("_extra", "_key", "_link", "_seq", "lanes")

    def __init__(self, link: LinkSession, lanes: int) -> None:
        self._link = link
        self.lanes = lanes
        self._extra: list[_Lane] = []  # sessions besides the main one
        self._key = zlib.crc32(link.origin.encode()) & 0x7FFFFFFF
        self._seq = 0

    def forget(self) -> None:
        """After a rolled-back transaction on any session: the prepared statements and decision functions
        of the main session and every lane start again (router.apply.link.LinkSession.forget_prepared)."""
        self._link.forget_prepared()
        for lane in self._extra:
            lane.prepared = Prepared(self._link.decisions, after=lane.prepared)

    def close(self) -> None:
        """Drop the lanes' sessions (the main one is the link's)."""
        conns = [lane.conn for lane in self._extra]
        self._extra = []
        for extra in conns:
            extra.terminate()

    async def _sessions(self) -> list[_Lane]:
        """Lane 0 is the main session; the others are opened on first use."""
        link = self._link
        assert link.conn is not None
        while len(self._extra) < self.lanes - 1:
            self._extra.append(_Lane(await link.open_other(), link.decisions))
        main = _Lane(link.conn, link.decisions)
        main.prepared = link.prepared
        return [main, *self._extra]

    async def apply(self, batch: list[Transaction]) -> LaneRun:
        """Run the batch's first transactions on several sessions at once, committed in source order;
        say how many are applied (0: none ran, the caller applies the batch one by one).

        Each transaction i holds a session advisory lock s_i from before any lane starts until just
        after its COMMIT. A transaction whose predecessor runs in another lane waits for s_(i-1), then
        checks that the origin's progress reached the predecessor's end (a lane that died releases its
        locks without committing: its successors must not commit either). Every lane takes the origin
        just to commit and gives it back at once (PostgreSQL 15: one session per origin at a time).
        """
        link = self._link
        small = list(itertools.takewhile(lambda t: not is_large(t), batch))
        lanes_of = plan_lanes(small, link.tables, self.lanes)
        if len(set(lanes_of)) < 2:
            return LaneRun(0, False)
        lanes = await self._sessions()
        key, origin = self._key, quote_literal(link.origin)
        preludes: dict[int, list[str]] = {lane: [] for lane in set(lanes_of)}
        scripts: dict[int, list[str]] = {lane: [] for lane in set(lanes_of)}
        marks = {lane: lanes[lane].prepared.mark() for lane in preludes}
        seqs: list[int] = []
        txns: list[Transaction] = []
        for i, (txn, lane) in enumerate(zip(batch, lanes_of, strict=False)):
            seq = (self._seq + i) % 0x7FFFFFFF
            before = [f"SELECT pg_catalog.pg_replication_origin_session_setup({origin})"]
            if i and lanes_of[i - 1] != lane:
                before.insert(0, f"SELECT pg_catalog.pg_advisory_xact_lock_shared({key}, {seqs[-1]})")
                before.append(
                    f"SELECT CASE WHEN {position_sql(origin, quote_literal(link.source), False)}"
                    f" >= '{format_lsn(txns[-1].end_lsn)}'::pg_lsn THEN 0 ELSE ('{_NOT_COMMITTED}'"
                    " || pg_catalog.now())::int END"
                )
            after = (f"SELECT pg_catalog.pg_replication_origin_session_reset();\n"
                     f"SELECT pg_catalog.pg_advisory_unlock({key}, {seq})")
            if link.fit(txn) is not txn:
                break  # rows to fit: the one-by-one path fits them against the tables read anew
            try:
                (script,) = transaction_segments(
                    txn, link.tables, prepared=lanes[lane].prepared,
                    guard_origin=link.source_origin, prelude=preludes[lane], copy=False,
                    at_commit=(";\n".join(before), after), setup_last=link.setup_last, mark=link.mark,
                )
            except ApplyError:
                break  # the one-by-one path deals with it
            assert isinstance(script, str)
            scripts[lane].append(script)
            seqs.append(seq)
            txns.append(txn)
        used = {lane for lane, lane_scripts in scripts.items() if lane_scripts}
        if len(used) < 2:
            used = set()
        for lane, mark in marks.items():
            if lane not in used:  # its PREPAREs are never sent
                lanes[lane].prepared.forget_since(mark)
        if not used:
            return LaneRun(0, False)
        self._seq += len(txns)
        for lane in used:
            await link.make_functions(lanes[lane].prepared)
        # Every lane's locks are held before any lane starts.
        reset = link.let_origin_go_sql()
        locks = {lane: [s for s, on in zip(seqs, lanes_of, strict=False) if on == lane] for lane in used}
        await asyncio.gather(*(
            lanes[lane].conn.execute(
                (reset if lane == 0 else "")
                + "SELECT " + ", ".join(f"pg_catalog.pg_advisory_lock({key}, {s})" for s in locks[lane])
            )
            for lane in used
        ))
        results = await asyncio.gather(*(
            self._run(lanes[lane].conn, "".join(f"{p};\n" for p in preludes[lane])
                      + "\n".join(scripts[lane]))
            for lane in used
        ))
        await link.take_origin()
        done = await link.origin_progress()
        applied = sum(1 for txn in txns if txn.end_lsn <= done)  # a prefix: committed in order
        if note := link.applied_note(txns[:applied]):  # 16+: the lanes' commits show no echo
            assert link.conn is not None
            await link.conn.execute(note)
        link.stats.parallel_batches += 1
        link.stats.parallel_transactions += applied
        return LaneRun(applied, any(exc is not None for exc in results))

    async def _run(self, conn: asyncpg.Connection, script: str) -> asyncpg.PostgresError | None:
        """One lane's script; on an error, roll back and free the origin and every lock it holds (its
        successors then see that it did not commit, and stop)."""
        try:
            await conn.execute(script)
        except asyncpg.PostgresError as exc:
            with contextlib.suppress(asyncpg.PostgresError):
                await conn.execute("ROLLBACK")
            await conn.execute(f"{LET_ORIGIN_GO};\nSELECT pg_catalog.pg_advisory_unlock_all()")
            if _NOT_COMMITTED not in str(exc):
                logger.debug("link %s: a lane stopped: %s", self._link.name, describe(exc))
            return exc
        return None
