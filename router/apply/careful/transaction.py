"""The careful path: apply one source transaction row by row, detecting, deciding and recording conflicts.

For what the decision functions leave to it (router.apply.decide: SQLSTATE PGM01; custom and `error`
resolvers, delta columns, other unique keys, moved keys, unchanged TOAST) and what still raises (PGM02,
23505): the transaction is rolled back and applied again here. Each row is read first (`FOR UPDATE`) with
its version, or its tombstone when it is gone (router.apply.careful.local); `resolve` decides; the
decision is written and recorded in `pgmesh.conflict_history` in the same transaction. A decision on a key
no row holds rests on its tombstone, read again after the write: a local deletion committed meanwhile
raises a unique violation, for the applier to decide the whole transaction again
(`router.errors.retry_unique`).

The transaction's changes are walked through one `{change kind: handler}` table (`_APPLY`, a
protocol.changes.Dispatch); what the handlers share for one transaction (the session, the transaction,
the target's tables, the remote version, the conflicts recorded) is its `_Apply`.

Must not: retry or pause. Runs on the applier's connection, inside the transaction it opens itself (the
origin set up for the session by the applier); reads the source only through `read_source` (toast).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from protocol.changes import ChangeContext, Dispatch, note_relation
from protocol.lsn import format_lsn, pg_us_to_datetime
from protocol.messages import (
    Delete,
    Insert,
    Message,
    RawInsert,
    Relation,
    Truncate,
    Type,
    Update,
)
from protocol.pgoutput import decode_raw_insert
from protocol.transactions import Transaction
from router import failpoints
from router.apply.careful.local import (
    Local,
    by_key,
    check_tombstone,
    deleted_meanwhile,
    held_version,
    key_sql,
    local_row,
    tombstone,
)
from router.apply.careful.rows import ConflictRecord, Row
from router.apply.careful.rows import keyless as _keyless
from router.apply.careful.rows import new_row_values as _new_row
from router.apply.careful.rows import row_values as _row
from router.apply.careful.sql import (
    put_tombstone_sql,
    read_row_sql,
    read_tombstone_sql,
    write_row_sql,
)
from router.apply.quarantine import Entry, Guard
from router.apply.scripts import COMMIT_CHECKS, ORIGIN_MARK, moved_key_tombstone
from router.apply.statements import (
    KEY_LOCKS_MAX,
    TABLE_ALIAS,
    TargetTable,
    key_lock,
    quote_ident,
    setup_statement,
    table_lock,
    target_table,
    tombstone_key,
    truncate_statement,
)
from router.apply.toast import ReadSource, whole_row
from router.apply.uniques import clash_wheres, given_up_probes, row_where
from router.apply.uniques import literal as _lit
from router.config.model import Config
from router.conflicts.given_up import GIVEN_UP_SQL, RECORD_SQL, VALUE_LOCK_SQL
from router.conflicts.resolve import ConflictType, Decision, Outcome, Version, resolve
from router.errors import ApplyError

__all__ = [
    "CarefulApplier", "ConflictRecord", "read_row_sql", "read_tombstone_sql", "row_where", "write_row_sql",
]

Tables = Mapping[tuple[str, str], TargetTable]
OnMessage = Callable[[Any, Message], Awaitable[Tables | None]]

_RECORD = """
INSERT INTO pgmesh.conflict_history (source, table_name, key, conflict_type, resolution, resolver, reason,
  local_origin, local_commit_time, remote_origin, remote_commit_time, remote_lsn, local_row, remote_row)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12::text::pg_lsn, $13::text::jsonb, $14::text::jsonb)
