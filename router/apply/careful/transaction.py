"""The careful path: apply one source transaction row by row, detecting, deciding and recording conflicts.

For what the decision functions leave to it (router.apply.decide: SQLSTATE PGM01; custom and `error`
resolvers, delta columns, other unique keys, moved keys, unchanged TOAST) and what still raises (PGM02,
23505): the transaction is rolled back and applied again here. Each row is read first (`FOR UPDATE`) with
its version, or its tombstone when it is gone; `resolve` decides; the decision is written and recorded in
`pgmesh.conflict_history` in the same transaction. A decision on a key no row holds rests on its
tombstone, read again after the write: a local deletion committed meanwhile raises a unique violation,
for the applier to decide the whole transaction again (`router.errors.retry_unique`).

Must not: retry or pause. Runs on the applier's connection, inside the transaction it opens itself (the
origin set up for the session by the applier); reads the source only through `read_source` (toast).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from typing import Any, NoReturn

import asyncpg

from protocol.lsn import datetime_to_pg_us, format_lsn, pg_us_to_datetime
from protocol.messages import (
    Delete,
    Insert,
    Message,
    Relation,
    Truncate,
    TupleData,
    Type,
    Update,
)
from protocol.transactions import Transaction
from router import failpoints
from router.apply.careful.rows import ConflictRecord, Row
from router.apply.careful.rows import keyless as _keyless
from router.apply.careful.rows import new_row_values as _new_row
from router.apply.careful.rows import row_values as _row
from router.apply.careful.sql import (
    put_tombstone_sql,
    read_row_sql,
    read_tombstone_sql,
    tombstone_xid_sql,
    write_row_sql,
)
from router.apply.scripts import COMMIT_CHECKS, ORIGIN_MARK, moved_key_tombstone
from router.apply.statements import (
    KEY_LOCKS_MAX,
    TABLE_ALIAS,
    TargetTable,
    identity_match,
    key_lock,
    quote_ident,
    quote_literal,
    setup_statement,
    table_lock,
    target_table,
    tombstone_key,
    truncate_statement,
)
from router.apply.toast import ReadSource, whole_row
from router.apply.uniques import clash_wheres, row_where
from router.apply.uniques import literal as _lit
from router.config.model import Config
from router.conflicts.resolve import ConflictType, Decision, Outcome, Version, resolve
from router.errors import ApplyError

__all__ = [
    "CarefulApplier", "ConflictRecord", "read_row_sql", "read_tombstone_sql", "row_where", "write_row_sql",
]

Tables = Mapping[tuple[str, str], TargetTable]

_RECORD = """
INSERT INTO pgmesh.conflict_history (source, table_name, key, conflict_type, resolution, resolver, reason,
  local_origin, local_commit_time, remote_origin, remote_commit_time, remote_lsn, local_row, remote_row)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12::text::pg_lsn, $13::text::jsonb, $14::text::jsonb)
