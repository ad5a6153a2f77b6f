"""The large path: a transaction too big for a batch, applied alone, in parts, with COPY where it can.

A transaction with more row changes than KEY_LOCKS_MAX, or one spilled to disk (`is_large`), is applied
alone, in one target transaction, LARGE_PART_CHANGES changes at a time (read back from the spool when it
spilled). Its runs of inserts go in by COPY where no conflict can hide from them
(router.apply.scripts.CopyRun), by guarded INSERTs where the table has tombstones. A plain transaction that
router.stream.source handed out at its first spill, before its commit, is applied as its spill file grows
(`growing_parts`) and committed once its commit has arrived; if the source loses it first, `Abandoned`
is raised and it comes again, whole. A streamed transaction that the side session applied ahead
(router.apply.side) is committed there instead.

Must not: retry, pause, or decide conflicts (a conflict raises: the applier rolls back and applies the
transaction the careful way). It runs on its applier's sessions, with the applier's view of the target
(tables, prepared statements, columns fitted after DDL).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import TYPE_CHECKING

import asyncpg
import msgspec

from protocol.messages import Relation
from protocol.transactions import SpilledChange, Transaction
from router.apply.scripts import CopyRun, transaction_segments
from router.apply.statements import KEY_LOCKS_MAX, ApplyError, Prepared, xact_setup_sql
from router.errors import PgmeshError
from router.stream.spool import iter_raw_chunks

if TYPE_CHECKING:
    from router.apply.applier import Applier
    from router.apply.side import SideTransaction

__all__ = [
    "LARGE_PART_CHANGES",
    "Abandoned",
    "Gone",
    "LargeApply",
    "growing_parts",
    "is_large",
    "whole_transaction",
]

LARGE_PART_CHANGES = 50_000  # changes of a large transaction turned into SQL / COPY at once


def is_large(txn: Transaction) -> bool:
    """Applied alone, in parts, with COPY for runs of inserts (LargeApply.apply)."""
    return txn.row_count > KEY_LOCKS_MAX or txn.spilled > 0


def whole_transaction(txn: Transaction) -> Transaction:
    """The whole transaction for one handed out before its commit, once the commit arrived."""
    spill = txn.spill
    if spill is not None and spill.early and spill.final is not None:
        whole: Transaction = spill.final
        return whole
    return txn


def _parts(txn: Transaction) -> Iterator[list[SpilledChange]]:
    """The transaction's changes in parts of at most LARGE_PART_CHANGES (read back from the spool
    when it spilled to disk; inserts the source left undecoded stay so, for COPY)."""
    yield from iter_raw_chunks(txn, max_changes=LARGE_PART_CHANGES)


class Abandoned(Exception):
    """A transaction handed out before its commit that the source lost (it is sent again, whole)."""

    def __init__(self, txn: Transaction) -> None:
        super().__init__(f"transaction {txn.xid} abandoned before its commit")
        self.txn = txn


class Gone(Exception):
    """A spill file read before its transaction's commit was abandoned (aborted, or sent again)."""


async def growing_parts(
    txn: Transaction, relations: dict[int, Relation]
) -> AsyncGenerator[tuple[list[SpilledChange], Transaction | None], None]:
    """The changes of `txn`, read before its commit while its spill file grows: parts of
    LARGE_PART_CHANGES as they are written, then the rest with the in-memory tail once the commit
    arrived; each part with the whole Transaction once the commit is there (None before). Before each
    part, `relations` gets the relations the source learnt meanwhile (`txn.relations` is the source
    assembler's own dict: it grows as later changes name more). Raises Gone when the file is
    abandoned before the commit."""
    spill = txn.spill
    live = txn.relations
    changed = spill.changed
    assert changed is not None
    pending: list[SpilledChange] = []
    pos = 0
    while True:
        changed.clear()
        final = spill.final
        if spill.abandoned and final is None:
            raise Gone
        try:
            got, pos = spill.read_frames(pos, LARGE_PART_CHANGES, raw=True)
        except PgmeshError:
            if spill.abandoned:
                raise Gone from None
            raise
        pending += got
        whole = final is not None and pos >= spill.size
        if whole:
            assert final is not None
            pending += final.changes  # the tail that never spilled
        while pending and (len(pending) >= LARGE_PART_CHANGES or whole):
            part = pending[:LARGE_PART_CHANGES]
            del pending[:LARGE_PART_CHANGES]
            for relid, relation in live.items():
                relations.setdefault(relid, relation)
            yield part, final
        if whole:
            return
        if not got:
            await changed.wait()


async def _once(data: bytes) -> AsyncIterator[bytes]:
    """`data` as an asynchronous iterable: asyncpg's COPY then sends it as it is (a file-like object
    would be read in a worker thread, chunk by chunk)."""
    yield data


