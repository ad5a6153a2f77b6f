"""The large path: a transaction too big for a batch, applied alone, in parts, with COPY where it can.

A transaction with more row changes than KEY_LOCKS_MAX, or one spilled to disk (`is_large`), is applied
alone, in one target transaction, LARGE_PART_CHANGES changes at a time (router.apply.parts; read back
from the spool when it spilled). Its runs of inserts go in by COPY where no conflict can hide from them
(router.apply.scripts.CopyRun), by guarded INSERTs where the table has tombstones. A plain transaction
that router.stream.source handed out at its first spill, before its commit, is applied as its spill file
grows (`growing_parts`) and committed once its commit has arrived; if the source loses it first,
`router.errors.LostBeforeCommit` is raised and it comes again, whole. (A streamed transaction that the
side session applied ahead is committed there: router.apply.side.) The DDL a large transaction carries
(router.ddl.messages) is run in place, in the same target transaction, by the applier's `run_ddl`, and
the rows after it are built against the target's tables as that DDL left them: a huge transaction
with DDL stays on this path, read part by part, whether it spilled, was handed out before its commit,
or neither (the careful path would hold it whole in memory, and cannot start before the commit).

Must not: retry, pause, or decide conflicts (a conflict raises: the applier rolls back and applies the
transaction the careful way). It works on its link's `LinkSession` (router.apply.link): the main session,
or the side session's connection when it is given one, with the link's view of the target (tables,
prepared statements, columns fitted after DDL).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import msgspec

from protocol.messages import Message, Relation
from protocol.transactions import SpilledChange, Transaction
from router.apply.link import LinkSession
from router.apply.parts import growing_parts, parts
from router.apply.prepared import Prepared
from router.apply.scripts import COMMIT_CHECKS, CopyRun, transaction_segments
from router.apply.statements import KEY_LOCKS_MAX, TargetTable, quote_ident, xact_setup_sql
from router.ddl.messages import DDL_PREFIX
from router.errors import ApplyError, LostBeforeCommit

__all__ = ["DdlRunner", "LargeApply"]

# Runs one captured DDL command inside the open target transaction and reads the target's tables
# again (router.apply.applier.Applier._run_ddl).
DdlRunner = Callable[[Any, Message], Awaitable[object]]


def _split_at_ddl(part: list[SpilledChange]) -> list[tuple[list[SpilledChange], Message | None]]:
    """`part` as runs of changes, each followed by the DDL message that ends it (None after the last)."""
    out: list[tuple[list[SpilledChange], Message | None]] = []
    start = 0
    for i, change in enumerate(part):
        if type(change) is Message and change.prefix == DDL_PREFIX:
            out.append((part[start:i], change))
            start = i + 1
    if not out:
        return [(part, None)]
    out.append((part[start:], None))
    return out


COPY_CHECK_MAX = 100_000  # tombstones of a table looked up after a COPY at most (more: guarded INSERTs)


def copy_check_sql(table: TargetTable) -> str | None:
    """Whether a tombstone of `table` ($1) holds the key of a row now in it (a key too long, kept by its
    md5, counts as found); None for a table without a primary key (its tombstones cannot be looked up)."""
    if not table.pk or tuple(table.tombstone_key) != tuple(table.pk):
        return None
    md5 = "ts.key[1] LIKE 'pgmesh:md5:%'"
    match = " AND ".join(
        f"r.{quote_ident(k)} = (CASE WHEN {md5} THEN NULL ELSE ts.key[{i}] END)::{table.compare[k]}"
        for i, k in enumerate(table.pk, 1)
    )
    return (
        f"SELECT EXISTS (SELECT 1 FROM pgmesh.tombstones AS ts WHERE ts.table_name = $1"
        f" AND ({md5} OR EXISTS (SELECT 1 FROM {table.qualified} AS r WHERE {match})))"
    )


async def _once(data: bytes) -> AsyncIterator[bytes]:
    """`data` as an asynchronous iterable: asyncpg's COPY then sends it as it is (a file-like object
    would be read in a worker thread, chunk by chunk)."""
    yield data


class LargeApply:
    """The large path of one link: on its main session, or on the side session's (`apply_part`)."""

    __slots__ = ("_link", "_ran_ddl", "_run_ddl")

    def __init__(self, link: LinkSession, run_ddl: DdlRunner | None = None) -> None:
        """`run_ddl`: how a DDL message is run (without it, a transaction with DDL is refused)."""
        self._link = link
        self._run_ddl = run_ddl
        self._ran_ddl = False  # DDL ran in the target transaction now open (its tables were read in it)

    async def apply(self, txn: Transaction) -> Transaction:
        """A transaction with more row changes than KEY_LOCKS_MAX, alone: its runs of inserts go in by
        COPY where no conflict can hide from it (router.apply.scripts.CopyRun); a transaction spilled to
        disk is read back part by part, all in one target transaction, its DDL run in place. Returns the
        transaction applied (for one handed out before its commit: the whole one, see `_apply_growing`)."""
        spill = txn.spill
        if spill is not None and spill.early and spill.final is not txn:
            return await self._apply_growing(txn)
        relations = dict(txn.relations)
        tombstones: dict[str, int] = {}
        pieces = parts(txn)
        first = True
        self._ran_ddl = False
        try:
            part: list[SpilledChange] | None = next(pieces)
            while part is not None:
                following: list[SpilledChange] | None = next(pieces, None)
                await self.apply_part(txn, part, relations, tombstones, first, following is None)
                first = False
                part = following
        except Exception:
            await self._undo_ddl()
            raise
        if note := self._link.applied_note([txn]):  # committed: 16+ shows no echo of it
            assert self._link.conn is not None
            await self._link.conn.execute(note)
        await self._done()
        return txn

    async def _apply_growing(self, txn: Transaction) -> Transaction:
        """A plain transaction that router.stream.source handed out at its first spill, before its commit:
        applied part by part as its spill file grows, in one target transaction that commits once the
        commit has arrived (the origin's xact_setup, which needs the commit's end LSN, goes just before
        COMMIT). If the source loses it first (a reconnect), raises LostBeforeCommit: the caller rolls
        back, and the transaction comes again, whole. On a conflict, waits for the whole transaction
        before raising, so that the careful path gets it (`router.apply.parts.whole_transaction`)."""
        link = self._link
        spill = txn.spill
        conn = link.conn
        assert spill is not None and conn is not None
        relations = dict(txn.relations)
        tombstones: dict[str, int] = {}
        first = True
        self._ran_ddl = False
        try:
            async with contextlib.aclosing(growing_parts(txn, relations)) as growing:
                async for part, final in growing:
                    if first and final is None:
                        link.stats.early_transactions += 1
                    await self.apply_part(txn, part, relations, tombstones, first, False, setup=False)
                    first = False
            final = spill.final
            assert final is not None
            whole_txn: Transaction = final
            await conn.execute(f"{COMMIT_CHECKS};\n{xact_setup_sql(whole_txn, mark=link.mark)};\nCOMMIT;"
                               f"{link.applied_note([whole_txn])}")
        except asyncpg.PostgresError:
            await self._undo_ddl()
            while spill.final is None and not spill.abandoned:
                spill.changed.clear()
                await spill.changed.wait()
            if spill.final is None:
                raise LostBeforeCommit(txn) from None
            raise
        except Exception:
            await self._undo_ddl()
            raise
        await self._done()
        return whole_txn

    async def _done(self) -> None:
        """The transaction committed on the target."""
        link = self._link
        link.stats.copied_transactions += 1
        if self._ran_ddl:
            self._ran_ddl = False
            link.stats.ddl_applied += 1
            await link.reload_tables()

    async def _undo_ddl(self) -> None:
        """The transaction failed after its DDL ran: roll it back now and read the target's tables as
        they are without it (they were read inside it). The caller rolls back (again) as after any
        failure."""
        if not self._ran_ddl:
            return
        self._ran_ddl = False
        conn = self._link.conn
        if conn is None or conn.is_closed():
            return  # the next session reads them
        with contextlib.suppress(asyncpg.PostgresError, OSError):
            await conn.execute("ROLLBACK")
            await self._link.reload_tables()

    async def apply_part(
        self,
        txn: Transaction,
        part: list[SpilledChange],
        relations: dict[int, Relation],
        tombstones: dict[str, int],
        first: bool,
        last: bool,
        *,
        setup: bool = True,
        side: tuple[asyncpg.Connection, Prepared] | None = None,
    ) -> None:
        """One part of a large transaction (`first` opens the target transaction, `last` commits it).
        `setup` False leaves the origin's xact_setup out of the first part: `_apply_growing` sends it
        with its own COMMIT (the end LSN is not known before). With `side` (the side session's
        connection and prepared statements), on the side session. A DDL message among the changes is
        run where it stands (`run_ddl`), and the changes after it are built once it ran."""
        pieces = _split_at_ddl(part)
        for n, (changes, ddl) in enumerate(pieces):
            opening = first and n == 0
            closing = last and n == len(pieces) - 1
            await self._apply_piece(txn, changes, relations, tombstones, opening, closing, setup, side)
            if ddl is not None:
                if side is not None or self._run_ddl is None:
                    raise ApplyError(f"a DDL command in transaction {txn.xid} cannot be run on this session",
                                     lsn=ddl.lsn)
                conn = self._link.conn
                assert conn is not None
                self._ran_ddl = True
                await self._run_ddl(conn, ddl)

    async def _apply_piece(
        self,
        txn: Transaction,
        part: list[SpilledChange],
        relations: dict[int, Relation],
        tombstones: dict[str, int],
        first: bool,
        last: bool,
        setup: bool,
        side: tuple[asyncpg.Connection, Prepared] | None,
    ) -> None:
        """`apply_part` for changes without DDL among them."""
        link = self._link
        conn, prepared = (link.conn, link.prepared) if side is None else side
        assert conn is not None
        prelude: list[str] = []
        # A part of a large transaction locks whole tables, however few rows it has itself.
        piece = msgspec.structs.replace(
            txn, changes=part, relations=relations, row_count=max(txn.row_count, KEY_LOCKS_MAX + 1)
        )
        mark = prepared.mark()
        reread = first and side is None  # the tables may be read again before the first part only
        try:  # rows are fitted (sent before a rename or drop) only against tables just read, where it can
            segments = self._segments(piece, prelude, relations, first, last, setup, prepared, fit=not reread)
        except ApplyError:
            if not reread:
                raise
            await link.load_tables()  # the target's schema may have changed since we looked
            segments = self._segments(piece, prelude, relations, first, last, setup, prepared)
        try:
            await link.make_functions(prepared)
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
        setup: bool = True, prepared: Prepared | None = None, fit: bool = True,
    ) -> list[str | CopyRun]:
        link = self._link

        def build(t: Transaction) -> list[str | CopyRun]:
            return transaction_segments(
                t, link.tables, prepared=prepared or link.prepared, guard_origin=link.source_origin,
                prelude=prelude,
                relations=relations, begin=begin, commit=commit, setup=setup, setup_last=link.setup_last,
                mark=link.mark,
            )

        saved = dict(relations)
        try:
            return build(txn)
        except ApplyError:
            fitted = link.fit(txn) if fit else txn
            if fitted is txn:
                raise
            relations.clear()
            relations.update(saved)
            return build(fitted)

    async def _copy(self, conn: asyncpg.Connection, run: CopyRun, tombstones: dict[str, int]) -> None:
        """One run of inserts by COPY, or by guarded INSERTs when the table has tombstones (a row
        deleted recently may be among them: decided as a conflict).

        With fewer tombstones than rows (a table keyed by its primary key), still COPY, in a savepoint,
        then look each tombstone's key up in the table (held under its exclusive lock: no decider adds
        one meanwhile): none found, the COPY stands; one found, it is undone and the guarded INSERTs
        decide. The cost is one index probe per tombstone, not a check per row."""
        probe: str | None = None  # the lookup after the COPY, when the table has tombstones
        if run.check_tombstones:
            name = run.table.name
            if name not in tombstones:
                tombstones[name] = int(await conn.fetchval(
                    "SELECT count(*) FROM (SELECT FROM pgmesh.tombstones WHERE table_name = $1 LIMIT $2)"
                    " AS t",
                    name, COPY_CHECK_MAX,
                ))
            if tombstones[name]:
                probe = copy_check_sql(run.table)
                if probe is None or tombstones[name] >= min(len(run.rows), COPY_CHECK_MAX):
                    await conn.execute(run.fallback())
                    return
        schema, table = run.schema_and_name
        if probe is not None:
            await conn.execute("SAVEPOINT pgmesh_copy")
        await conn.copy_to_table(table, schema_name=schema, columns=run.columns, source=_once(run.data()),
                                 format="text")
        if probe is not None:
            if await conn.fetchval(probe, run.table.name):
                await conn.execute("ROLLBACK TO SAVEPOINT pgmesh_copy; RELEASE SAVEPOINT pgmesh_copy")
                await conn.execute(run.fallback())
                return
            await conn.execute("RELEASE SAVEPOINT pgmesh_copy")
        self._link.stats.copied_rows += len(run.rows)
