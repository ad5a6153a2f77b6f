"""Comparing a table without a key (REPLICA IDENTITY FULL) as a multiset of whole rows.

Such a table's rows have no name shared by the nodes (a ctid is where a row happens to lie on one node),
and the same row may be there twice. So a row is named by its text (`(t.*)::text`, or the partial node's
columns, `ROW(t.c1, ...)::text`, printed alike everywhere by the compare sessions' settings), and:

- the first read is the table's count and the SUM (not the XOR: two copies of a row would cancel) of its
  rows' hashes (`whole_sql`; PostgreSQL sums int8 in a 128-bit accumulator, so as cheap as the XOR);
- where it differs, the rows are dealt into buckets by a second hash of their text (as many buckets as
  keep about 256 rows each, from the largest count read: `buckets_for`), each with its count and sum
  (`bucket_sql`, one pass);
- the rows of the differing buckets are read as (text, copies) (`rows_sql`, one pass) and compared as
  multisets (`multiset_differences`): each row whose number of copies is not the same on every node.

A table without a key is read in one task: cutting it by a hash of its rows would read it whole for each
range (no index holds that hash), so three passes at most, whatever the number of differences.

Owns: that SQL (each read given its filter, `where`, by the worker) and the multiset difference.
Must not: run a query, or write anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from psycopg import sql

__all__ = [
    "LEAF_ROWS_KEYLESS",
    "bucket_sql",
    "buckets_for",
    "counts_sql",
    "multiset_differences",
    "parse_sums",
    "row_text",
    "rows_sql",
    "whole_sql",
]

LEAF_ROWS_KEYLESS: Final = 256  # rows per bucket aimed at
_MIN_BUCKETS: Final = 64
_MAX_BUCKETS: Final = 1 << 16


def buckets_for(rows: int) -> int:
    """A power of two of buckets giving about LEAF_ROWS_KEYLESS rows each (64 to 65,536)."""
    want = max(_MIN_BUCKETS, rows // LEAF_ROWS_KEYLESS)
    count = _MIN_BUCKETS
    while count < want and count < _MAX_BUCKETS:
        count *= 2
    return count


def row_text(columns: Sequence[str] | None = None) -> sql.Composable:
    """Row `t` as text: what names it (the whole row, or `columns` only)."""
    if columns is None:
        return sql.SQL("(t.*)::text")
    listed = sql.SQL(", ").join(sql.SQL("t.") + sql.Identifier(c) for c in columns)
    return sql.SQL("ROW({})::text").format(listed)


def _content(columns: Sequence[str] | None) -> sql.Composable:
    return sql.SQL("pg_catalog.hashtextextended({}, 1)").format(row_text(columns))


def _bucket(columns: Sequence[str] | None, buckets: int) -> sql.Composable:
    return sql.SQL("(pg_catalog.hashtextextended({}, 2) & {})").format(
        row_text(columns), sql.Literal(buckets - 1))


def whole_sql(
    schema: str, name: str, columns: Sequence[str] | None, where: sql.Composable
) -> sql.Composed:
    """The table's count and the sum of its rows' hashes (as text)."""
    return sql.SQL("SELECT count(*), coalesce(sum({h}), 0)::text FROM {t} AS t WHERE {w}").format(
        h=_content(columns), t=sql.Identifier(schema, name), w=where)


def bucket_sql(
    schema: str, name: str, columns: Sequence[str] | None, where: sql.Composable, buckets: int
) -> sql.Composed:
    """Per bucket: its number, count and sum of hashes (as text)."""
    return sql.SQL(
        "SELECT {b}, count(*), sum({h})::text FROM {t} AS t WHERE {w} GROUP BY 1"
    ).format(b=_bucket(columns, buckets), h=_content(columns), t=sql.Identifier(schema, name), w=where)


def rows_sql(
    schema: str, name: str, columns: Sequence[str] | None, where: sql.Composable, buckets: int
) -> sql.Composed:
    """The rows of some buckets (parameter: an int8 array of bucket numbers) as (text, copies)."""
    text = row_text(columns)
    return sql.SQL(
        "SELECT {r}, count(*) FROM {t} AS t WHERE {w} AND {b} = ANY(%s::int8[]) GROUP BY 1"
    ).format(r=text, t=sql.Identifier(schema, name), w=where, b=_bucket(columns, buckets))


def counts_sql(
    schema: str, name: str, columns: Sequence[str] | None, where: sql.Composable
) -> sql.Composed:
    """Some rows (parameter: a text array of row texts) as (text, copies), read now."""
    text = row_text(columns)
    return sql.SQL(
        "SELECT {r}, count(*) FROM {t} AS t WHERE {w} AND {r} = ANY(%s::text[]) GROUP BY 1"
    ).format(r=text, t=sql.Identifier(schema, name), w=where)


def multiset_differences(per_node: Sequence[dict[str, int]]) -> list[tuple[str, tuple[int | None, ...]]]:
    """`per_node`: for each node, row text -> copies. Each row whose copies are not the same on every node,
    with its copies per node (None: none there), sorted by text."""
    texts = sorted({text for rows in per_node for text in rows})
    out = []
    for text in texts:
        counts = tuple(rows.get(text) for rows in per_node)
        if any(c != counts[0] for c in counts[1:]):
            out.append((text, counts))
    return out


def parse_sums(rows: Sequence[Sequence[Any]]) -> dict[int, tuple[int, str]]:
    """A `bucket_sql` answer as bucket -> (count, sum)."""
    return {int(b): (int(n), str(s)) for b, n, s in rows}
