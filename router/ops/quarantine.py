"""`pgmesh quarantine list | replay | discard`: the changes a node set aside (router.apply.quarantine).

Entries are chosen by `--node`, `--id`, `--table` and `--key` (a one-column key's value, or the key as a
JSON object); without any, every pending entry of every node.

- `list` prints them (pending ones; with `--all` resolved ones too).
- `replay` applies each chosen key's pending entries in id order (an `--id` chooses its key: a later
  entry of a key never goes before an earlier one) through the careful path, as the link would have:
  under the entry's source's replication origin, with its commit time and LSN, so a newer row already on
  the node wins (router.apply.careful: version against version, recorded in `pgmesh.conflict_history`);
  each entry replayed is marked `replayed` and recorded in `conflict_history` (conflict type
  `quarantined`, resolution `replayed`) in the same transaction. A key whose entry is still refused stops
  there: that entry and the later ones stay pending, and the command says so (exit 1).
- `discard` marks the chosen entries `discarded`, each recorded in `conflict_history` (resolution
  `discarded`, with its row): nothing goes without a row saying so.

A router that answers on its admin listener is held while `replay` or `discard` runs (`POST /hold`, as
`pgmesh part` does: its links hold the origins a replay needs) and released after: its links connect
again and read what is pending anew.

Must not: change an entry that is not pending, replay out of a key's order, or print a DSN.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final, TextIO

import asyncpg

from protocol.lsn import datetime_to_pg_us, parse_lsn
from protocol.messages import (
    KIND_NULL,
    KIND_TEXT,
    KIND_UNCHANGED,
    Column,
    Delete,
    Insert,
    Relation,
    TupleData,
    Update,
)
from protocol.transactions import Transaction
from router.apply.careful.transaction import CarefulApplier
from router.apply.link import LinkSession
from router.apply.state import LinkStats
from router.config.model import Config, NodeConfig, split_table_name
from router.errors import PgmeshError, describe, is_refused
from router.nodes.dsn import asyncpg_args
from router.service.admin import ask_router

_ORIGIN_TRIES: Final = 60  # half a second apart

__all__ = ["cmd_quarantine", "entry_transaction", "replay", "select_entries"]

logger = logging.getLogger(__name__)

_COLUMNS: Final = (
    "id, created_at, source, source_lsn::text, commit_time, table_name, key::text, change_kind,"
    " new_row::text, old_key::text, sqlstate, message, follows, state, resolved_at"
)
_RESOLVE: Final = (
    "UPDATE pgmesh.quarantine SET state = $2, resolved_at = now() WHERE id = $1 AND state = 'pending'"
    " RETURNING id"
)
_OF_KEY: Final = (
    f"SELECT {_COLUMNS} FROM pgmesh.quarantine WHERE state = 'pending' AND table_name = $1"
    " AND key IS NOT DISTINCT FROM $2::jsonb ORDER BY id"
)
# The entry the first pending entry of a key follows, when it is pending too (its table and key).
_FIRST_FOLLOWS: Final = (
    "SELECT f.table_name, f.key::text AS key FROM pgmesh.quarantine AS q JOIN pgmesh.quarantine AS f"
    " ON f.id = q.follows AND f.state = 'pending' WHERE q.id = (SELECT min(id) FROM pgmesh.quarantine"
    " WHERE state = 'pending' AND table_name = $1 AND key IS NOT DISTINCT FROM $2::jsonb)"
)
_RECORD: Final = """
INSERT INTO pgmesh.conflict_history (source, table_name, key, conflict_type, resolution, resolver, reason,
  remote_origin, remote_commit_time, remote_lsn, remote_row)
