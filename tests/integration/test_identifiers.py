"""User columns named like pgmesh's own SQL: conflicting writes on two nodes still converge (issue 17).

The tables' columns carry every alias, output label, lateral function column and helper name pgmesh's
generated SQL uses or used (the careful path's `t`, `c`, `(c).timestamp`, `(c).roident`, `ts`, `origin`,
`ours`, `row`, the guarded insert's `v`, `c0`..., the tombstones' `key`, `table_name`, `xid`, ...), so a
reference that is not qualified by pgmesh's own alias resolves to the user's column and breaks.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import psycopg

from router.testing.mesh import execute, fetch, running_router, wait_converged
from tests.fix_mesh import MeshFactory

# Every name pgmesh's SQL uses for its own things, as user columns (quoted: some are keywords).
NAMES = [
    "t", "v", "r", "x", "k", "old", "new", "ts", "origin", "ours", "row", "timestamp", "roident",
    "xid", "key", "table_name", "to_jsonb", "count", "pgmesh_w", "c0", "c1", "excluded", "got",
    "wanted", "expected", "row_xmin", "a", "col", "ord", "qualified", "root", "deleted_key", "s",
]
_COLUMNS = ", ".join(f'"{n}" int' for n in NAMES)
SCHEMA = f"""
CREATE TABLE t (c int PRIMARY KEY, {_COLUMNS}, email text UNIQUE);
CREATE TABLE "c" ("timestamp" int PRIMARY KEY, "roident" int NOT NULL, "t" text, "c" int, "v" int);
ALTER TABLE "c" REPLICA IDENTITY FULL;
"""
TABLES = ["t", "c"]
KEYS = 60


async def chaos(node: Any, seed: int, ops: int) -> None:
    """Updates, deletes and inserts of the same keys on every node, and a shared unique email."""
    rng = random.Random(seed)
    sets = ", ".join(f'"{n}" = %(n)s' for n in NAMES)
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        for i in range(ops):
            key = rng.randrange(1, KEYS + 10)
            n = rng.randrange(1000)
            choice = rng.random()
            if choice < 0.35:
                await conn.execute(f"UPDATE t SET {sets} WHERE c = %(key)s", {"n": n, "key": key})
            elif choice < 0.45:
                await conn.execute("DELETE FROM t WHERE c = %s", [key])
            elif choice < 0.6:
                await conn.execute(
                    "INSERT INTO t (c, t, v) VALUES (%s, %s, %s)"
                    " ON CONFLICT (c) DO UPDATE SET v = excluded.v",
                    [key, n, i],
                )
            elif choice < 0.7:
                await conn.execute(
                    "INSERT INTO t (c, v, email) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                    [1000 + seed * 100 + i % 100, i, f"user{rng.randrange(10)}@example.com"],
                )
            elif choice < 0.85:
                await conn.execute(
                    'UPDATE "c" SET "roident" = %s, "t" = %s, "c" = %s WHERE "timestamp" = %s',
                    [n, node.name, i, key],
                )
            elif choice < 0.92:
                await conn.execute('DELETE FROM "c" WHERE "timestamp" = %s', [key])
            else:
                await conn.execute(
                    'INSERT INTO "c" VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING',
                    [key, n, node.name, i, seed],
                )


async def test_columns_named_like_pgmesh_sql_converge(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    nodes, config = m.nodes, m.config
    a = nodes[0]
    await execute(
        a.dsn(),
        f"INSERT INTO t (c, {', '.join(f'{chr(34)}{n}{chr(34)}' for n in NAMES)})"
        f" SELECT i, {', '.join('i' for _ in NAMES)} FROM generate_series(1, {KEYS}) i",
        f"""INSERT INTO "c" SELECT i, i, 'seed', i, i FROM generate_series(1, {KEYS}) i""",
    )
    async with running_router(config) as router:
        await wait_converged(nodes, TABLES)
        for round_ in range(2):
            await router.pause(None)  # hold every link: the writes below are truly concurrent
            await asyncio.gather(*(chaos(n, round_ * 10 + i, 200) for i, n in enumerate(nodes)))
            await router.resume(None)
        await wait_converged(nodes, TABLES, 180)
        assert all(applier.last_error is None for applier in router.appliers.values()), [
            applier.last_error for applier in router.appliers.values()
        ]
        decided = router.conflicts_decided()
    recorded = 0
    types: set[str] = set()
    for node in nodes:
        for conflict_type, local_row in await fetch(
            node.dsn(), "SELECT conflict_type, local_row::text FROM pgmesh.conflict_history"
        ):
            recorded += 1
            types.add(conflict_type)
            # the local row as read by the careful path: the whole row, not a user column named `t`
            assert local_row is None or isinstance(json.loads(local_row), dict), local_row
    assert recorded == decided > 10
    assert {"update_origin_differs", "insert_exists"} <= types, types


async def test_delta_columns_in_a_table_named_like_pgmesh_aliases(mesh: MeshFactory) -> None:
    """Even pgmesh's own alias names as table and column names: the careful path's delta merge (which
    reads the local value through the table's alias) adds both sites' changes up."""
    schema = (
        'CREATE TABLE "pgmesh_t" ("c" int PRIMARY KEY, "t" int NOT NULL, "pgmesh_t" int, "pgmesh_c" int,'
        ' "timestamp" int, "roident" int); ALTER TABLE "pgmesh_t" REPLICA IDENTITY FULL;'
    )
    extra = '[[tables]]\nname = "public.pgmesh_t"\ndelta_columns = ["t"]\n'
    m = await mesh(nodes=2, schema=schema, extra=extra)
    nodes, config = m.nodes, m.config
    a, b = nodes
    await execute(a.dsn(), 'INSERT INTO "pgmesh_t" VALUES (1, 10, 1, 1, 1, 1)')
    async with running_router(config) as router:
        await wait_converged(nodes, ["pgmesh_t"])
        await router.pause(None)
        await execute(a.dsn(), 'UPDATE "pgmesh_t" SET "t" = "t" - 3, "pgmesh_t" = 2 WHERE "c" = 1')
        await execute(b.dsn(), 'UPDATE "pgmesh_t" SET "t" = "t" - 2, "roident" = 3 WHERE "c" = 1')
        await router.resume(None)
        await wait_converged(nodes, ["pgmesh_t"])
        assert all(applier.last_error is None for applier in router.appliers.values())
    for node in nodes:
        assert await fetch(node.dsn(), 'SELECT "t" FROM "pgmesh_t" WHERE "c" = 1') == [(5,)]
