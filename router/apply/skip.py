"""`pgmesh skip` on the apply side: a link leaves out exactly one source transaction, named by the LSN its
error and `pgmesh status` show (the transaction's end LSN, the position pgmesh names every transaction
by: a link that applied it shows that LSN as applied), as PostgreSQL's `ALTER SUBSCRIPTION ... SKIP`.

The skip is recorded on the target, in `pgmesh.links.skip_lsn` of the source (`RECORD_SKIP`), so that a
router started later, or a link that reconnects, still knows it: the applier reads it on every connect
(`read_skip`). When the link reaches the first transaction that ends at or past that LSN (`due`), one
that ends exactly there is not applied: one target transaction records it in `pgmesh.conflict_history`
(conflict type and resolution `skipped`, the source, its LSN and commit time, and what it held: its
changes counted per table and kind, its DDL commands), clears the skip and moves the source's origin
past it (the set-up with the applied mark on 16+, router.progress.applied), atomically (`skip_transaction`).
One
that ends past it means no transaction ends there: the skip is dropped with a warning and nothing is left
out (`drop_skip`). A skip at or before what the target applied is refused, and so is one other than the
transaction a link held on an error is stuck on (`check_skip`).

Must not: pause, resume or retry a link (the applier and the router do), or leave out anything but the
one transaction whose end LSN equals the skip's (invariant 1: that one is all that is lost, and it is
recorded).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

from protocol.changes import ChangeContext, Dispatch, ignore, note_relation
from protocol.lsn import format_lsn, parse_lsn, pg_us_to_datetime
from protocol.messages import Delete, Insert, Message, RawInsert, Relation, Truncate, Type, Update
from protocol.transactions import Transaction
from router.apply.link import LinkSession
from router.apply.statements import setup_statement
from router.config.model import PGMESH_SCHEMA
from router.ddl.messages import DDL_PREFIX, ddl_command, describe_command
from router.errors import PgmeshError, describe
from router.stream.spool import iter_raw_chunks

__all__ = [
    "RECORD_SKIP", "SKIPPED", "check_skip", "drop_skip", "due", "held_by", "parse_skip", "read_skip",
    "record_skip", "skip_transaction",
]

logger = logging.getLogger(__name__)

SKIPPED: Final = "skipped"  # conflict_history's conflict_type and resolution of a skipped transaction
_LINKS: Final = f'"{PGMESH_SCHEMA}"."links"'
_HISTORY: Final = f'"{PGMESH_SCHEMA}"."conflict_history"'
_MAX_DDL: Final = 10  # DDL commands named in the record

# psycopg (the router's monitoring connection, `pgmesh skip` without a router): the source and the skip
# LSN as text. (`pgmesh init` adds the column to an installation from before `pgmesh skip`.)
RECORD_SKIP: Final = (
    f"INSERT INTO {_LINKS} (source, skip_lsn, updated) VALUES (%s, %s::pg_lsn, now())"
    " ON CONFLICT (source) DO UPDATE SET skip_lsn = excluded.skip_lsn, updated = now()"
)
# asyncpg, on the applier's session: the source's skip (none where the column is missing).
_READ: Final = f"SELECT pg_catalog.to_jsonb(l) ->> 'skip_lsn' FROM {_LINKS} l WHERE l.source = $1"
_CLEAR: Final = (f"UPDATE {_LINKS} SET skip_lsn = NULL, updated = now() WHERE source = $1"
                  " AND skip_lsn = $2::text::pg_lsn")
_RECORD: Final = (
    f"INSERT INTO {_HISTORY} (source, table_name, key, conflict_type, resolution, resolver, reason,"
    " remote_origin, remote_commit_time, remote_lsn, remote_row)"
    " VALUES ($1, $2, '', $3, $3, 'pgmesh skip', $4, $1, $5, $6::text::pg_lsn, $7::text::jsonb)"
)


def parse_skip(text: str) -> int:
    """`--lsn X/Y` as an LSN; a PgmeshError that says what an LSN looks like."""
    try:
        return int(parse_lsn(text))
    except ValueError:
        raise PgmeshError(f"--lsn {text!r} is not an LSN", hint="give it as `pgmesh status` or the link's"
                          " error shows it, e.g. 0/1A2B3C8") from None


def check_skip(lsn: int, *, link: str, target: str, applied: int, stuck: int | None) -> str:
    """Refuse a skip that cannot name the transaction the link is to leave out: at or before what the
    target applied, or (`stuck`: the end LSN of the transaction a link held on an error is stuck on)
    another one than that. Returns what will happen, for the operator."""
    if lsn <= applied:
        raise PgmeshError(
            f"link {link}: {format_lsn(lsn)} is not ahead of what node {target} applied"
            f" ({format_lsn(applied)}); nothing skipped", node=target, lsn=lsn,
            hint="give the LSN of the transaction the link is stuck on, as `pgmesh status` shows it",
        )
    if stuck is not None and lsn != stuck:
        raise PgmeshError(
            f"link {link} is stuck on the transaction that ends at {format_lsn(stuck)}, not at"
            f" {format_lsn(lsn)}; nothing skipped", node=target, lsn=lsn,
            hint=f"to leave that transaction out on {target}: --lsn {format_lsn(stuck)}",
        )
    if stuck is not None:
        return f"{link}: skipping the transaction at {format_lsn(lsn)} it is stuck on"
    return (f"{link}: the transaction that ends at {format_lsn(lsn)} will be skipped when it comes (if none"
            " ends there, the skip is dropped and nothing is left out)")


def due(batch: list[Transaction], lsn: int) -> int | None:
    """The index of the first transaction of `batch` that ends at or past `lsn` (None: none does)."""
    return next((i for i, txn in enumerate(batch) if txn.end_lsn >= lsn), None)


async def read_skip(link: LinkSession) -> int | None:
    """The skip recorded on the target for the link's source (None: none)."""
    assert link.conn is not None
    text = await link.conn.fetchval(_READ, link.source)
    return int(parse_lsn(text)) if text else None