class LargeApply:
    """The large path of one link's applier: on its main session, or on its side session (`side`)."""

    __slots__ = ("_link",)

    def __init__(self, link: Applier) -> None:
        self._link = link

    async def apply(self, txn: Transaction) -> Transaction:
        """A transaction with more row changes than KEY_LOCKS_MAX, alone: its runs of inserts go in by
        COPY where no conflict can hide from it (router.apply.scripts.CopyRun); a transaction spilled to
        disk is read back part by part, all in one target transaction. Returns the transaction applied
        (for one handed out before its commit: the whole one, see `_apply_growing`)."""
        link = self._link
        spill = txn.spill
        if spill is not None and spill.early and spill.final is not txn:
            return await self._apply_growing(txn)
        side = link._side.current
        if side is not None and spill is not None and side.spill is spill:  # applied ahead: commit it
            committed = await link._side.finish(side, txn)
            if committed:
                link.copied_transactions += 1
                return txn
        relations = dict(txn.relations)
        tombstones: dict[str, bool] = {}
        parts = _parts(txn)
        first = True
        part: list[SpilledChange] | None = next(parts)
        while part is not None:
            following: list[SpilledChange] | None = next(parts, None)
            await self.apply_part(txn, part, relations, tombstones, first, following is None)
            first = False
            part = following
        link.copied_transactions += 1
        return txn

    async def _apply_growing(self, txn: Transaction) -> Transaction:
        """A plain transaction that router.stream.source handed out at its first spill, before its commit:
        applied part by part as its spill file grows, in one target transaction that commits once the
        commit has arrived (the origin's xact_setup, which needs the commit's end LSN, goes just before
        COMMIT). If the source loses it first (a reconnect), raises Abandoned: the caller rolls back,
        and the transaction comes again, whole. On a conflict, waits for the whole transaction before
        raising, so that the careful path gets it (the applier's `_held[0]` becomes the whole one)."""
        link = self._link
        spill = txn.spill
        conn = link._conn
        assert spill is not None and conn is not None
        relations = dict(txn.relations)
        tombstones: dict[str, bool] = {}
        first = True
        try:
            async with contextlib.aclosing(growing_parts(txn, relations)) as parts:
                async for part, final in parts:
                    if first and final is None:
                        link.early_transactions += 1
                    await self.apply_part(txn, part, relations, tombstones, first, False, setup=False)
                    first = False
            final = spill.final
            assert final is not None
            whole_txn: Transaction = final
            await conn.execute(f"{xact_setup_sql(whole_txn)};\nCOMMIT")
        except Gone:
            raise Abandoned(txn) from None
        except asyncpg.PostgresError:
            while spill.final is None and not spill.abandoned:
                spill.changed.clear()
                await spill.changed.wait()
            if spill.final is None:
                raise Abandoned(txn) from None
            if link._held and link._held[0] is txn:
                link._held[0] = spill.final  # the careful path takes the whole transaction
            raise
        link.copied_transactions += 1
        return whole_txn

    async def apply_part(
        self,
        txn: Transaction,
        part: list[SpilledChange],
        relations: dict[int, Relation],
        tombstones: dict[str, bool],
        first: bool,
        last: bool,
        *,
        setup: bool = True,
        side: SideTransaction | None = None,
    ) -> None:
        """One part of a large transaction (`first` opens the target transaction, `last` commits it).
        `setup` False leaves the origin's xact_setup out of the first part: `_apply_growing` sends it
        with its own COMMIT (the end LSN is not known before). With `side`, on the side session."""
        link = self._link
        conn = link._conn if side is None else side.conn
        prepared = link._prepared if side is None else side.prepared
        assert conn is not None
        prelude: list[str] = []
        # A part of a large transaction locks whole tables, however few rows it has itself.
        piece = msgspec.structs.replace(
            txn, changes=part, relations=relations, row_count=max(txn.row_count, KEY_LOCKS_MAX + 1)
        )
        mark = prepared.mark()
        try:
            segments = self._segments(piece, prelude, relations, first, last, setup, prepared)
        except ApplyError:
            if not first or side is not None:
                raise
            await link._load_tables()  # the target's schema may have changed since we looked
            segments = self._segments(piece, prelude, relations, first, last, setup, prepared)
        try:
            if prelude:
                await conn.execute("".join(f"{p};\n" for p in prelude))
            for segment in segments:
                if isinstance(segment, str):
                    await conn.execute(segment)
                else:
                    await self._copy(conn, segment, tombstones)
        except BaseException:
            prepared.forget_since(mark)
            raise

    def _segments(
        self, txn: Transaction, prelude: list[str], relations: dict[int, Relation], begin: bool, commit: bool,
        setup: bool = True, prepared: Prepared | None = None,
    ) -> list[str | CopyRun]:
        link = self._link

        def build(t: Transaction) -> list[str | CopyRun]:
            return transaction_segments(
                t, link._tables, prepared=prepared or link._prepared, guard_origin=link._source_origin,
                prelude=prelude,
                relations=relations, begin=begin, commit=commit, setup=setup,
            )

        saved = dict(relations)
        try:
            return build(txn)
        except ApplyError:
            fitted = link._fit(txn)
            if fitted is txn:
                raise
            relations.clear()
            relations.update(saved)
            return build(fitted)

    async def _copy(self, conn: asyncpg.Connection, run: CopyRun, tombstones: dict[str, bool]) -> None:
        """One run of inserts by COPY, or by guarded INSERTs when the table has tombstones (a row
        deleted recently may be among them: decided as a conflict)."""
        if run.check_tombstones:
            name = run.table.name
            if name not in tombstones:
                tombstones[name] = bool(await conn.fetchval(
                    "SELECT EXISTS (SELECT 1 FROM pgmesh.tombstones WHERE table_name = $1)", name
                ))
            if tombstones[name]:
                await conn.execute(run.fallback())
                return
        schema, table = run.schema_and_name
        await conn.copy_to_table(table, schema_name=schema, columns=run.columns, source=_once(run.data()),
                                 format="text")
        self._link.copied_rows += len(run.rows)