VALUES ($1, $2, $3, 'quarantined', $4, 'none', $5, $1, $6, $7::text::pg_lsn, $8::text::jsonb)
"""


class Entry:
    """One row of `pgmesh.quarantine`."""

    __slots__ = ("change_kind", "commit_time", "created_at", "follows", "id", "key", "message", "new_row",
                 "node", "old_key", "resolved_at", "source", "source_lsn", "sqlstate", "state", "table_name")

    def __init__(self, node: str, row: Sequence[Any]) -> None:
        self.node = node
        (self.id, self.created_at, self.source, self.source_lsn, self.commit_time, self.table_name, self.key,
         self.change_kind, self.new_row, self.old_key, self.sqlstate, self.message, self.follows, self.state,
         self.resolved_at) = row

    def render(self) -> str:
        why = (f"refused: SQLSTATE {self.sqlstate}: {self.message}" if self.follows is None
               else f"follows entry {self.follows}")
        state = self.state
        if isinstance(self.resolved_at, datetime):
            state = f"{state} at {self.resolved_at:%Y-%m-%d %H:%M:%S}"
        return (f"node {self.node} #{self.id} {self.table_name} key {self.key}: {self.change_kind} from"
                f" {self.source} at {self.source_lsn} ({state}); {why}")

    def as_json(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__}
        for name in ("created_at", "commit_time", "resolved_at"):
            value = out[name]
            out[name] = value.isoformat() if isinstance(value, datetime) else value
        for name in ("key", "new_row", "old_key"):
            out[name] = json.loads(out[name]) if out[name] else None
        return out


def _key_values(entry: Entry) -> str:
    """The entry's key as conflict_history writes keys: its values, comma-separated."""
    return ",".join(str(v) for v in json.loads(entry.key).values()) if entry.key else ""


def _where(ids: Sequence[int], table: str | None, key: str | None, every: bool) -> tuple[str, list[Any]]:
    clauses: list[str] = [] if every else ["state = 'pending'"]
    params: list[Any] = []
    if ids:
        params.append(list(ids))
        clauses.append(f"id = ANY(${len(params)}::bigint[])")
    if table:
        schema, name = split_table_name(table)
        params.append(f"{schema}.{name}")
        clauses.append(f"table_name = ${len(params)}")
    if key is not None:
        params.append(key)
        if key.lstrip().startswith("{"):
            clauses.append(f"key = ${len(params)}::jsonb")
        else:  # a one-column key's value
            values = "(SELECT string_agg(v, ',') FROM jsonb_each_text(key) AS e(k, v))"
            clauses.append(f"{values} = ${len(params)}")
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", params


async def select_entries(conn: Any, node: str, ids: Sequence[int] = (), table: str | None = None,
                         key: str | None = None, every: bool = False) -> list[Entry]:
    where, params = _where(ids, table, key, every)
    rows = await conn.fetch(f"SELECT {_COLUMNS} FROM pgmesh.quarantine{where} ORDER BY id", *params)
    return [Entry(node, tuple(r)) for r in rows]


def _data(names: Sequence[str], values: dict[str, Any]) -> TupleData:
    kinds, cells = bytearray(), list[bytes | None]()
    for name in names:
        if name not in values:
            kinds.append(KIND_UNCHANGED)  # (an unchanged TOAST value: the update leaves it)
            cells.append(None)
        elif values[name] is None:
            kinds.append(KIND_NULL)
            cells.append(None)
        else:
            kinds.append(KIND_TEXT)
            cells.append(str(values[name]).encode())
    return TupleData(bytes(kinds), tuple(cells))