def held_by(txn: Transaction) -> tuple[str, dict[str, Any]]:
    """What `txn` held, for its record: the tables it changed ("" for none), and per table the changes
    it made by kind, with its DDL commands (the first ones) under "ddl"."""
    held = _Held(dict(txn.relations))
    handlers = _HELD.handlers
    for chunk in iter_raw_chunks(txn):
        for change in chunk:
            handlers[type(change)](held, change)
    counts, ddl = held.counts, held.ddl
    out: dict[str, Any] = dict(counts)
    if ddl:
        out["ddl"] = ddl[:_MAX_DDL] + ([f"and {len(ddl) - _MAX_DDL} more"] if len(ddl) > _MAX_DDL else [])
    return ", ".join(sorted(counts)), out


class _Held(ChangeContext):
    """What a transaction held, counted so far (the handlers of `_HELD` count)."""

    __slots__ = ("counts", "ddl")

    def __init__(self, relations: dict[int, Relation]) -> None:
        super().__init__(relations)
        self.counts: dict[str, dict[str, int]] = {}  # table -> kind of change -> how many
        self.ddl: list[str] = []

    def count(self, relid: int, kind: str) -> None:
        relation = self.relations.get(relid)
        name = f"{relation.schema}.{relation.name}" if relation is not None else f"relation {relid}"
        per = self.counts.setdefault(name, {})
        per[kind] = per.get(kind, 0) + 1


def _insert(held: _Held, change: Insert | RawInsert) -> None:
    held.count(change.relid, "insert")


def _update(held: _Held, change: Update) -> None:
    held.count(change.relid, "update")


def _delete(held: _Held, change: Delete) -> None:
    held.count(change.relid, "delete")


def _truncate(held: _Held, change: Truncate) -> None:
    for relid in change.relids:
        held.count(relid, "truncate")


def _message(held: _Held, change: Message) -> None:
    if change.prefix == DDL_PREFIX:
        command = ddl_command(change)
        held.ddl.append(f"{command.tag}: {json.loads(describe_command(command))}")


_HELD: Final[Dispatch[_Held, None]] = Dispatch({
    Relation: note_relation, Type: ignore, Insert: _insert, RawInsert: _insert, Update: _update,
    Delete: _delete, Truncate: _truncate, Message: _message,
})


async def skip_transaction(link: LinkSession, txn: Transaction) -> None:
    """Leave `txn` out on the target: record it, clear the skip and move the origin past it, in one target
    transaction (the set-up last, as on every commit path). The main session must hold the origin."""
    conn = link.conn
    assert conn is not None
    tables, held = held_by(txn)
    lsn = format_lsn(txn.end_lsn)
    when = pg_us_to_datetime(txn.commit_time)
    reason = (f"transaction {txn.xid} of {link.source}, ending at {lsn}, left out on {link.target.name} by"
              f" `pgmesh skip`: {json.dumps(held)}")
    async with conn.transaction():
        await conn.execute(_RECORD, link.source, tables, SKIPPED, reason, when, lsn, json.dumps(held))
        await conn.execute(_CLEAR, link.source, lsn)
        await conn.execute(setup_statement("$1::text::pg_lsn", "$2", None, link.mark), lsn, when)
    if note := link.applied_note([txn]):  # 16+: as every commit path (router.stream.seen)
        await conn.execute(note)
    logger.warning("link %s: skipped %s's transaction %s ending at %s (committed there at %s), as asked by"
                   " `pgmesh skip`: it held %s; recorded in %s", link.name, link.source, txn.xid, lsn,
                   when.isoformat(), json.dumps(held), _HISTORY)


async def drop_skip(link: LinkSession, lsn: int, passed: Transaction) -> None:
    """No transaction ends at `lsn` (the link reached `passed`, which ends after it): forget the skip."""
    assert link.conn is not None
    await link.conn.execute(_CLEAR, link.source, format_lsn(lsn))
    logger.warning("link %s: no transaction of %s ends at %s (the next one ends at %s); the skip is dropped"
                   " and nothing was left out", link.name, link.source, format_lsn(lsn),
                   format_lsn(passed.end_lsn))


async def record_skip(
    query: Callable[[str, Sequence[Any]], Awaitable[object]], source: str, lsn: int, target: str,
    limit_s: float,
) -> None:
    """Write the skip on the target (`query`: a psycopg-style query there) within `limit_s` seconds; a
    PgmeshError that says nothing was skipped when it cannot."""
    try:
        async with asyncio.timeout(limit_s):
            await query(RECORD_SKIP, [source, format_lsn(lsn)])
    except Exception as exc:
        raise PgmeshError(f"cannot record the skip ({describe(exc) or 'no answer'}); nothing skipped",
                          node=target, lsn=lsn, hint="bring the node up, then run `pgmesh skip` again",
                          ) from None
