"""Unique values given up: how pgmesh names a secondary unique key, and the SQL that reads what rows of a
table gave up on it (`pgmesh.given_up`, written by the `pgmesh_given_up` trigger: sql/given_up_ensure.sql).

A row that held a secondary unique value and gave it up (deleted, or updated to another value or key)
leaves a record: (table, unique key, value, the row's key, the transaction of the version that held it).
A replicated claim on that value that is older than the hold loses to it, as it would have lost to the row
on a node where it arrived while the row still held the value (docs/conflicts.md, "A unique value given
up"). The trigger names each unique key as `unique_name` does from the applier's view of the table (the
JSON text of its columns, or of its terms and predicate), so both sides find the same records.

Must not: decide conflicts, or write (router.apply.careful.transaction decides; the trigger writes).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Final

__all__ = ["GIVEN_UP_SQL", "RECORD_SQL", "TRIGGER", "VALUE_LOCK_SQL", "plain_name", "unique_name"]

TRIGGER: Final = "pgmesh_given_up"

# One claim or record of a value at a time: the lock the claim trigger takes (sql/given_up_ensure.sql) on
# value `{value}` (SQL for a text[]) of unique key $2 of table $1, before it looks for records; the careful
# path takes it before it looks for rows holding the value and for records, and before it writes a record.
VALUE_LOCK_SQL: Final = (
    "SELECT pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended("
    "'pgmesh given up:' || $1 || ':' || $2 || ':' || ({value})::text, 0))"
)

# The records of unique key $2 of table $1 for value `{value}` (SQL for a text[]) held by other rows than
# key `{key}` (SQL for a text[]): each with the holding version (labels as the careful path's reads).
GIVEN_UP_SQL: Final = (
    'SELECT pgmesh_g.key AS "pgmesh_key", pgmesh_g.xid::text AS "pgmesh_xid",'
    ' pgmesh_c."timestamp" AS "pgmesh_ts", pgmesh_c.roident AS "pgmesh_origin"'
    " FROM pgmesh.given_up AS pgmesh_g,"
    " LATERAL pg_catalog.pg_xact_commit_timestamp_origin(pg_catalog.xid(pgmesh_g.xid)) AS pgmesh_c"
    " WHERE pgmesh_g.table_name = $1 AND pgmesh_g.unique_key = $2"
    " AND pg_catalog.md5(pgmesh_g.value) = pg_catalog.md5(({value})::text)"
    " AND pgmesh_g.value = ({value})::text AND pgmesh_g.key <> ({key})::text"
)


def plain_name(columns: Sequence[str]) -> str:
    """A plain unique key's name: its columns as JSON text (as PostgreSQL's jsonb prints a text[])."""
    return json.dumps(list(columns), ensure_ascii=False)


def unique_name(terms: Sequence[str], predicate: str | None) -> str:
    """A unique index's (on expressions, or with a predicate) name: its terms and predicate as JSON text."""
    return json.dumps([*terms, predicate], ensure_ascii=False)


# Record that this transaction's version of the row with key `{key}` holds value `{value}` of unique key $2
# of table $1 (a claim that is not written: it lost, but it still held the value where it was written).
RECORD_SQL: Final = (
    "INSERT INTO pgmesh.given_up AS pgmesh_g (table_name, unique_key, value, key, xid)"
    " SELECT $1, $2, pgmesh_v.v::text, ({key})::text, pg_catalog.pg_current_xact_id()"
    " FROM (SELECT {value} AS v) AS pgmesh_v"
    " WHERE pgmesh_v.v IS NOT NULL AND pg_catalog.array_position(pgmesh_v.v, NULL) IS NULL"
    " ON CONFLICT (table_name, unique_key, pg_catalog.md5(value), pg_catalog.md5(key))"
    " DO UPDATE SET xid = excluded.xid"
)
