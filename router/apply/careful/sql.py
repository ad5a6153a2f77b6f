"""The careful path's reads and writes as SQL (router.apply.careful.local reads, .transaction writes): a
row with its version, a tombstone with its version, the check that a tombstone is still the one a
decision read, and the row written.

A decision on a row that is not here rests on the tombstone read first. A local transaction that inserts
that key and deletes it again commits its tombstone while the careful path's insert waits for it (or
before that insert starts): after the insert, every such transaction has committed (a later one would
wait for the inserted row), so reading the tombstone again tells whether the decision still holds.

Must not: connect, decide conflicts, or run anything (callers execute the SQL).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.apply.statements import (
    COMMIT_ALIAS,
    TABLE_ALIAS,
    TOMBSTONE_ALIAS,
    TargetTable,
    quote_ident,
    quote_literal,
    untouched,
)
from router.apply.uniques import literal

__all__ = ["put_tombstone_sql", "read_row_sql", "read_tombstone_sql", "tombstone_xid_sql", "write_row_sql"]

T, C, TS = TABLE_ALIAS, COMMIT_ALIAS, TOMBSTONE_ALIAS  # pgmesh's aliases (router.apply.statements)


def _row_json(table: TargetTable) -> str:
    """The row of TABLE_ALIAS as JSON: each column's text (or null), as pgoutput's text values are (to_jsonb's
    numbers lose digits once parsed; its arrays and composites are JSON no input function reads)."""
    names = tuple(table.types) or tuple(sorted(table.columns))
    keys = ", ".join(quote_literal(n) for n in names)
    values = ", ".join(f"{T}.{quote_ident(n)}::text" for n in names)
    return f"pg_catalog.json_object(ARRAY[{keys}]::text[], ARRAY[{values}]::text[])"


def read_row_sql(table: TargetTable, where: str, *, lock: bool = True) -> str:
    """The first row of `table` matching `where` (columns qualified by TABLE_ALIAS), locked, with its
    version: labels pgmesh_row (JSON text: each column's text, see `_row_json`), pgmesh_ts,
    pgmesh_origin, pgmesh_ours, and where it is: pgmesh_tableoid and pgmesh_ctid (a ctid alone is not
    unique in a partitioned table). The version is read in the select list, from the row FOR UPDATE
    returns: a LATERAL function beside it kept its output for the row version before a wait (EvalPlanQual
    recomputes only the locked row), so a local write committed during the wait was overwritten. With
    `lock` False, not locked (a read on the source, router.apply.careful.transaction `_whole_row`)."""
    return (
        f'SELECT {_row_json(table)}::text AS "pgmesh_row",'
        f' (pg_catalog.pg_xact_commit_timestamp_origin({T}.xmin))."timestamp" AS "pgmesh_ts",'
        f' (pg_catalog.pg_xact_commit_timestamp_origin({T}.xmin)).roident AS "pgmesh_origin",'
        f' {T}.xmin = pg_catalog.xid(pg_catalog.pg_current_xact_id()) AS "pgmesh_ours",'
        f' {T}.tableoid::oid::int8 AS "pgmesh_tableoid", {T}.ctid::text AS "pgmesh_ctid"'
        f" FROM {table.qualified} AS {T}"
        f" WHERE {where} LIMIT 1" + (f" FOR UPDATE OF {T}" if lock else "")
    )


def read_tombstone_sql(key_sql: str) -> str:
    """The tombstone of key `key_sql` in table $1, with its version (labels as `read_row_sql`'s) and which
    deletion it is: pgmesh_xid (text), for `tombstone_xid_sql` to compare."""
    return (
        f'SELECT {C}."timestamp" AS "pgmesh_ts", {C}.roident AS "pgmesh_origin",'
        f' pg_catalog.xid({TS}.xid) = pg_catalog.xid(pg_catalog.pg_current_xact_id()) AS "pgmesh_ours",'
        f' {TS}.xid::text AS "pgmesh_xid"'
        f" FROM pgmesh.tombstones AS {TS},"
        f" LATERAL pg_catalog.pg_xact_commit_timestamp_origin(pg_catalog.xid({TS}.xid)) AS {C}"
        f" WHERE {TS}.table_name = $1 AND {TS}.key = {key_sql}"
    )


def tombstone_xid_sql(key_sql: str) -> str:
    """Which deletion the tombstone of key `key_sql` in table $1 is now (its xid as text; no row: none;
    'ours': this very transaction's), read on a snapshot of its own, after the write a decision on that
    tombstone led to."""
    return (
        f"SELECT CASE WHEN pg_catalog.xid({TS}.xid) = pg_catalog.xid(pg_catalog.pg_current_xact_id())"
        f" THEN 'ours' ELSE {TS}.xid::text END FROM pgmesh.tombstones AS {TS}"
        f" WHERE {TS}.table_name = $1 AND {TS}.key = {key_sql}"
    )


def put_tombstone_sql(key_sql: str) -> str:
    """Make this transaction the deletion of key `key_sql` in table $1, only if its tombstone is still the
    one read (its xid as text in $2; NULL: there was none). Its status says `INSERT 0 0` when a local
    transaction deleted the key after that read (a decision to take again)."""
    return (
        f"INSERT INTO pgmesh.tombstones AS {TS} (table_name, key, xid)"
        f" VALUES ($1, {key_sql}, pg_catalog.pg_current_xact_id())"
        f" ON CONFLICT (table_name, key) DO UPDATE SET xid = excluded.xid"
        f" WHERE {TS}.xid::text IS NOT DISTINCT FROM $2::text"
    )


def write_row_sql(table: TargetTable, row: Mapping[str, Any], where: str | None) -> str:
    """Insert `row` (where is None) or overwrite the row matched by `where` with it. Its generated columns
    are left out (a row read from the catalog holds them; only the server computes them)."""
    names = [k for k in row if k in table.columns and k not in table.generated]
    if where is None:
        cols = ", ".join(quote_ident(k) for k in names)
        vals = ", ".join(literal(row[k]) for k in names)
        return f"INSERT INTO {table.qualified} ({cols}) OVERRIDING SYSTEM VALUE VALUES ({vals})"
    # (an identity GENERATED ALWAYS: set by no UPDATE; the row matched has the key's value)
    sets = ", ".join(f"{quote_ident(k)} = {literal(row[k])}" for k in names if k not in table.always)
    return f"UPDATE {table.qualified} AS {T} SET {sets or untouched(table, names)} WHERE {where}"
