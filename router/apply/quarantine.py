"""Quarantine: a change the target refuses is set aside in `pgmesh.quarantine` there, and the link streams on.

Under `on_refused = "quarantine"` for its table (router.config), a change the target refuses
(router.errors.is_refused: a CHECK, foreign key or trigger there, a value its type rejects) does not stop
the link. The applier sends that transaction the careful way again, with a SAVEPOINT around each change
of a quarantining table (`Guard.savepoints`): the change refused is rolled back to its savepoint and
written, with its row, source, LSN, commit time, SQLSTATE and message, into `pgmesh.quarantine` in the
same target transaction. It commits with the rest of its source transaction and with the origin's
progress: nothing lost, nothing twice. The rest of that source transaction applies (a row is set aside,
not the transaction: docs/conflicts.md "Quarantine").

A key with pending entries keeps its order: every later change of that key, from any source, follows it
into quarantine (`follows`: the entry it came after) until `pgmesh quarantine replay | discard`
(router.ops.quarantine) resolves them. The appliers of one target share one `QuarantineIndex` of the
pending keys ({table: {key}}), read from `pgmesh.quarantine` when each connects and again at most every
`REFRESH_S` while keys are pending. A transaction touching a table with pending keys goes the careful way
(`QuarantineIndex.holds`); for the tables without one the check is a lookup in an empty dict. In the
careful path each change of such a table, under its key lock, asks the table whether the key is still
pending (the index may be older than a replay) and takes the newest entry's id to follow.

Bounded: at `limit` pending entries on a target (router.errors.QUARANTINE_MAX) a new entry is refused and
the link pauses with an error saying so.

Must not: decide conflicts (the careful path does), choose a retry policy (router.errors), or hold a
connection of its own (it runs on the applier's, inside the transaction the careful path opened).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import asyncpg

from protocol.lsn import format_lsn, pg_us_to_datetime
from protocol.messages import Delete, Insert, RawInsert, Relation, Truncate, TupleData, Update
from protocol.pgoutput import decode_raw_insert
from protocol.transactions import Transaction
from router.apply.careful.rows import row_values
from router.apply.statements import TargetTable
from router.config.model import Config
from router.errors import QUARANTINE_MAX, PgmeshError, describe, is_refused, sqlstate_of

__all__ = ["PENDING_SQL", "REFRESH_S", "Entry", "Guard", "QuarantineIndex", "key_text"]

logger = logging.getLogger(__name__)

REFRESH_S: Final = 5.0  # while keys are pending, the index is read again at most this often
_TABLE: Final = "pgmesh.quarantine"
# The key an update entry moved its row to (its new row's values of the key's columns), or NULL.
_MOVED_TO: Final = ("CASE WHEN change_kind = 'update' THEN (SELECT pg_catalog.jsonb_object_agg(k,"
                    " new_row -> k) FROM pg_catalog.jsonb_object_keys(key) AS k) END")
# Pending entries per (table, key), and the keys updates moved rows to (counted 0: not entries of their own).
PENDING_SQL: Final = (
    f"SELECT table_name, key::text, count(*) FROM {_TABLE} WHERE state = 'pending' GROUP BY 1, 2"
    f" UNION ALL SELECT DISTINCT table_name, moved::text, 0"
    f" FROM {_TABLE}, LATERAL (SELECT {_MOVED_TO}) AS m(moved)"
    " WHERE state = 'pending' AND moved IS DISTINCT FROM key AND moved IS NOT NULL"
)
# The newest pending entry of any of the keys $2 (of its own key, or a row an update moved onto one).
_NEWEST_SQL: Final = (
    f"SELECT max(id) FROM {_TABLE} WHERE state = 'pending' AND table_name = $1"
    f" AND (key = ANY($2::jsonb[]) OR ({_MOVED_TO}) = ANY($2::jsonb[]))"
)
_INSERT_SQL: Final = f"""
INSERT INTO {_TABLE} (source, source_lsn, commit_time, table_name, key, change_kind, new_row, old_key,
  sqlstate, message, follows)