def entry_transaction(entry: Entry) -> Transaction:
    """The entry as the one-change source transaction it came in (its source's commit time and LSN)."""
    new = json.loads(entry.new_row) if entry.new_row else None
    old = json.loads(entry.old_key) if entry.old_key else None
    key = json.loads(entry.key) if entry.key else {}
    names = list(dict.fromkeys([*(new or {}), *(old or {})]))
    schema, name = split_table_name(entry.table_name)
    full = old is not None and set(old) - set(key)  # the old row whole (REPLICA IDENTITY FULL)
    columns = tuple(Column(n, 0, -1, n in key) for n in names)
    relation = Relation(1, schema, name, "f" if full else "d", columns)
    old_data = _data(names, {n: old.get(n) for n in names}) if old is not None else None
    change: Insert | Update | Delete
    if entry.change_kind == "insert":
        change = Insert(1, _data(names, new or {}))
    elif entry.change_kind == "update":
        change = Update(1, _data(names, new or {}), old_data, ("O" if full else "K") if old_data else None)
    else:
        assert old_data is not None
        change = Delete(1, old_data, "O" if full else "K")
    when = entry.commit_time or entry.created_at
    lsn = parse_lsn(entry.source_lsn)
    return Transaction(0, lsn, lsn, datetime_to_pg_us(when), [relation, change], {1: relation})


async def _open(config: Config, source: str, target: NodeConfig) -> tuple[LinkSession, CarefulApplier]:
    """A session on `target` holding `source`'s origin, and a careful applier over it."""
    link = LinkSession(config, source, target, LinkStats())
    for attempt in range(_ORIGIN_TRIES):  # a held router's link lets the origin go a moment later
        try:
            await link.open()
            break
        except asyncpg.ObjectInUseError:
            await link.close()
            if attempt == _ORIGIN_TRIES - 1:
                raise PgmeshError(
                    f"the replication origin of {source} stays busy (a router running without its admin"
                    " listener?)", node=target.name,
                    hint="stop `pgmesh run`, or give it [admin] listen, then replay again") from None
            await asyncio.sleep(0.5)
    await link.load_tables()
    nodes, installed_at = await link.load_origins()
    careful = CarefulApplier(config, source, target.name, nodes)
    careful.installed_at = installed_at
    careful.read_source = link.read_source
    careful.mark = False  # the origin's applied mark stays where the link has it (router.progress.applied)
    return link, careful


async def _replay_entry(link: LinkSession, careful: CarefulApplier, entry: Entry) -> str:
    """Apply one entry and mark it replayed, together; what the careful path decided."""
    conn = link.conn
    assert conn is not None
    txn = entry_transaction(entry)
    async with conn.transaction():
        records = await careful.apply(conn, link.fit(txn), link.tables)  # (a savepoint in this transaction)
        decided = "; ".join(f"{r.conflict.value}: {r.decision.outcome.value} ({r.decision.reason})"
                            for r in records) or "applied, no conflict"
        if await conn.fetchval(_RESOLVE, entry.id, "replayed") is None:
            raise PgmeshError(f"entry {entry.id} is no longer pending", node=entry.node)
        await conn.execute(_RECORD, entry.source, entry.table_name, _key_values(entry), "replayed",
                           f"quarantine entry {entry.id} replayed: {decided}",
                           entry.commit_time or entry.created_at, entry.source_lsn,
                           entry.new_row or entry.old_key)
    return decided


async def _keys_in_order(probe: Any, entries: Sequence[Entry]) -> list[tuple[str, str | None]]:
    """The keys of `entries` in the order of their first entries; a key whose first pending entry follows a
    pending entry of another key (an update moved a row onto it) comes after that key."""
    keys = list(dict.fromkeys((e.table_name, e.key) for e in entries))
    ordered: list[tuple[str, str | None]] = []
    for _ in range(len(keys) * 2 + 1):  # each key placed once; a chain is at most as long as the keys
        if not keys:
            break
        table, key = keys.pop(0)
        if (table, key) in ordered:
            continue
        first = await probe.fetchrow(_FIRST_FOLLOWS, table, key)
        before = (first["table_name"], first["key"]) if first is not None else None
        if before is not None and before != (table, key) and before not in ordered:
            keys[:0] = [before, (table, key)]  # (a key before it that was not chosen is replayed too)
            continue
        ordered.append((table, key))
    return ordered + [k for k in keys if k not in ordered]


