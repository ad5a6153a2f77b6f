"""A replicated table's keys on one node, and how they differ between two nodes.

Owns reading, for every candidate table of a node at once, what decides which rows clash and how a row
is found on another node: the primary key (its columns in order), every unique constraint and unique
index (its key columns or expressions with an explicit collation, its partial predicate, NULLS NOT
DISTINCT, DEFERRABLE, whether it is valid) and the replica identity (DEFAULT, FULL, NOTHING, or USING
INDEX with that index's shape). Also the pure comparison (`key_diff`) that `router.cluster.checks`
reports from.

What is compared is shape, never a name: index and constraint names may differ between nodes, a unique
constraint and a unique index of the same shape are the same thing (they refuse the same rows), a
duplicate unique index changes nothing, and REPLICA IDENTITY USING INDEX on the primary key is DEFAULT.
Columns left out of the key (INCLUDE), the index method and the sort order are not compared: they do not
change which rows clash.

Must not: write anything to a node, connect (the caller hands a connection), or decide whether a node can
take part (the checks do, from `key_diff`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import msgspec

from router.nodes.connect import Conn

__all__ = ["IDENTITY_GONE", "TableKeys", "key_diff", "read_keys"]

# One row per (table, live unique index), or one row with NULL index columns for a table without any.
# indnullsnotdistinct is read through to_jsonb: a server without it (before 15) reads false, not an error.
_KEYS_SQL: Final = """
SELECT n.nspname, c.relname, c.relreplident::text, i.indexrelid IS NOT NULL,
       coalesce(i.indisprimary, false), coalesce(i.indisreplident, false), coalesce(i.indisvalid, true),
       ARRAY(SELECT pg_get_indexdef(i.indexrelid, k, true)
                    || coalesce(' COLLATE ' || (SELECT quote_ident(l.collname) FROM pg_collation l
                                                 WHERE l.oid = i.indcollation[k - 1] AND l.oid <> 100), '')
             FROM generate_series(1, i.indnkeyatts) AS k ORDER BY k),
       pg_get_expr(i.indpred, i.indrelid, true),
       coalesce((to_jsonb(i) ->> 'indnullsnotdistinct')::boolean, false),
       coalesce(con.condeferrable, false), coalesce(con.condeferred, false)
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_index i ON i.indrelid = c.oid AND i.indisunique AND i.indislive
LEFT JOIN pg_constraint con
       ON con.conindid = i.indexrelid AND con.conrelid = c.oid AND con.contype IN ('p', 'u')
WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
  AND n.nspname <> ALL(%s) AND n.nspname NOT LIKE 'pg\\_%%'
"""

_IDENTITY: Final = {"d": "DEFAULT", "f": "FULL", "n": "NOTHING"}
# REPLICA IDENTITY USING INDEX whose index was dropped: the server then logs no old key at all.
IDENTITY_GONE: Final = "USING INDEX (that index is gone)"


class TableKeys(msgspec.Struct, frozen=True):
    """A table's keys as shapes: `primary` is "(a, b)" or None, `uniques` "(lower(email)) WHERE ...",
    `identity` "DEFAULT", "FULL", "NOTHING" or "USING INDEX (k)"."""

    primary: str | None = None
    uniques: frozenset[str] = frozenset()
    identity: str = "DEFAULT"


def _shape(columns: Sequence[str], predicate: str | None, nulls_not_distinct: bool, deferrable: bool,
           deferred: bool, valid: bool) -> str:
    """One unique index (or the primary key) as the text a DBA would write for it, without a name."""
    text = f"({', '.join(columns)})"
    if nulls_not_distinct:
        text += " NULLS NOT DISTINCT"
    if predicate:
        text += f" WHERE {predicate}"
    if deferrable:
        text += " DEFERRABLE INITIALLY DEFERRED" if deferred else " DEFERRABLE"
    if not valid:
        text += " (INVALID index)"
    return text


async def read_keys(conn: Conn, skip_schemas: Sequence[str]) -> dict[tuple[str, str], TableKeys]:
    """Every candidate table's keys (ordinary and partitioned tables outside `skip_schemas`)."""
    cur = await conn.execute(_KEYS_SQL, [list(skip_schemas)])
    parts: dict[tuple[str, str], tuple[str, list[tuple[bool, bool, str]]]] = {}
    for schema, table, replident, has_index, primary, ident, valid, columns, pred, nnd, dfr, dfd in (
        await cur.fetchall()
    ):
        _, indexes = parts.setdefault((schema, table), (replident, []))
        if has_index:
            indexes.append((primary, ident, _shape(columns, pred, nnd, dfr, dfd, valid)))
    found: dict[tuple[str, str], TableKeys] = {}
    for table, (replident, indexes) in parts.items():
        primary = next((shape for is_pk, _, shape in indexes if is_pk), None)
        identity = _IDENTITY.get(replident, IDENTITY_GONE)
        if replident == "i":
            chosen = next(((is_pk, shape) for is_pk, ident, shape in indexes if ident), None)
            if chosen is not None:
                identity = "DEFAULT" if chosen[0] else f"USING INDEX {chosen[1]}"
        uniques = frozenset(shape for is_pk, _, shape in indexes if not is_pk)
        found[table] = TableKeys(primary, uniques, identity)
    return found


def key_diff(mine: TableKeys, theirs: TableKeys, other: str) -> list[str]:
    """How the keys here differ from those on node `other`, one phrase each (empty when alike)."""
    out: list[str] = []
    if mine.primary != theirs.primary:
        here = f"primary key {mine.primary}" if mine.primary else "no primary key"
        there = theirs.primary or "none"
        out.append(f"{here} here but {there} on node {other}")
    for shape in sorted(mine.uniques - theirs.uniques):
        out.append(f"unique {shape} here has no match on node {other}")
    for shape in sorted(theirs.uniques - mine.uniques):
        out.append(f"unique {shape} of node {other} is missing here")
    if mine.identity != theirs.identity:
        out.append(f"replica identity {mine.identity} here but {theirs.identity} on node {other}")
    return out