"""

T = TABLE_ALIAS  # pgmesh's alias of the target table (router.apply.statements)


_APPLY = Decision(Outcome.APPLY_REMOTE, "none", "written by the source itself: no conflict")
# Tables without a key or unique index hold a multiset of rows: a change whose old row is found (an equal
# row, whoever wrote it) replaces or deletes it, and such changes commute (docs/conflicts.md).
_KEYLESS = Decision(Outcome.APPLY_REMOTE, "none", "no key: an equal row, whoever wrote it, is the old row")
_NO_OP = Decision(Outcome.KEEP_LOCAL, "none", "no key: an update leaving its row as it was changes nothing")


class _Local:
    """The local row (or tombstone) a change met."""

    __slots__ = ("mine", "row", "version", "where", "xid")

    def __init__(
        self, row: dict[str, Any] | None, version: Version, mine: bool, at: tuple[int, str] | None = None,
        xid: str | None = None,
    ) -> None:
        self.row = row
        self.version = version
        self.mine = mine  # written by the source itself (or by this very transaction)
        self.xid = xid  # a tombstone's deletion (its transaction), to tell it from a later one
        # exactly that row: its partition (tableoid) and its place there (ctid); a ctid alone names one
        # row in every partition of a partitioned table
        self.where = (
            f"{T}.tableoid = {int(at[0])}::oid AND {T}.ctid = {quote_literal(at[1])}::tid" if at else "false"
        )


class CarefulApplier:
    """Row-by-row apply of one transaction for one link, with conflict detection and resolution."""

    def __init__(self, config: Config, source: str, target: str, origin_nodes: Mapping[int, str]) -> None:
        self.config = config
        self.source = source
        self.target = target
        self.origin_nodes = dict(origin_nodes)  # roident -> node name (0: the target itself)
        self.counts: dict[tuple[str, str], int] = {}  # (table, conflict type) -> conflicts decided
        self.installed_at: int | None = None  # pgmesh's installation here (µs), see pgmesh.expect_origin
        # reads one row on the source (SQL -> the row, or None; router.apply.toast); set by the applier
        self.read_source: ReadSource | None = None
        self.mark = False  # sets the applied mark with the origin (a 16+ target, router.progress.applied)
        self._coarse = False  # the transaction being applied locks whole tables (it is big)
        self._locked: set[str] = set()  # tables locked by it

    def _node(self, roident: int | None) -> str:
        if roident is None or roident == 0:
            return self.target
        return self.origin_nodes.get(roident, f"origin {roident}")

    def _version(self, commit_time: datetime | None, roident: int | None) -> Version:
        return Version(None if commit_time is None else datetime_to_pg_us(commit_time), self._node(roident))

    async def apply(
        self,
        conn: Any,
        txn: Transaction,
        tables: Tables,
        on_message: Callable[[Any, Message], Awaitable[Tables | None]] | None = None,
    ) -> list[ConflictRecord]:
        """Apply `txn` in its own target transaction (committed here); return the conflicts decided.

        `on_message` runs each transactional logical message in place (replicated DDL) and returns the
        target's tables as they are afterwards (or None: unchanged).
        """
        records: list[ConflictRecord] = []
        remote = Version(txn.commit_time, self.source)
        self._coarse = txn.row_count > KEY_LOCKS_MAX
        self._locked = set()
        async with conn.transaction():
            relations = dict(txn.relations)
            for change in txn.changes:
                if isinstance(change, Relation):
                    relations[change.relid] = change
                elif isinstance(change, Truncate):  # the origin mark first: its first change has none
                    truncate = truncate_statement(change, relations, tables, txn.commit_time)
                    await conn.execute(ORIGIN_MARK + "; " + truncate)
                elif isinstance(change, Message):
                    if on_message is not None:
                        tables = await on_message(conn, change) or tables
                elif isinstance(change, Type):
                    continue
                else:
                    relation = relations[change.relid]
                    table = target_table(relation, tables)
                    if not table.skip:  # (a table a partial target does not get)
                        await self._change(conn, txn, relation, table, change, remote, records)
            # last before COMMIT: a rollback after it moves the origin on PostgreSQL 16+ (see scripts)
            await conn.execute(COMMIT_CHECKS)
            await conn.execute(
                setup_statement("$1::text::pg_lsn", "$2", None, self.mark),
                format_lsn(txn.end_lsn),
                pg_us_to_datetime(txn.commit_time),
            )
            if failpoints.ARMED:  # a test's: the set-up sent, COMMIT not yet (router.failpoints)
                await failpoints.hit("apply.before_commit")
        for record in records:
            key = (record.table, record.conflict.value)
            self.counts[key] = self.counts.get(key, 0) + 1
        return records

    async def _change(
        self,
        conn: Any,
        txn: Transaction,
        relation: Relation,
        table: TargetTable,
        change: Insert | Update | Delete,
        remote: Version,
        records: list[ConflictRecord],
    ) -> None:
        # Appliers of other sources may decide the same key at the same time, also when no row exists
        # (row locks cannot serialize that): one advisory lock per (table, key), held to commit.
        if isinstance(change, Insert):
            await self._lock(conn, table, _row(relation, change.new))
            await self._insert(conn, txn, relation, table, change, remote, records)
        elif isinstance(change, Update):
            keys = [_row(relation, change.new)]
            if change.old is not None:
                keys.append(_row(relation, change.old))
            for values in keys:
                await self._lock(conn, table, values)
            await self._update(conn, txn, relation, table, change, remote, records)
        else:
            await self._lock(conn, table, _row(relation, change.old))
            await self._delete(conn, txn, relation, table, change, remote, records)

    async def _lock(self, conn: Any, table: TargetTable, values: Row) -> None:
        if self._coarse:  # a big transaction: each table once, exclusively (statements.KEY_LOCKS_MAX)
            if table.name not in self._locked:
                self._locked.add(table.name)
                await conn.execute(table_lock(table, exclusive=True))
            return
        if table.name not in self._locked:
            self._locked.add(table.name)
            await conn.execute(table_lock(table, exclusive=False))
        await conn.execute(f"SELECT {key_lock(table, self._key_sql(table, values))}")

    # ---------------------------------------------------------------- reading what is there

    async def _local(self, conn: Any, table: TargetTable, where: str) -> _Local | None:
        row = await conn.fetchrow(read_row_sql(table, where))
        if row is None:
            return None
        version = self._version(row["pgmesh_ts"], row["pgmesh_origin"])
        origin = row["pgmesh_origin"]
        mine = bool(row["pgmesh_ours"]) or version.node == self.source or self._before_pgmesh(origin, version)
        at = (row["pgmesh_tableoid"], row["pgmesh_ctid"])
        return _Local(json.loads(row["pgmesh_row"]), version, mine, at)

    def _before_pgmesh(self, roident: int | None, version: Version) -> bool:
        """A row every node started with (unknown commit time, or older than pgmesh here): no conflict."""
        if roident not in (None, 0):
            return False
        if version.commit_time is None:
            return True
        return self.installed_at is not None and version.commit_time < self.installed_at

    async def _by_key(
        self, conn: Any, relation: Relation, table: TargetTable, data: TupleData
    ) -> _Local | None:
        """The local row with the same key: the target's primary key, else the whole row."""
        if table.pk:
            values = _row(relation, data)
            if all(values.get(k) is not None for k in table.pk):
                return await self._local(conn, table, row_where(values, table.pk, table.compare))
        return await self._local(conn, table, identity_match(relation, data, full=True, types=table.compare))

    def _key_sql(self, table: TargetTable, values: Row) -> str:
        kinds = table.compare
        parts = [f"({_lit(values.get(k))}::{kinds.get(k, 'text')})::text" for k in table.tombstone_key]
        return f"ARRAY[{', '.join(parts)}]::text[]"

    async def _tombstone(self, conn: Any, table: TargetTable, values: Row) -> _Local | None:
        row = await conn.fetchrow(read_tombstone_sql(tombstone_key(self._key_sql(table, values))), table.name)
        if row is None:
            return None
        version = self._version(row["pgmesh_ts"], row["pgmesh_origin"])
        mine = bool(row["pgmesh_ours"]) or version.node == self.source
        return _Local(None, version, mine, xid=row["pgmesh_xid"])

    async def _create(
        self, conn: Any, table: TargetTable, row: Row, values: Row, tomb: _Local | None
    ) -> None:
        """Insert `row`, decided on no row holding its key and on the tombstone `tomb` of key `values` (None:
        none). A local transaction that inserted that key and deleted it again after that read (the
        insert waited for it, or it ended before) left a later tombstone, now committed: the decision no
        longer holds, and the whole transaction is read and decided again, as after a local insert of
        the key (a unique violation, `router.errors.retry_unique`). router.apply.careful.sql says why
        nothing later can slip in."""
        await self._write_row(conn, table, row, None)
        await self._check_tombstone(conn, table, values, tomb)

    async def _check_tombstone(self, conn: Any, table: TargetTable, values: Row, tomb: _Local | None) -> None:
        key_sql = tombstone_key(self._key_sql(table, values))
        xid = await conn.fetchval(tombstone_xid_sql(key_sql), table.name)
        # ('ours': a partial target's row filter took the row out again, not a deletion meanwhile)
        if xid != "ours" and xid != (tomb.xid if tomb else None):
            self._moved(table, values)

    def _moved(self, table: TargetTable, values: Row) -> NoReturn:
        key = ",".join(str(values.get(k)) for k in table.tombstone_key)
        raise asyncpg.exceptions.UniqueViolationError(
            f"key ({key}) of {table.name} was deleted here while the careful path decided it: decided again"
        )

    # ---------------------------------------------------------------- deciding and recording

    async def _decide(
        self,
        conn: Any,
        txn: Transaction,
        relation: Relation,
        table: TargetTable,
        conflict: ConflictType,
        local: _Local | None,
        remote: Version,
        remote_row: Row,
        records: list[ConflictRecord],
        fixed: Decision | None = None,
    ) -> Decision:
        """Decide (or take `fixed`, a decision no policy changes) and record the conflict."""
        policy = self.config.policy(relation.schema, relation.name, conflict.value)
        decision = fixed or resolve(
            conflict,
            local.version if local else None,
            remote,
            policy,
            local_row=local.row if local else None,
            remote_row=remote_row,
        )
        key = ",".join(str(remote_row.get(k)) for k in table.tombstone_key)
        if table.filtered and (local is None or local.row is None):
            return decision  # a partial target's missing row or tombstone: mostly rows its filter keeps out
        await conn.execute(
            _RECORD,
            self.source,
            table.name,
            key,
            conflict.value,
            decision.outcome.value,
            decision.resolver,
            decision.reason,
            local.version.node if local else None,
            pg_us_to_datetime(local.version.commit_time) if local and local.version.commit_time else None,
            self.source,
            pg_us_to_datetime(txn.commit_time),
            format_lsn(txn.end_lsn),
            json.dumps(local.row) if local and local.row is not None else None,
            json.dumps(remote_row),
        )
        records.append(ConflictRecord(table.name, key, conflict, decision))
        if decision.outcome is Outcome.ERROR:
            raise ApplyError(
                f"{conflict.value} on key ({key}): the rule for this table is error ({decision.reason})",
                relation=table.name,
                lsn=txn.end_lsn,
                hint="resolve the row by hand on this node, or change the rule, then `pgmesh resume`",
            )
        return decision

    # ---------------------------------------------------------------- writing

    async def _write_row(
        self, conn: Any, table: TargetTable, row: Mapping[str, Any], where: str | None
    ) -> None:
        """Insert `row` (where is None) or overwrite the row matched by `where` with it."""
        await conn.execute(write_row_sql(table, row, where))

    async def _insert(
        self,
        conn: Any,
        txn: Transaction,
        relation: Relation,
        table: TargetTable,
        change: Insert,
        remote: Version,
        records: list[ConflictRecord],
    ) -> None:
        new = _row(relation, change.new)
        # no key, no unique constraint: an equal row is another row (as the fast path inserts it)
        local = await self._by_key(conn, relation, table, change.new) if table.pk or table.uniques else None
        if local is not None:
            decision = await self._decide(
                conn, txn, relation, table, ConflictType.INSERT_EXISTS, local, remote, new, records
            )
            # each other row met on a secondary unique key is a meeting of its own (docs/conflicts.md,
            # "A row meeting several rows"): if the remote row loses one, it is not written, and the row
            # it beat on its key goes all the same
            if (table.uniques or table.indexes) and not await self._unique_clash(
                conn, txn, relation, table, new, remote, records, local.where
            ):
                if decision.outcome is not Outcome.KEEP_LOCAL:
                    await conn.execute(f"DELETE FROM {table.qualified} AS {T} WHERE {local.where}")
                return
            await self._overwrite(conn, table, decision, new, local.where)
            return
        if not await self._unique_clash(conn, txn, relation, table, new, remote, records, None):
            return
        await self._insert_new(conn, txn, relation, table, new, remote, records)

    async def _insert_new(
        self, conn: Any, txn: Transaction, relation: Relation, table: TargetTable, new: Row, remote: Version,
        records: list[ConflictRecord],
    ) -> None:
        """Insert the remote row on a key no row holds here: against the key's tombstone, if any."""
        tomb = await self._tombstone(conn, table, new)
        if tomb is not None and not tomb.mine:
            decision = await self._decide(
                conn, txn, relation, table, ConflictType.INSERT_DELETED, tomb, remote, new, records
            )
            if decision.outcome is Outcome.KEEP_LOCAL:
                return
            row = dict(decision.row) if decision.row is not None else new
            await self._create(conn, table, row, new, tomb)
            return
        await self._create(conn, table, new, new, tomb)

    async def _unique_clash(
        self,
        conn: Any,
        txn: Transaction,
        relation: Relation,
        table: TargetTable,
        new: Row,
        remote: Version,
        records: list[ConflictRecord],
        own: str | None,
        moved: bool = False,
    ) -> bool:
        """Other rows hold a secondary unique value the remote row brings (insert_exists on that key).

        Each row met is decided like an insert meeting it, all of them whatever the outcomes: a row the
        remote version beats goes; if one beats it, the remote row is not written (False; True when it
        may be). `own` is the WHERE of the row the change would write over (None when it is not here: an
        insert, or an update re-creating a missing row), never a row met; the caller decides what becomes
        of it. `moved`: an update moving its row to another primary key, met there too.
        """
        wins, seen = True, set()
        for where in clash_wheres(table, new, updating=own is not None, moved=moved):
            other = await self._local(conn, table, where if own is None else f"({where}) AND NOT ({own})")
            if other is None or other.where in seen:  # a row met on two keys is decided once
                continue
            seen.add(other.where)
            decision = await self._decide(
                conn, txn, relation, table, ConflictType.INSERT_EXISTS, other, remote, new, records
            )
            if decision.outcome is Outcome.KEEP_LOCAL:
                wins = False
            else:
                await conn.execute(f"DELETE FROM {table.qualified} AS {T} WHERE {other.where}")
        return wins

    async def _overwrite(
        self, conn: Any, table: TargetTable, decision: Decision, new: Row, where: str
    ) -> None:
        if decision.outcome is Outcome.APPLY_REMOTE:
            await self._write_row(conn, table, new, where)
        elif decision.outcome is Outcome.USE_ROW and decision.row is not None:
            await self._write_row(conn, table, decision.row, where)

    async def _update(
        self,
        conn: Any,
        txn: Transaction,
        relation: Relation,
        table: TargetTable,
        change: Update,
        remote: Version,
        records: list[ConflictRecord],
    ) -> None:
        new = _new_row(relation, change)
        key_row = change.old if change.old is not None else change.new
        local = await self._by_key(conn, relation, table, key_row)
        deltas = self.config.delta_columns(relation.schema, relation.name)
        if local is None:
            await self._update_missing(conn, txn, relation, table, change, new, remote, records)
            return
        old = _row(relation, change.old) if change.old is not None else new
        moved = any(old.get(k) != new.get(k) for k in table.pk)  # onto another row's key: met there too
        if (table.uniques or table.indexes or moved) and not await self._unique_clash(
            conn, txn, relation, table, new, remote, records, local.where, moved
        ):  # the remote row lost: its old row goes, as where the change came from
            await conn.execute(f"DELETE FROM {table.qualified} AS {T} WHERE {local.where}")
            return
        if local.mine:  # a local change merged under the source's origin may be here: deltas add up
            if deltas and change.old is not None:
                await self._merge_deltas(conn, table, relation, change, deltas, local.where, _APPLY)
            else:
                await self._overwrite(conn, table, _APPLY, new, local.where)
            return
        fixed = _KEYLESS if _keyless(table) else None
        if fixed is None and not deltas:
            new, fixed = await whole_row(
                self, txn, relation, table, change, new, ConflictType.UPDATE_ORIGIN_DIFFERS, local, remote
            )
        decision = await self._decide(
            conn, txn, relation, table, ConflictType.UPDATE_ORIGIN_DIFFERS, local, remote, new, records, fixed
        )
        where = local.where
        if deltas and change.old is not None:
            await self._merge_deltas(conn, table, relation, change, deltas, where, decision)
            return
        if moved and decision.outcome is Outcome.KEEP_LOCAL:
            # A key update is a deletion of the old key and an insert of the new one. The deletion lost
            # here (the row of the old key is newer) and the row stays; the insert of the new key, which
            # no row holds (met above), is decided as an insert, as on every node the update reaches.
            await self._insert_new(conn, txn, relation, table, new, remote, records)
            return
        await self._overwrite(conn, table, decision, new, where)
        if moved and (tombstone := moved_key_tombstone(relation, table, change)) is not None:
            await conn.execute(tombstone)  # the old key went: its tombstone, as a deletion's

    async def _merge_deltas(
        self,
        conn: Any,
        table: TargetTable,
        relation: Relation,
        change: Update,
        deltas: tuple[str, ...],
        where: str,
        decision: Decision,
    ) -> None:
        """Delta columns add the remote change; the other columns follow the decision."""
        assert change.old is not None
        old, new = _row(relation, change.old), _row(relation, change.new)
        sets = []
        for column in deltas:
            if old.get(column) is not None and new.get(column) is not None:
                kind = table.compare.get(column, "numeric")
                sets.append(
                    f"{quote_ident(column)} = {T}.{quote_ident(column)} + ({_lit(new[column])}::{kind}"
                    f" - {_lit(old[column])}::{kind})"
                )
        if decision.outcome is Outcome.APPLY_REMOTE:
            sets += [
                f"{quote_ident(k)} = {_lit(v)}"
                for k, v in new.items()
                if k not in deltas and k in table.columns and k not in table.always
                and k not in table.generated
            ]
        if sets:
            await conn.execute(f"UPDATE {table.qualified} AS {T} SET {', '.join(sets)} WHERE {where}")

    async def _update_missing(
        self,
        conn: Any,
        txn: Transaction,
        relation: Relation,
        table: TargetTable,
        change: Update,
        new: Row,
        remote: Version,
        records: list[ConflictRecord],
    ) -> None:
        if _keyless(table) and change.old is not None and _row(relation, change.old) == new:
            # -old +old: nothing, wherever its old row is (on a node where an equal row was found,
            # replacing it by itself changed nothing either)
            await self._decide(conn, txn, relation, table, ConflictType.UPDATE_MISSING, None, remote, new,
                               records, _NO_OP)
            return
        tomb = await self._tombstone(conn, table, new)
        conflict = ConflictType.UPDATE_DELETED if tomb is not None else ConflictType.UPDATE_MISSING
        new, fixed = await whole_row(self, txn, relation, table, change, new, conflict, tomb, remote)
        decision = await self._decide(conn, txn, relation, table, conflict, tomb, remote, new, records, fixed)
        if decision.outcome is Outcome.USE_ROW and decision.row is not None:
            row = dict(decision.row)
        elif decision.outcome is Outcome.APPLY_REMOTE:
            row = new
        else:  # not written; its version still beats older rows holding its secondary unique values, as
            # where it met them before the deletion (and as an insert losing to a tombstone, _insert)
            if table.uniques or table.indexes:
                await self._unique_clash(conn, txn, relation, table, new, remote, records, None)
            return
        # the row re-created may meet a row holding its key (moved onto it) or a secondary unique value
        other = await self._by_key(conn, relation, table, change.new) if table.pk else None
        if other is not None:  # decided as where the row still exists: insert_exists against that row
            clash = ConflictType.INSERT_EXISTS
            decided = await self._decide(conn, txn, relation, table, clash, other, remote, row, records)
            await self._overwrite(conn, table, decided, row, other.where)
            return
        if await self._unique_clash(conn, txn, relation, table, row, remote, records, None):
            await self._create(conn, table, row, new, tomb)

    async def _delete(
        self,
        conn: Any,
        txn: Transaction,
        relation: Relation,
        table: TargetTable,
        change: Delete,
        remote: Version,
        records: list[ConflictRecord],
    ) -> None:
        old = _row(relation, change.old)
        local = await self._by_key(conn, relation, table, change.old)
        if local is not None and local.mine:
            await conn.execute(f"DELETE FROM {table.qualified} AS {T} WHERE {local.where}")
            return
        if local is None:
            tomb = await self._tombstone(conn, table, old)
            await self._decide(
                conn, txn, relation, table, ConflictType.DELETE_MISSING, None, remote, old, records
            )
            if tomb is None or tomb.version.order() < remote.order():
                key = tombstone_key(self._key_sql(table, old))  # unless a local deletion came after the read:
                status = await conn.execute(put_tombstone_sql(key), table.name, tomb.xid if tomb else None)
                if status.endswith(" 0"):
                    self._moved(table, old)
            return
        decision = await self._decide(
            conn, txn, relation, table, ConflictType.DELETE_ORIGIN_DIFFERS, local, remote, old, records,
            _KEYLESS if _keyless(table) else None,
        )
        if decision.outcome is Outcome.APPLY_REMOTE:
            await conn.execute(f"DELETE FROM {table.qualified} AS {T} WHERE {local.where}")
