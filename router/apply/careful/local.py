"""What a change meets on the target, for the careful path: the local row or tombstone, with its version.

A row is read `FOR UPDATE` with its commit time and origin (router.apply.careful.sql), a tombstone with
the deleting transaction's; each comes back as a `Local`, its version named by node (the origin's node,
the target itself for a local write) and `mine` when the source itself wrote it (or it predates pgmesh
here: no conflict then). A decision on a key no row holds rests on the tombstone read first:
`check_tombstone` reads it again after the write (router.apply.careful.sql says why that suffices) and
raises a unique violation when a local deletion came in between, for the applier to decide the
transaction again (`router.errors.retry_unique`).

Must not: decide, write a row, or record anything (router.apply.careful.transaction does).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, NoReturn, Protocol

import asyncpg

from protocol.lsn import datetime_to_pg_us
from protocol.messages import Relation, TupleData
from router.apply.careful.rows import Row
from router.apply.careful.rows import row_values as _row
from router.apply.careful.sql import read_row_sql, read_tombstone_sql, tombstone_xid_sql
from router.apply.statements import TABLE_ALIAS, TargetTable, identity_match, quote_literal, tombstone_key
from router.apply.uniques import literal as _lit
from router.apply.uniques import row_where
from router.conflicts.resolve import Version

__all__ = [
    "Local", "Who", "by_key", "check_tombstone", "deleted_meanwhile", "held_version", "key_sql", "local_row",
    "tombstone",
]

T = TABLE_ALIAS  # pgmesh's alias of the target table (router.apply.statements)


class Who(Protocol):
    """Whose versions are whose (the careful applier): its source and target, the target's origins."""

    source: str
    target: str
    origin_nodes: dict[int, str]  # roident -> node name (0: the target itself)
    installed_at: int | None  # pgmesh's installation on the target (µs), see pgmesh.expect_origin


class Local:
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


def _node(who: Who, roident: int | None) -> str:
    if roident is None or roident == 0:
        return who.target
    return who.origin_nodes.get(roident, f"origin {roident}")


def _version(who: Who, commit_time: datetime | None, roident: int | None) -> Version:
    return Version(None if commit_time is None else datetime_to_pg_us(commit_time), _node(who, roident))


def _before_pgmesh(who: Who, roident: int | None, version: Version) -> bool:
    """A row every node started with (unknown commit time, or older than pgmesh here): no conflict."""
    if roident not in (None, 0):
        return False
    if version.commit_time is None:
        return True
    return who.installed_at is not None and version.commit_time < who.installed_at


async def local_row(conn: Any, who: Who, table: TargetTable, where: str) -> Local | None:
    """The row of `table` matched by `where`, locked, with its version (None: none)."""
    row = await conn.fetchrow(read_row_sql(table, where))
    if row is None:
        return None
    version = _version(who, row["pgmesh_ts"], row["pgmesh_origin"])
    origin = row["pgmesh_origin"]
    mine = bool(row["pgmesh_ours"]) or version.node == who.source or _before_pgmesh(who, origin, version)
    at = (row["pgmesh_tableoid"], row["pgmesh_ctid"])
    return Local(json.loads(row["pgmesh_row"]), version, mine, at)


async def by_key(
    conn: Any, who: Who, relation: Relation, table: TargetTable, data: TupleData, *, identity: bool = True
) -> Local | None:
    """The local row with the same key: the target's primary key, else (`identity`: the row an update or
    a delete names) its replica identity index's columns, as the fast path matches it (a key tuple
    carries only those, its other columns NULL; an update's new row, the values after it), else the
    whole row."""
    if key := table.pk or (table.identity if identity else ()):
        values = _row(relation, data)
        if all(values.get(k) is not None for k in key):
            return await local_row(conn, who, table, row_where(values, key, table.compare))
    return await local_row(conn, who, table, identity_match(relation, data, full=True, types=table.compare))


def held_version(who: Who, commit_time: datetime | None, roident: int | None) -> Local:
    """A given-up unique value's hold (router.conflicts.given_up), as a local version without a row."""
    return Local(None, _version(who, commit_time, roident), False)


def key_sql(table: TargetTable, values: Row) -> str:
    """The tombstone key of `values` as an SQL text array."""
    kinds = table.compare
    parts = [f"({_lit(values.get(k))}::{kinds.get(k, 'text')})::text" for k in table.tombstone_key]
    return f"ARRAY[{', '.join(parts)}]::text[]"


async def tombstone(conn: Any, who: Who, table: TargetTable, values: Row) -> Local | None:
    """The tombstone of the key of `values`, with its version (None: none)."""
    row = await conn.fetchrow(read_tombstone_sql(tombstone_key(key_sql(table, values))), table.name)
    if row is None:
        return None
    version = _version(who, row["pgmesh_ts"], row["pgmesh_origin"])
    mine = bool(row["pgmesh_ours"]) or version.node == who.source
    return Local(None, version, mine, xid=row["pgmesh_xid"])


async def check_tombstone(conn: Any, table: TargetTable, values: Row, tomb: Local | None) -> None:
    """After writing a row decided on the tombstone `tomb` of the key of `values` (None: none): a later
    tombstone now committed there means the decision no longer holds (`deleted_meanwhile`)."""
    key = tombstone_key(key_sql(table, values))
    xid = await conn.fetchval(tombstone_xid_sql(key), table.name)
    # ('ours': a partial target's row filter took the row out again, not a deletion meanwhile)
    if xid != "ours" and xid != (tomb.xid if tomb else None):
        deleted_meanwhile(table, values)


def deleted_meanwhile(table: TargetTable, values: Row) -> NoReturn:
    """A local deletion of the key came while the careful path decided it: decided again (23505)."""
    key = ",".join(str(values.get(k)) for k in table.tombstone_key)
    raise asyncpg.exceptions.UniqueViolationError(
        f"key ({key}) of {table.name} was deleted here while the careful path decided it: decided again"
    )