VALUES ($1, $2::text::pg_lsn, $3, $4, $5::jsonb, $6, $7::jsonb, $8::jsonb, $9, $10, $11) RETURNING id
"""
_SAVEPOINT: Final = "SAVEPOINT pgmesh_quarantine"
_ROLLBACK_TO: Final = "ROLLBACK TO SAVEPOINT pgmesh_quarantine"
_RELEASE: Final = "RELEASE SAVEPOINT pgmesh_quarantine"

Row = Mapping[str, str | None]


def _insert_rows(change: Any) -> list[TupleData]:
    if isinstance(change, RawInsert):
        change = decode_raw_insert(change)
    return [change.new]


def _update_rows(change: Update) -> list[TupleData]:
    return [change.new] if change.old is None else [change.new, change.old]


def _delete_rows(change: Delete) -> list[TupleData]:
    return [change.old]


# the row images whose keys a change touches, by kind of change
_ROWS: Final[dict[type, Callable[[Any], list[TupleData]]]] = {
    Insert: _insert_rows, RawInsert: _insert_rows, Update: _update_rows, Delete: _delete_rows,
}


def key_text(key: Mapping[str, Any]) -> str:
    """A key as one canonical JSON text (columns sorted): how the index and `pgmesh.quarantine.key` agree."""
    return json.dumps(dict(key), sort_keys=True, separators=(",", ":"))


def _key(table: TargetTable, values: Row) -> str:
    return key_text({k: values.get(k) for k in table.tombstone_key})


class QuarantineIndex:
    """One target's pending quarantine keys, shared by its appliers: {table: {key: when added}}, and the
    pending entries per table (what status and /metrics show)."""

    __slots__ = ("_added", "_keys", "counts", "limit", "loaded_at", "target")

    def __init__(self, target: str, limit: int = QUARANTINE_MAX) -> None:
        self.target = target
        self.limit = limit
        self._keys: dict[str, dict[str, int]] = {}  # table -> key -> the `_added` count when added
        self.counts: dict[str, int] = {}  # table -> pending entries
        self._added = 0
        self.loaded_at: float | None = None

    @property
    def pending(self) -> int:
        """Pending entries on this target (as far as this router knows)."""
        return sum(self.counts.values())

    def holds(self, txn: Transaction, tables: Mapping[tuple[str, str], TargetTable]) -> bool:
        """Whether `txn` changes a key with pending entries (then it goes the careful way). Nothing is
        looked at unless a table it touches has some: then the keys of that table's changes (a transaction
        whose changes are not all in memory, or a table not known here, counts as holding one)."""
        keys = self._keys
        if not keys or not any(f"{r.schema}.{r.name}" in keys for r in txn.relations.values()):
            return False
        if txn.spilled:
            return True
        relations = dict(txn.relations)
        for change in txn.changes:
            if isinstance(change, Relation):
                relations[change.relid] = change
                continue
            kind = _ROWS.get(type(change))
            if kind is None:
                if isinstance(change, Truncate):
                    return True
                continue
            row_change: Any = change  # (an Insert, RawInsert, Update or Delete: `_ROWS` has it)
            relation = relations[row_change.relid]
            pending = keys.get(f"{relation.schema}.{relation.name}")
            if not pending:
                continue
            table = tables.get((relation.schema, relation.name))
            if table is None:
                return True
            if any(_key(table, row_values(relation, data)) in pending for data in kind(change)):
                return True
        return False

    def has(self, table: str) -> bool:
        """Whether `table` has pending keys."""
        return table in self._keys

    def knows(self, table: str, keys: Iterable[str]) -> bool:
        found = self._keys.get(table)
        return found is not None and any(k in found for k in keys)

    def due(self, now: float) -> bool:
        return bool(self._keys) and (self.loaded_at is None or now - self.loaded_at >= REFRESH_S)

    async def load(self, conn: Any, *, required: bool, now: float | None = None) -> None:
        """Read the pending keys from the target. Keys added by an applier while this read ran stay (the read
        may not see their entries yet); a key resolved since stays out. `required`: a missing table is an
        error (a table quarantines), else nothing is pending."""
        started = self._added
        try:
            rows = await conn.fetch(PENDING_SQL)
        except (asyncpg.UndefinedTableError, asyncpg.InsufficientPrivilegeError) as exc:
            if required:  # (else nothing can be pending: no table, or none this role may read)
                missing = isinstance(exc, asyncpg.UndefinedTableError)
                raise PgmeshError(
                    f"{_TABLE} is {'missing' if missing else 'not readable by this role'}, and a table's"
                    " on_refused is \"quarantine\"", node=self.target,
                    hint="run `pgmesh init` again: it adds what an older installation lacks" if missing else
                    "grant the run role its privileges again (`pgmesh init --print-sql --role ROLE`)",
                ) from None
            rows = []
        keys: dict[str, dict[str, int]] = {}
        counts: dict[str, int] = {}
        for table, key, count in rows:
            keys.setdefault(table, {})[key_text(json.loads(key)) if key else "null"] = started
            counts[table] = counts.get(table, 0) + int(count)
        for table, found in self._keys.items():
            for key, added in found.items():
                if added > started and key not in keys.get(table, {}):
                    keys.setdefault(table, {})[key] = added
                    counts[table] = counts.get(table, 0) + 1
        self._keys, self.counts = keys, counts
        self.loaded_at = time.monotonic() if now is None else now

    def add(self, table: str, keys: Iterable[str]) -> None:
        """An entry of `table` committed, for `keys`."""
        self._added += 1
        found = self._keys.setdefault(table, {})
        for key in keys:
            found[key] = self._added
        self.counts[table] = self.counts.get(table, 0) + 1

    def forget(self, table: str, keys: Iterable[str]) -> None:
        """No entry of these keys is pending any more (replayed or discarded)."""
        found = self._keys.get(table)
        if found is None:
            return
        for key in keys:
            found.pop(key, None)
        if not found:
            del self._keys[table]
            self.counts.pop(table, None)


class Entry:
    """One change of a quarantining table, as the careful path meets it."""

    __slots__ = ("keys", "kind", "new", "old", "table")

    def __init__(self, table: TargetTable, kind: str, new: Row | None, old: Row | None) -> None:
        self.table = table
        self.kind = kind  # insert, update, delete
        self.new = new
        self.old = old
        # the keys it touches: the old row's first (the row it changes), then the new one's
        rows = [r for r in (old, new) if r is not None]
        self.keys = list(dict.fromkeys(_key(table, r) for r in rows))


class Guard:
    """One careful apply's quarantine: which tables quarantine, whether changes run under savepoints (after
    the transaction was refused once), and the entries written, made known to the index at commit."""

    __slots__ = ("_config", "_covers", "_written", "index", "savepoints", "source", "txn")

    def __init__(
        self, config: Config, index: QuarantineIndex, source: str, txn: Transaction, *, savepoints: bool
    ) -> None:
        self._config = config
        self.index = index
        self.source = source
        self.txn = txn
        self.savepoints = savepoints
        self._covers: dict[str, bool] = {}
        self._written: list[tuple[str, list[str], int, str]] = []  # table, keys, id, what to log

    def watches(self, schema: str, name: str, table: str) -> bool:
        """Whether changes of `schema.name` (the target's `table`) go through `change`: it quarantines, or
        has pending keys (whatever its on_refused says now, a change of such a key follows them)."""
        return self.covers(schema, name) or self.index.has(table)

    def covers(self, schema: str, name: str) -> bool:
        """Whether a change of `schema.name` the target refuses is quarantined (on_refused)."""
        qualified = f"{schema}.{name}"
        found = self._covers.get(qualified)
        if found is None:
            found = self._covers[qualified] = self._config.on_refused(schema, name) == "quarantine"
        return found

    async def change(self, conn: Any, entry: Entry, apply: Callable[[], Awaitable[None]],
                     undo: Callable[[], None], *, covered: bool = True) -> None:
        """Apply one change of a table it `watches` (its key locked by the caller): after the pending
        entries of its key, if any (it follows them); else, for a table it `covers` (`covered`), under a
        savepoint when `savepoints`, a refusal setting it aside (`undo` forgets what the caller recorded
        inside the savepoint)."""
        follows = await self._follows(conn, entry)
        if follows is not None:
            await self._write(conn, entry, follows, None)
            return
        if not (self.savepoints and covered):
            await apply()
            return
        await conn.execute(_SAVEPOINT)
        try:
            await apply()
        except asyncpg.PostgresError as exc:
            if not is_refused(exc):
                raise
            await conn.execute(_ROLLBACK_TO)
            undo()
            await self._write(conn, entry, None, exc)
        else:
            await conn.execute(_RELEASE)

    async def _follows(self, conn: Any, entry: Entry) -> int | None:
        """The newest pending entry of the change's keys (this transaction's own included), or None."""
        table = entry.table.name
        for name, keys, found, _ in reversed(self._written):
            if name == table and not set(keys).isdisjoint(entry.keys):
                return found
        if not self.index.knows(table, entry.keys):
            return None
        newest = await conn.fetchval(_NEWEST_SQL, table, entry.keys)
        if newest is None:
            self.index.forget(table, entry.keys)  # replayed or discarded since the index was read
        return int(newest) if newest is not None else None

    async def _write(self, conn: Any, entry: Entry, follows: int | None, exc: BaseException | None) -> None:
        if self.index.pending + len(self._written) >= self.index.limit:
            raise PgmeshError(
                f"{self.index.pending} changes are pending in {_TABLE}, the most a node holds"
                f" ({self.index.limit}); the link pauses", node=self.index.target,
                relation=entry.table.name, lsn=self.txn.end_lsn,
                hint="fix what the target refuses, then `pgmesh quarantine replay` (or discard), then"
                     " `pgmesh resume`",
            )
        txn = self.txn
        state = sqlstate_of(exc) if exc is not None else None
        message = _message(exc) if exc is not None else None
        found = await conn.fetchval(
            _INSERT_SQL, self.source, format_lsn(txn.end_lsn), pg_us_to_datetime(txn.commit_time),
            entry.table.name, entry.keys[0], entry.kind,
            json.dumps(entry.new) if entry.new is not None else None,
            json.dumps(entry.old) if entry.old is not None else None,
            state, message, follows,
        )
        why = (f"SQLSTATE {state}: {describe(exc)}" if exc is not None
               else f"its key has pending entries (follows entry {follows})")
        self._written.append((entry.table.name, entry.keys, int(found), why))

    def committed(self) -> None:
        """The transaction committed: its entries are pending; one log line each."""
        for table, keys, found, why in self._written:
            self.index.add(table, keys)
            logger.warning(
                "node %s: change of table %s key %s from %s (LSN %s) set aside in %s as entry %d: %s",
                self.index.target, table, keys[0], self.source, format_lsn(self.txn.end_lsn), _TABLE,
                found, why,
            )
        self._written = []

    @property
    def written(self) -> Sequence[tuple[str, list[str], int, str]]:
        return self._written


def _message(exc: BaseException) -> str:
    text = str(exc).splitlines()
    return text[0] if text else type(exc).__name__