async def replay(config: Config, target: NodeConfig, entries: Sequence[Entry], out: TextIO) -> int:
    """Replay the pending entries of the keys of `entries` on `target`, each key in id order; the number of
    keys stopped at an entry that is still refused or fails."""
    sessions: dict[str, tuple[LinkSession, CarefulApplier]] = {}
    stopped = 0
    try:
        probe = await _connect(target)
        try:
            for table, key in await _keys_in_order(probe, entries):
                rows = await probe.fetch(_OF_KEY, table, key)
                for entry in (Entry(target.name, tuple(r)) for r in rows):
                    if entry.source not in sessions:
                        sessions[entry.source] = await _open(config, entry.source, target)
                    try:
                        decided = await _replay_entry(*sessions[entry.source], entry)
                    except (asyncpg.PostgresError, PgmeshError) as exc:
                        stopped += 1
                        what = "still refused" if is_refused(exc) else "failed"
                        print(f"node {target.name} #{entry.id} {table} key {key}: {what} ({describe(exc)});"
                              " it and the later entries of its key stay pending", file=out)
                        break
                    print(f"node {target.name} #{entry.id} {table} key {key}: replayed ({decided})", file=out)
        finally:
            await probe.close()
    finally:
        for link, _ in sessions.values():
            await link.close()
    return stopped


async def _connect(target: NodeConfig) -> Any:
    """A plain session on `target` (its errors said without the DSN)."""
    try:
        return await asyncpg.connect(**asyncpg_args(target.dsn))
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise PgmeshError(f"cannot connect: {describe(exc)}", node=target.name) from None


async def _discard(target: NodeConfig, entries: Sequence[Entry], out: TextIO) -> None:
    conn = await _connect(target)
    try:
        async with conn.transaction():
            for entry in entries:
                if await conn.fetchval(_RESOLVE, entry.id, "discarded") is None:
                    continue
                await conn.execute(_RECORD, entry.source, entry.table_name, _key_values(entry), "discarded",
                                   f"quarantine entry {entry.id} discarded ({entry.change_kind})",
                                   entry.commit_time or entry.created_at, entry.source_lsn,
                                   entry.new_row or entry.old_key)
                print(f"node {target.name} #{entry.id} {entry.table_name} key {entry.key}: discarded",
                      file=out)
    finally:
        await conn.close()


async def cmd_quarantine(
    config: Config, action: str, *, node: str | None = None, ids: Sequence[int] = (),
    table: str | None = None, key: str | None = None, every: bool = False, as_json: bool = False,
    out: TextIO = sys.stdout,
) -> int:
    """The command: 0 done, 1 a key still refused (replay) or nothing chosen."""
    targets = [config.node(node)] if node else list(config.nodes)
    chosen: dict[str, list[Entry]] = {}
    for target in targets:
        conn = await _connect(target)
        try:
            chosen[target.name] = await select_entries(conn, target.name, ids, table, key,
                                                       every and action == "list")
        except asyncpg.UndefinedTableError:
            raise PgmeshError(
                "pgmesh.quarantine is missing", node=target.name,
                hint="run `pgmesh init` again: it adds what an older installation lacks") from None
        finally:
            await conn.close()
    if action == "list":
        for entries in chosen.values():
            for entry in entries:
                print(json.dumps(entry.as_json(), default=str) if as_json else entry.render(), file=out)
        return 0
    if not any(chosen.values()):
        print("no pending entry chosen", file=out)
        return 1
    held = await ask_router(config, "POST", "/hold", limit=150.0)
    if held is not None and held[0] != 200:
        raise PgmeshError("the router did not take a hold", hint="is `pgmesh run` still running?")
    try:
        stopped = 0
        for target in targets:
            if not chosen[target.name]:
                continue
            if action == "discard":
                await _discard(target, chosen[target.name], out)
            else:
                stopped += await replay(config, target, chosen[target.name], out)
    finally:
        if held is not None:
            await ask_router(config, "POST", "/release")
    return 1 if stopped else 0
