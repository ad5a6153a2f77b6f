"""Repairing a table without a key: making a node hold, of each differing row, as many copies as the
winner holds (`pgmesh repair --from NODE`, or a partial node from its reference).

A keyless table's rows carry no version a rule could weigh (two copies of one row are one row twice, not
two versions), so `pgmesh repair` without `--from` repairs none of them (router.ops.compare.repair
says so); with a winner, its multiset is the truth: a row it holds twice is there twice everywhere after,
a row it lacks is nowhere, and no row is ever multiplied beyond the winner's count.

The write, per table and node, is one transaction: the table locked against other writers (SHARE ROW
EXCLUSIVE: readers go on), each differing row's copies counted again and left alone, reported, where they
are no longer what the comparison read; surplus copies deleted (by tableoid and ctid, so a partitioned
table's rows are told apart), missing ones inserted from the winner's row (generated columns left to the
server, identity columns written with OVERRIDING SYSTEM VALUE), each fix recorded in
`pgmesh.conflict_history`. The caller sets the session up under the winner's repair origin.

Owns: reading the winner's copies and writing them on one node.
Must not: decide what differs or who wins (router.ops.compare.repair), or put a DSN in a message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import msgspec
import psycopg
from psycopg import sql

from router.cluster.compare.multiset import row_text
from router.cluster.compare.worker import kept

__all__ = ["Copies", "insert_columns", "overriding", "winner_copies", "write_copies"]

# A table's columns a repair writes (not generated ones), in order, with their identity kind ('' none)
_WRITABLE_SQL: Final = (
    "SELECT attname, attidentity::text FROM pg_catalog.pg_attribute WHERE attrelid = %s::regclass"
    " AND attnum > 0 AND NOT attisdropped AND attgenerated = '' ORDER BY attnum"
)
_RECORD_SQL: Final = (
    "INSERT INTO pgmesh.conflict_history (source, table_name, key, conflict_type, resolution, resolver,"
    " reason, local_origin, remote_origin, remote_commit_time, local_row, remote_row)"
    " VALUES ('repair', %s, %s, 'divergence', %s, 'repair', %s, %s, %s, clock_timestamp(), %s::jsonb,"
    " %s::jsonb)"
)


class Copies(msgspec.Struct, frozen=True):
    """One row of a table without a key (its text, as compare names it): the copies a node held when
    compared (`expected`), the copies the winner holds (`wanted`), and the winner's row as JSON (None
    where it holds none)."""

    text: str
    expected: int
    wanted: int
    row: str | None


async def insert_columns(
    conn: psycopg.AsyncConnection[Any], table: str, columns: Sequence[str] | None = None
) -> dict[str, str]:
    """The columns a repair writes into `table` (no generated one; of `columns` only, if given), in order,
    each with its identity kind (pg_attribute.attidentity: 'a' always, 'd' by default, '' none; an INSERT
    that writes one needs OVERRIDING SYSTEM VALUE, and an UPDATE cannot write an 'a' one)."""
    rel = sql.Identifier(*table.split(".", 1)).as_string(conn)
    cur = await conn.execute(_WRITABLE_SQL, [rel])
    return {str(n): str(i) for n, i in await cur.fetchall() if columns is None or n in columns}


def overriding(identity: dict[str, str]) -> sql.Composable:
    """` OVERRIDING SYSTEM VALUE` where an INSERT writes an identity column."""
    return sql.SQL(" OVERRIDING SYSTEM VALUE") if any(identity.values()) else sql.SQL("")


async def winner_copies(
    conn: psycopg.AsyncConnection[Any], table: str, texts: Sequence[str], columns: Sequence[str] | None,
    rows: str | None,
) -> dict[str, tuple[int, str]]:
    """The winner's copies of each row (by text; `columns`: a partial node's, with its filter `rows`
    applied) now, with one of them as JSON."""
    schema, name = table.split(".", 1)
    where = kept(rows) if rows is not None else sql.SQL("true")
    text = row_text(columns)
    cur = await conn.execute(
        sql.SQL(
            "SELECT {r}, count(*), (pg_catalog.array_agg(pg_catalog.to_jsonb(t.*)::text))[1] FROM {rel} AS t"
            " WHERE {w} AND {r} = ANY(%s::text[]) GROUP BY 1"
        ).format(r=text, rel=sql.Identifier(schema, name), w=where),
        [list(texts)],
    )
    return {str(t): (int(n), str(j)) for t, n, j in await cur.fetchall()}


async def write_copies(
    conn: psycopg.AsyncConnection[Any], table: str, winner: str, node: str, rows: Sequence[Copies],
    columns: Sequence[str] | None = None,
) -> tuple[list[str], list[str]]:
    """Make `node` hold `wanted` copies of each row (see the module docstring): the texts written, and
    those left alone (changed since the comparison)."""
    schema, name = table.split(".", 1)
    rel = sql.Identifier(schema, name)
    text = row_text(columns)
    async with conn.transaction():
        await conn.execute("SELECT pg_catalog.set_config('session_replication_role', 'replica', true)")
        await conn.execute(sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(rel))
        cur = await conn.execute(
            sql.SQL(
                "SELECT {r}, count(*), (pg_catalog.array_agg(pg_catalog.to_jsonb(t.*)::text))[1]"
                " FROM {rel} AS t WHERE {r} = ANY(%s::text[]) GROUP BY 1"
            ).format(r=text, rel=rel),
            [[c.text for c in rows]],
        )
        now = {str(t): (int(n), str(j)) for t, n, j in await cur.fetchall()}
        ok = [c for c in rows if now.get(c.text, (0, None))[0] == c.expected]
        surplus = [c for c in ok if c.expected > c.wanted]
        if surplus:
            await conn.execute(
                sql.SQL(
                    "DELETE FROM {rel} AS d WHERE (d.tableoid, d.ctid) IN (SELECT x.o, x.c FROM"
                    " (SELECT t.tableoid AS o, t.ctid AS c, {r} AS r,"
                    "  pg_catalog.row_number() OVER (PARTITION BY {r}) AS n"
                    "  FROM {rel} AS t WHERE {r} = ANY(%s::text[])) AS x"
                    " JOIN unnest(%s::text[], %s::int8[]) AS s(r, k) ON s.r = x.r WHERE x.n <= s.k)"
                ).format(rel=rel, r=text),
                [texts := [c.text for c in surplus], texts, [c.expected - c.wanted for c in surplus]],
            )
        missing = [c for c in ok if c.wanted > c.expected and c.row is not None]
        if missing:
            identity = await insert_columns(conn, table, columns)
            names = list(identity)
            cols = sql.SQL(", ").join(map(sql.Identifier, names))
            await conn.execute(
                sql.SQL(
                    "INSERT INTO {rel} ({cols}){override} SELECT {picked}"
                    " FROM unnest(%s::jsonb[], %s::int8[]) AS s(j, k)"
                    " CROSS JOIN LATERAL pg_catalog.generate_series(1, s.k) AS g"
                    " CROSS JOIN LATERAL pg_catalog.jsonb_populate_record(NULL::{rel}, s.j) AS r"
                ).format(
                    rel=rel, cols=cols,
                    override=overriding(identity),
                    picked=sql.SQL(", ").join(sql.SQL("r.") + sql.Identifier(n) for n in names),
                ),
                [[c.row for c in missing], [c.wanted - c.expected for c in missing]],
            )
        for c in ok:
            await conn.execute(_RECORD_SQL, [
                table, c.text, "deleted" if c.wanted < c.expected else "written",
                f"pgmesh repair: {winner}'s copies of a row of a table without a key"
                f" ({c.expected} here, {c.wanted} there)",
                node, winner, now.get(c.text, (0, None))[1], c.row,
            ])
    written = {c.text for c in ok}
    return sorted(written), [c.text for c in rows if c.text not in written]