"""

T = TABLE_ALIAS  # pgmesh's alias of the target table (router.apply.statements)


_CAREFUL = "SELECT pg_catalog.set_config('pgmesh.careful', 'y', true)"
# The row killed (by the remote version, on a secondary unique key) goes with its own version as its key's
# tombstone, not the killing transaction's: a later version of it (newer than the one killed) that does
# not hold the value comes back, as where the killing claim arrived after it (docs/conflicts.md)
_KILLED_TOMBSTONE = (
    "UPDATE pgmesh.tombstones SET xid = (pg_catalog.pg_current_xact_id()::text::int8"
    " - ((pg_catalog.pg_current_xact_id()::text::int8 % 4294967296) - $2::text::int8 + 4294967296)"
    " % 4294967296)::text::xid8"
    " WHERE table_name = $1 AND key = {key} AND xid = pg_catalog.pg_current_xact_id()"
)

_APPLY_REMOTE = Decision(Outcome.APPLY_REMOTE, "none", "written by the source itself: no conflict")
# Tables without a key or unique index hold a multiset of rows: a change whose old row is found (an equal
# row, whoever wrote it) replaces or deletes it, and such changes commute (docs/conflicts.md).
_KEYLESS = Decision(Outcome.APPLY_REMOTE, "none", "no key: an equal row, whoever wrote it, is the old row")
_NO_OP = Decision(Outcome.KEEP_LOCAL, "none", "no key: an update leaving its row as it was changes nothing")


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

    async def apply(
        self,
        conn: Any,
        txn: Transaction,
        tables: Tables,
        on_message: OnMessage | None = None,
        guard: Guard | None = None,
    ) -> list[ConflictRecord]:
        """Apply `txn` in its own target transaction (committed here); return the conflicts decided.

        `on_message` runs each transactional logical message in place (replicated DDL) and returns the
        target's tables as they are afterwards (or None: unchanged). `guard`: changes of the tables it
        covers follow their key's pending quarantine entries, or are set aside when refused
        (router.apply.quarantine).
        """
        step = _Apply(self, conn, txn, tables, on_message, guard)
        async with conn.transaction():
            # the given-up trigger leaves claims on given-up unique values to this path (_unique_clash)
            await conn.execute(_CAREFUL)
            handlers = _APPLY.handlers
            for change in txn.changes:
                await handlers[type(change)](step, change)
            # last before COMMIT: a rollback after it moves the origin on PostgreSQL 16+ (see scripts)
            await conn.execute(COMMIT_CHECKS)
            await conn.execute(
                setup_statement("$1::text::pg_lsn", "$2", None, self.mark),
                format_lsn(txn.end_lsn),
                pg_us_to_datetime(txn.commit_time),
            )
            if failpoints.ARMED:  # a test's: the set-up sent, COMMIT not yet (router.failpoints)
                await failpoints.hit("apply.before_commit")
        if guard is not None:
            guard.committed()
        for record in step.records:
            key = (record.table, record.conflict.value)
            self.counts[key] = self.counts.get(key, 0) + 1
        return step.records


class _Apply(ChangeContext):
    """One transaction being applied carefully: what the handlers of `_APPLY` share."""

    __slots__ = (
        "careful", "coarse", "conn", "guard", "locked", "on_message", "records", "remote", "tables", "txn",
    )

    def __init__(
        self, careful: CarefulApplier, conn: Any, txn: Transaction, tables: Tables,
        on_message: OnMessage | None, guard: Guard | None = None,
    ) -> None:
        super().__init__(dict(txn.relations))
        self.careful = careful
        self.conn = conn
        self.txn = txn
        self.tables = tables  # the target's, as they are now (DDL run in place changes them)
        self.on_message = on_message
        self.remote = Version(txn.commit_time, careful.source)
        self.records: list[ConflictRecord] = []
        self.coarse = txn.row_count > KEY_LOCKS_MAX  # it locks whole tables (it is big)
        self.locked: set[str] = set()  # tables locked by it
        self.guard = guard  # quarantine (router.apply.quarantine), or None

    async def guarded(
        self, relation: Relation, table: TargetTable, kind: str, new: Row | None, old: Row | None,
        apply: Callable[[], Awaitable[None]],
    ) -> None:
        """Run `apply` (one change, its key locked), through the quarantine when its table has one."""
        guard = self.guard
        if guard is None or not guard.watches(relation.schema, relation.name, table.name):
            await apply()
            return
        size = len(self.records)

        def undo() -> None:  # the conflicts it recorded went with its savepoint
            del self.records[size:]

        await guard.change(self.conn, Entry(table, kind, new, old), apply, undo,
                           covered=guard.covers(relation.schema, relation.name))

    def row_table(self, relid: int) -> tuple[Relation, TargetTable] | None:
        """A row change's relation and table (None: a table a partial target does not get)."""
        relation = self.relations[relid]
        table = target_table(relation, self.tables)
        return None if table.skip else (relation, table)

    async def lock(self, table: TargetTable, values: Row) -> None:
        """Appliers of other sources may decide the same key at the same time, also when no row exists
        (row locks cannot serialize that): one advisory lock per (table, key), held to commit."""
        conn = self.conn
        if self.coarse:  # a big transaction: each table once, exclusively (statements.KEY_LOCKS_MAX)
            if table.name not in self.locked:
                self.locked.add(table.name)
                await conn.execute(table_lock(table, exclusive=True))
            return
        if table.name not in self.locked:
            self.locked.add(table.name)
            await conn.execute(table_lock(table, exclusive=False))
        await conn.execute(f"SELECT {key_lock(table, key_sql(table, values))}")

    async def _create(self, table: TargetTable, row: Row, values: Row, tomb: Local | None) -> None:
        """Insert `row`, decided on no row holding its key and on the tombstone `tomb` of key `values` (None:
        none). A local transaction that inserted that key and deleted it again after that read (the
        insert waited for it, or it ended before) left a later tombstone, now committed: the decision no
        longer holds, and the whole transaction is read and decided again, as after a local insert of
        the key (a unique violation, `router.errors.retry_unique`). router.apply.careful.sql says why
        nothing later can slip in."""
        await self._write_row(table, row, None)
        await check_tombstone(self.conn, table, values, tomb)

    # ---------------------------------------------------------------- deciding and recording

    async def _decide(
        self,
        relation: Relation,
        table: TargetTable,
        conflict: ConflictType,
        local: Local | None,
        remote_row: Row,
        fixed: Decision | None = None,
    ) -> Decision:
        """Decide (or take `fixed`, a decision no policy changes) and record the conflict."""
        careful, txn = self.careful, self.txn
        policy = careful.config.policy(relation.schema, relation.name, conflict.value)
        decision = fixed or resolve(
            conflict,
            local.version if local else None,
            self.remote,
            policy,
            local_row=local.row if local else None,
            remote_row=remote_row,
        )
        key = ",".join(str(remote_row.get(k)) for k in table.tombstone_key)
        if table.filtered and (local is None or local.row is None):
            return decision  # a partial target's missing row or tombstone: mostly rows its filter keeps out
        await self.conn.execute(
            _RECORD,
            careful.source,
            table.name,
            key,
            conflict.value,
            decision.outcome.value,
            decision.resolver,
            decision.reason,
            local.version.node if local else None,
            pg_us_to_datetime(local.version.commit_time) if local and local.version.commit_time else None,
            careful.source,
            pg_us_to_datetime(txn.commit_time),
            format_lsn(txn.end_lsn),
            json.dumps(local.row) if local and local.row is not None else None,
            json.dumps(remote_row),
        )
        self.records.append(ConflictRecord(table.name, key, conflict, decision))
        if decision.outcome is Outcome.ERROR:
            raise ApplyError(
                f"{conflict.value} on key ({key}): the rule for this table is error ({decision.reason})",
                relation=table.name,
                lsn=txn.end_lsn,
                hint="resolve the row by hand on this node, or change the rule, then `pgmesh resume`",
            )
        return decision

    # ---------------------------------------------------------------- writing

    async def _write_row(self, table: TargetTable, row: Mapping[str, Any], where: str | None) -> None:
        """Insert `row` (where is None) or overwrite the row matched by `where` with it."""
        await self.conn.execute(write_row_sql(table, row, where))

    async def _delete_row(self, table: TargetTable, where: str) -> None:
        await self.conn.execute(f"DELETE FROM {table.qualified} AS {T} WHERE {where}")

    async def insert(self, relation: Relation, table: TargetTable, change: Insert) -> None:
        new = _row(relation, change.new)
        # no key, no unique constraint: an equal row is another row (as the fast path inserts it)
        keyed = table.pk or table.uniques
        local = None
        if keyed:  # (by the whole row under a replica identity index: a row met on it is a unique meeting)
            local = await by_key(self.conn, self.careful, relation, table, change.new, identity=False)
        if local is not None:
            decision = await self._decide(relation, table, ConflictType.INSERT_EXISTS, local, new)
            # each other row met on a secondary unique key is a meeting of its own (docs/conflicts.md,
            # "A row meeting several rows"): if the remote row loses one, it is not written, and the row
            # it beat on its key goes all the same
            if (table.uniques or table.indexes) and not await self._unique_clash(
                relation, table, new, local.where
            ):
                if decision.outcome is not Outcome.KEEP_LOCAL:
                    await self._delete_row(table, local.where)
                return
            if decision.outcome is Outcome.KEEP_LOCAL and (table.uniques or table.indexes):
                await self._record_claims(table, new, updating=True)  # not written: it held them elsewhere
            await self._overwrite(table, decision, new, local.where)
            return
        if not await self._unique_clash(relation, table, new, None):
            await self._lost_claim(table, new)
            return
        await self._insert_new(relation, table, new)

    async def _insert_new(self, relation: Relation, table: TargetTable, new: Row) -> None:
        """Insert the remote row on a key no row holds here: against the key's tombstone, if any."""
        tomb = await tombstone(self.conn, self.careful, table, new)
        if tomb is not None and not tomb.mine:
            decision = await self._decide(relation, table, ConflictType.INSERT_DELETED, tomb, new)
            if decision.outcome is Outcome.KEEP_LOCAL:
                if table.uniques or table.indexes:
                    await self._record_claims(table, new, updating=False)
                return
            row = dict(decision.row) if decision.row is not None else new
            await self._create(table, row, new, tomb)
            return
        await self._create(table, new, new, tomb)

    async def _unique_clash(
        self, relation: Relation, table: TargetTable, new: Row, own: str | None, moved: bool = False
    ) -> bool:
        """Other rows hold a secondary unique value the remote row brings (insert_exists on that key).

        Each row met is decided like an insert meeting it, all of them whatever the outcomes: a row the
        remote version beats goes; if one beats it, the remote row is not written (False; True when it
        may be). `own` is the WHERE of the row the change would write over (None when it is not here: an
        insert, or an update re-creating a missing row), never a row met; the caller decides what becomes
        of it. `moved`: an update moving its row to another primary key, met there too.
        """
        probes = given_up_probes(table, new, updating=own is not None)
        for name, value in probes:  # (the claim trigger's lock: a claim or record meanwhile is seen)
            await self.conn.execute(VALUE_LOCK_SQL.format(value=value), table.name, name)
        wins, seen = True, set()
        for where in clash_wheres(table, new, updating=own is not None, moved=moved):
            met = where if own is None else f"({where}) AND NOT ({own})"
            other = await local_row(self.conn, self.careful, table, met)
            if other is None or other.where in seen:  # a row met on two keys is decided once
                continue
            seen.add(other.where)
            decision = await self._decide(relation, table, ConflictType.INSERT_EXISTS, other, new)
            if decision.outcome is Outcome.KEEP_LOCAL:
                wins = False
            else:
                await self._kill_row(table, other)
        # rows that held a value it claims and gave it up since: a hold newer than the claim beats it, as
        # the row did where the claim arrived while it held the value (docs/conflicts.md, "A unique value
        # given up"); an older hold is no matter (the row had moved on, or went, by its own later version)
        own_key = key_sql(table, new)
        for name, value in probes:
            query = GIVEN_UP_SQL.format(value=value, key=own_key)
            for record in await self.conn.fetch(query, table.name, name):
                held = held_version(self.careful, record["pgmesh_ts"], record["pgmesh_origin"])
                if held.version.order() < self.remote.order():
                    continue
                decision = await self._decide(relation, table, ConflictType.INSERT_EXISTS, held, new)
                if decision.outcome is Outcome.KEEP_LOCAL:
                    wins = False
        if not wins:
            await self._record_claims(table, new, updating=own is not None)
        return wins

    async def _record_claims(self, table: TargetTable, new: Row, *, updating: bool) -> None:
        """The remote row is not written (it lost): where it was written, it held its secondary unique values
        until it went, and its given-up records say so; so do they here."""
        own_key = key_sql(table, new)
        for name, value in given_up_probes(table, new, updating=updating):
            await self.conn.execute(RECORD_SQL.format(value=value, key=own_key), table.name, name)

    async def _kill_row(self, table: TargetTable, other: Local) -> None:
        """Delete `other`, beaten on a secondary unique key, its tombstone carrying its own version."""
        xmin = await self.conn.fetchval(
            f"DELETE FROM {table.qualified} AS {T} WHERE {other.where} RETURNING {T}.xmin::text"
        )
        if xmin is not None and other.row is not None and table.tombstone_key:
            key = tombstone_key(key_sql(table, other.row))
            await self.conn.execute(_KILLED_TOMBSTONE.format(key=key), table.name, xmin)

    async def _lost_claim(self, table: TargetTable, values: Row) -> None:
        """A row not written because it lost on a secondary unique key: its version is its key's tombstone
        when newer than the one there, as where it was written and then went."""
        tomb = await tombstone(self.conn, self.careful, table, values)
        if tomb is None or tomb.version.order() < self.remote.order():
            key = tombstone_key(key_sql(table, values))
            await self.conn.execute(put_tombstone_sql(key), table.name, tomb.xid if tomb else None)

    async def _overwrite(self, table: TargetTable, decision: Decision, new: Row, where: str) -> None:
        if decision.outcome is Outcome.APPLY_REMOTE:
            await self._write_row(table, new, where)
        elif decision.outcome is Outcome.USE_ROW and decision.row is not None:
            await self._write_row(table, decision.row, where)

    async def update(self, relation: Relation, table: TargetTable, change: Update) -> None:
        careful = self.careful
        new = _new_row(relation, change)
        key_row = change.old if change.old is not None else change.new
        local = await by_key(self.conn, careful, relation, table, key_row)
        deltas = careful.config.delta_columns(relation.schema, relation.name)
        if local is None:
            await self._update_missing(relation, table, change, new)
            return
        old = _row(relation, change.old) if change.old is not None else new
        moved_key = any(old.get(k) != new.get(k) for k in table.pk)  # onto another row's key: met there too
        if (table.uniques or table.indexes or moved_key) and not await self._unique_clash(
            relation, table, new, local.where, moved_key
        ):  # the remote row lost: its old row goes, as where the change came from, unless the row here is
            # a newer version than the change (it stays, as where it came after the change went)
            if local.mine or local.version.order() < self.remote.order():
                await self._delete_row(table, local.where)
            return
        if local.mine:  # a local change merged under the source's origin may be here: deltas add up
            if deltas and change.old is not None:
                await self._merge_deltas(table, relation, change, deltas, local.where, _APPLY_REMOTE)
            else:
                await self._overwrite(table, _APPLY_REMOTE, new, local.where)
            return
        fixed = _KEYLESS if _keyless(table) else None
        if fixed is None and not deltas:
            new, fixed = await whole_row(
                careful, self.txn, relation, table, change, new, ConflictType.UPDATE_ORIGIN_DIFFERS, local,
                self.remote,
            )
        decision = await self._decide(relation, table, ConflictType.UPDATE_ORIGIN_DIFFERS, local, new, fixed)
        where = local.where
        if decision.outcome is Outcome.KEEP_LOCAL and (table.uniques or table.indexes):
            await self._record_claims(table, new, updating=True)  # not written: it held them elsewhere
        if deltas and change.old is not None:
            await self._merge_deltas(table, relation, change, deltas, where, decision)
            return
        if moved_key and decision.outcome is Outcome.KEEP_LOCAL:
            # A key update is a deletion of the old key and an insert of the new one. The deletion lost
            # here (the row of the old key is newer) and the row stays; the insert of the new key, which
            # no row holds (met above), is decided as an insert, as on every node the update reaches.
            await self._insert_new(relation, table, new)
            return
        await self._overwrite(table, decision, new, where)
        if moved_key and (statement := moved_key_tombstone(relation, table, change)) is not None:
            await self.conn.execute(statement)  # the old key went: its tombstone, as a deletion's

    async def _merge_deltas(
        self,
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
            await self.conn.execute(f"UPDATE {table.qualified} AS {T} SET {', '.join(sets)} WHERE {where}")

    async def _update_missing(self, relation: Relation, table: TargetTable, change: Update, new: Row) -> None:
        if _keyless(table) and change.old is not None and _row(relation, change.old) == new:
            # -old +old: nothing, wherever its old row is (on a node where an equal row was found,
            # replacing it by itself changed nothing either)
            await self._decide(relation, table, ConflictType.UPDATE_MISSING, None, new, _NO_OP)
            return
        careful = self.careful
        tomb = await tombstone(self.conn, careful, table, new)
        conflict = ConflictType.UPDATE_DELETED if tomb is not None else ConflictType.UPDATE_MISSING
        new, fixed = await whole_row(
            careful, self.txn, relation, table, change, new, conflict, tomb, self.remote
        )
        decision = await self._decide(relation, table, conflict, tomb, new, fixed)
        if decision.outcome is Outcome.USE_ROW and decision.row is not None:
            row = dict(decision.row)
        elif decision.outcome is Outcome.APPLY_REMOTE:
            row = new
        else:  # not written; its version still beats older rows holding its secondary unique values, as
            # where it met them before the deletion (and as an insert losing to a tombstone, insert)
            if table.uniques or table.indexes:
                await self._unique_clash(relation, table, new, None)
                await self._record_claims(table, new, updating=False)
            return
        # the row re-created may meet a row holding its key (moved onto it) or a secondary unique value
        other = await by_key(self.conn, careful, relation, table, change.new) if table.pk else None
        if other is not None:  # decided as where the row still exists: insert_exists against that row
            decided = await self._decide(relation, table, ConflictType.INSERT_EXISTS, other, row)
            await self._overwrite(table, decided, row, other.where)
            return
        if await self._unique_clash(relation, table, row, None):
            await self._create(table, row, new, tomb)
        else:
            await self._lost_claim(table, row)

    async def delete(self, relation: Relation, table: TargetTable, change: Delete) -> None:
        conn = self.conn
        old = _row(relation, change.old)
        local = await by_key(conn, self.careful, relation, table, change.old)
        if local is not None and local.mine:
            await self._delete_row(table, local.where)
            return
        if local is None:
            tomb = await tombstone(conn, self.careful, table, old)
            await self._decide(relation, table, ConflictType.DELETE_MISSING, None, old)
            if tomb is None or tomb.version.order() < self.remote.order():
                key = tombstone_key(key_sql(table, old))  # unless a local deletion came after the read:
                status = await conn.execute(put_tombstone_sql(key), table.name, tomb.xid if tomb else None)
                if status.endswith(" 0"):
                    deleted_meanwhile(table, old)
            return
        fixed = _KEYLESS if _keyless(table) else None
        decision = await self._decide(relation, table, ConflictType.DELETE_ORIGIN_DIFFERS, local, old, fixed)
        if decision.outcome is Outcome.APPLY_REMOTE:
            await self._delete_row(table, local.where)


# ---------------------------------------------------------------- one handler per kind of change


async def _relation(step: _Apply, change: Relation) -> None:
    note_relation(step, change)


async def _type(step: _Apply, change: Type) -> None:
    pass


async def _truncate(step: _Apply, change: Truncate) -> None:
    truncate = truncate_statement(change, step.relations, step.tables, step.txn.commit_time)
    await step.conn.execute(ORIGIN_MARK + "; " + truncate)  # the origin mark first: its first change has none


async def _message(step: _Apply, change: Message) -> None:
    if step.on_message is not None:
        step.tables = await step.on_message(step.conn, change) or step.tables


async def _insert(step: _Apply, change: Insert | RawInsert) -> None:
    if isinstance(change, RawInsert):  # (a whole transaction holds none; a part read back raw might)
        change = decode_raw_insert(change)
    found = step.row_table(change.relid)
    if found is not None:
        relation, table = found
        new = _row(relation, change.new)
        await step.lock(table, new)
        await step.guarded(relation, table, "insert", new, None, lambda: step.insert(relation, table, change))


async def _update(step: _Apply, change: Update) -> None:
    found = step.row_table(change.relid)
    if found is not None:
        relation, table = found
        keys = [_row(relation, change.new)]
        if change.old is not None:
            keys.append(_row(relation, change.old))
        for values in keys:
            await step.lock(table, values)
        await step.guarded(relation, table, "update", _new_row(relation, change), _old(relation, change),
                           lambda: step.update(relation, table, change))


async def _delete(step: _Apply, change: Delete) -> None:
    found = step.row_table(change.relid)
    if found is not None:
        relation, table = found
        await step.lock(table, _row(relation, change.old))
        await step.guarded(relation, table, "delete", None, _old(relation, change),
                           lambda: step.delete(relation, table, change))


def _old(relation: Relation, change: Update | Delete) -> Row | None:
    """The old row or key a change sent (a key: its key columns alone), for the quarantine."""
    if change.old is None:
        return None
    old = _row(relation, change.old)
    if change.old_kind == "K":
        keys = set(relation.key_columns)
        return {k: v for k, v in old.items() if k in keys}
    return old


_APPLY: Final[Dispatch[_Apply, Awaitable[None]]] = Dispatch({
    Relation: _relation, Type: _type, Truncate: _truncate, Message: _message, Insert: _insert,
    RawInsert: _insert, Update: _update, Delete: _delete,
})
