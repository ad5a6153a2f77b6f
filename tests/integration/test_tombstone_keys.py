"""A key of bounded types is held in pgmesh.tombstones as it is: the guarded insert's short form
(`tombstone_key(..., bounded=True)`) names the same key as the size-tested one the trigger and the careful
path use, at the widest text each type has; and a single-column key lock is the same lock as the array's.

Owns: `bounded_key`'s promise, checked on a real server. Must not: replicate anything.
"""

from __future__ import annotations

from typing import Any

import psycopg

from router.apply.statements import (
    BOUNDED_KEY_COLUMNS,
    TargetTable,
    bounded_key,
    key_lock,
    tombstone_key,
)

# each bounded type at (about) its longest text
WIDEST = {
    "smallint": "-32768",
    "integer": "-2147483648",
    "bigint": "-9223372036854775808",
    "oid": "4294967295",
    "boolean": "false",
    "real": "-1.17549435e-38",
    "double precision": "-2.2250738585072014e-308",
    "uuid": "ffffffff-ffff-ffff-ffff-ffffffffffff",
    "date": "5874897-12-31",
    "time without time zone": "23:59:59.999999",
    "timestamp without time zone": "294276-12-31 23:59:59.999999",
    "timestamp with time zone": "4713-01-01 00:00:00.999999+00 BC",
}


def test_bounded_types_only() -> None:
    assert bounded_key(["bigint", "uuid", "timestamp with time zone"])
    assert not bounded_key(["bigint", "text"])
    assert not bounded_key(["numeric"])
    assert not bounded_key(["character varying"])
    assert not bounded_key(["integer"] * (BOUNDED_KEY_COLUMNS + 1))
    assert set(WIDEST) == {t for t in WIDEST if bounded_key([t])}


def test_the_short_form_names_the_same_key_at_the_widest_values(pg_nodes: Any) -> None:
    (node,) = pg_nodes(1)
    types = list(WIDEST) + ["bigint"] * (BOUNDED_KEY_COLUMNS - len(WIDEST))
    assert bounded_key(types)
    values = [WIDEST[t] for t in types]
    array = "ARRAY[" + ", ".join(f"%s::{t}::text" for t in types) + "]::text[]"
    table = TargetTable("public", "t", frozenset(("k",)), {"k": "bigint"}, pk=("k",))
    with psycopg.connect(node.dsn(), autocommit=True) as conn:
        conn.execute("SET extra_float_digits = 3; SET datestyle = ISO")
        key = "s.k"  # the array, built once
        row = conn.execute(
            f"SELECT {tombstone_key(key)} = {tombstone_key(key, bounded=True)},"
            f" ({tombstone_key(key)})[1] NOT LIKE 'pgmesh:md5:%%' FROM (SELECT {array} AS k) AS s",
            values,
        ).fetchone()
        assert row == (True, True)
        # the lock's hash, from the array and from the single column's text
        prefix = "pg_catalog.pg_advisory_xact_lock("
        by_array = key_lock(table, "ARRAY[%s::bigint::text]::text[]")
        by_text = key_lock(table, "ARRAY[%s::bigint::text]::text[]", "%s::bigint::text")
        assert by_array.startswith(prefix) and by_text.startswith(prefix) and by_array != by_text
        hashes = conn.execute(
            f"SELECT {by_array[len(prefix):-1]}, {by_text[len(prefix):-1]}", ["-42", "-42"]
        ).fetchone()
        assert hashes is not None and hashes[0] == hashes[1]
