"""`pgmesh tail NODE`: a node's committed transactions, decoded, printed as they commit (for debugging).

It streams the node through a temporary logical slot of its own (pgoutput, the cluster's publication),
which the server drops when the command ends: the router's slots are untouched and nothing is left on the
node. It starts at the slot's creation (what commits from then on) and shows every transaction on the
replicated tables, those the router applied there included, each labelled with where it came from: `local`,
`from NODE` (applied from that node, or written there by `pgmesh repair`), or the origin's name. Values are
PostgreSQL's text output; a TOASTed value an update left unchanged shows as `<unchanged>`. A transaction
bigger than `[replication] spill_mb` goes to disk as it arrives (the router's spool) and is printed from
there: memory stays bounded. Each printed transaction is confirmed, so the slot keeps no WAL for it.

Must not: write to a table, touch the router's slots or origins, or put a DSN in a message.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Final, TextIO

import msgspec

from protocol.changes import ChangeContext, Dispatch, note_relation
from protocol.lsn import format_lsn, pg_us_to_datetime
from protocol.messages import Delete, Insert, Message, RawInsert, Relation, Truncate, TupleData, Type, Update
from protocol.pgoutput import decode_raw_insert
from protocol.transactions import Change, Transaction
from router.config.model import Config
from router.stream.items import SourceOptions
from router.stream.seen import origin_nodes
from router.stream.source import ReplicationSource
from router.stream.spool import Spool, iter_chunks, let_go

__all__ = ["TailedChange", "TailedTransaction", "cmd_tail", "tail"]

_UNCHANGED: Final = "<unchanged>"


class TailedChange(msgspec.Struct, frozen=True):
    """One change: `op` INSERT, UPDATE, DELETE, TRUNCATE or MESSAGE; `row`: column -> text (None: NULL);
    `key`: the old key (or old row) an update or delete names, when the stream carries one."""

    op: str
    table: str
    row: dict[str, str | None] | None = None
    key: dict[str, str | None] | None = None
    content: str | None = None  # a message's content (as UTF-8, invalid bytes replaced)


class TailedTransaction(msgspec.Struct, frozen=True):
    node: str
    commit_lsn: str
    end_lsn: str
    commit_time: str
    xid: int
    origin: str  # "local", "from NODE", or the origin's name
    changes: list[TailedChange]


def _cells(relation: Relation, data: TupleData, only_key: bool = False) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, column in enumerate(relation.columns):
        if only_key and not column.key:
            continue
        if data.is_unchanged(i):
            out[column.name] = _UNCHANGED
        else:
            value = data.values[i]
            out[column.name] = value.decode(errors="replace") if isinstance(value, bytes) else None
    return out


def _changes(txn: Transaction) -> Iterator[Change]:
    """Every change of `txn`, those it spilled first (read back from disk a chunk at a time)."""
    for chunk in iter_chunks(txn):
        yield from chunk


def describe_changes(txn: Transaction, changes: Iterable[Change]) -> Iterator[TailedChange]:
    context = ChangeContext(dict(txn.relations))
    handlers = _DESCRIBE.handlers
    for change in changes:
        yield from handlers[type(change)](context, change)


def _relation(context: ChangeContext, change: Relation) -> tuple[TailedChange, ...]:
    note_relation(context, change)
    return ()


def _type(context: ChangeContext, change: Type) -> tuple[TailedChange, ...]:
    return ()


def _message(context: ChangeContext, change: Message) -> tuple[TailedChange, ...]:
    return (TailedChange("MESSAGE", change.prefix, content=change.content.decode(errors="replace")),)


def _truncate(context: ChangeContext, change: Truncate) -> tuple[TailedChange, ...]:
    relations = context.relations
    return tuple(TailedChange("TRUNCATE", _label(relations.get(relid), relid)) for relid in change.relids)


def _insert(context: ChangeContext, change: Insert | RawInsert) -> tuple[TailedChange, ...]:
    insert = decode_raw_insert(change) if isinstance(change, RawInsert) else change
    relation = context.relations[insert.relid]
    return (TailedChange("INSERT", _label(relation, insert.relid), row=_cells(relation, insert.new)),)


def _update(context: ChangeContext, change: Update) -> tuple[TailedChange, ...]:
    relation = context.relations[change.relid]
    key = None if change.old is None else _cells(relation, change.old, change.old_kind == "K")
    label = _label(relation, change.relid)
    return (TailedChange("UPDATE", label, row=_cells(relation, change.new), key=key),)


def _delete(context: ChangeContext, change: Delete) -> tuple[TailedChange, ...]:
    relation = context.relations[change.relid]
    key = _cells(relation, change.old, change.old_kind == "K")
    return (TailedChange("DELETE", _label(relation, change.relid), key=key),)


_DESCRIBE: Final[Dispatch[ChangeContext, tuple[TailedChange, ...]]] = Dispatch({
    Relation: _relation, Type: _type, Message: _message, Truncate: _truncate, Insert: _insert,
    RawInsert: _insert, Update: _update, Delete: _delete,
})


def _label(relation: Relation | None, relid: int) -> str:
    return f"relation {relid}" if relation is None else f"{relation.namespace}.{relation.name}"


def _origin(txn: Transaction, origins: Mapping[str, str]) -> str:
    if txn.origin is None:
        return "local"
    node = origins.get(txn.origin)
    return f"from {node}" if node is not None else txn.origin


def render(txn: TailedTransaction) -> str:
    lines = [f"{txn.commit_lsn} {txn.commit_time} xid {txn.xid} {txn.origin}: {len(txn.changes)} change(s)"]
    for change in txn.changes:
        if change.op == "MESSAGE":
            lines.append(f"  MESSAGE {change.table}: {change.content}")
            continue
        text = f"  {change.op} {change.table}"
        if change.key is not None:
            text += f" key {_values(change.key)}"
        if change.row is not None:
            text += f" {_values(change.row)}"
        lines.append(text)
    return "\n".join(lines)


def _values(row: Mapping[str, str | None]) -> str:
    def literal(value: str | None) -> str:
        if value is None:
            return "NULL"
        return value if value == _UNCHANGED else "'" + value.replace("'", "''") + "'"

    return "(" + ", ".join(f"{name}={literal(value)}" for name, value in row.items()) + ")"


async def tail(
    config: Config, node: str, emit: Callable[[TailedTransaction], None], *, limit: int | None = None,
    started: asyncio.Event | None = None,
) -> int:
    """Stream `node` through a temporary slot and call `emit(TailedTransaction)` for each transaction, up to
    `limit` (None: until cancelled); `started` is set once the slot exists. Returns how many were shown."""
    member = config.node(node)
    origins = origin_nodes(config.node_names, config.origin_name(""), config.early_origin_name(""))
    spool = Spool(config.replication.spool_dir or None, cluster=f"{config.cluster.name}_tail")
    options = SourceOptions(
        binary=False, application_name=f"pgmesh tail {config.cluster.name}",
        spill_bytes=config.replication.spill_mb << 20, status_interval=5.0,
    )
    slot = f"pgmesh_tail_{config.cluster.name}_{os.getpid()}"
    publications = [config.publication_name]
    source = ReplicationSource(node, member.dsn, slot, publications, options=options, spool=spool)
    shown = 0
    try:
        created = await source.create_slot(temporary=True)
        source.confirm(created.consistent_point)
        if started is not None:
            started.set()
        async for item in source.stream():
            if isinstance(item, Message):  # non-transactional: not a transaction of the node's tables
                source.confirm(item.lsn + 1)
                continue
            if not isinstance(item, Transaction):
                continue
            try:
                emit(TailedTransaction(
                    node, format_lsn(item.commit_lsn), format_lsn(item.end_lsn),
                    pg_us_to_datetime(item.commit_time).isoformat(), item.xid, _origin(item, origins),
                    list(describe_changes(item, _changes(item))),
                ))
            finally:
                let_go(item)
            source.confirm(item.end_lsn)
            shown += 1
            if limit is not None and shown >= limit:
                break
    finally:
        await source.close()
        spool.close()
    return shown


async def cmd_tail(
    config: Config, node: str, *, as_json: bool = False, limit: int | None = None, out: TextIO = sys.stdout
) -> int:
    """`pgmesh tail NODE`: print each transaction (text, or one JSON object a line) as it commits."""

    def emit(txn: TailedTransaction) -> None:
        print(msgspec.json.encode(txn).decode() if as_json else render(txn), file=out, flush=True)

    await tail(config, node, emit, limit=limit)
    return 0
