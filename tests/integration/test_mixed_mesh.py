"""A mesh of one PostgreSQL 15 node and two 18 nodes under writes on all three (issue 19).

Owns: the mixed-version mesh under load: every node writes its own keys (inserts, updates, key changes,
deletes, multi-table transactions, TOASTed values) and all three update the same hot keys, so conflicts are
decided between versions; afterwards the three hold the same rows and every link streams without error.
And what the router receives: a 15 node's stream carries back every transaction pgmesh applied there (an
echo, decoded and dropped), an 18 node's carries none of them (pgoutput's `origin 'none'`), only one
`pgmesh.applied` message per applied batch.
Must not: test one version's behaviour in depth (test_newer_servers, test_versions), or sleep.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import psycopg
import pytest

from router.testing.mesh import execute, fetch, running_router, wait_converged
from tests.fix_mesh import MeshFactory

SCHEMA = """
CREATE TABLE "accounts" ("id" int PRIMARY KEY, "owner" text NOT NULL, "balance" numeric NOT NULL,
                         "note" text);
CREATE TABLE "orders" ("id" bigint PRIMARY KEY, "account" int, "amount" numeric, "payload" text);
CREATE TABLE "hot" ("id" int PRIMARY KEY, "writer" text NOT NULL, "n" int NOT NULL);
INSERT INTO "hot" SELECT i, 'seed', 0 FROM generate_series(0, 20) i;
"""
TABLES = ["accounts", "orders", "hot"]
pytestmark = pytest.mark.versions
VERSIONS = [15, 18, 18]
ROUNDS = 40


async def writes(node: Any, base: int, seed: int) -> None:
    """Own keys (every kind of change) and, each round, one of the shared hot keys."""
    rng = random.Random(seed)
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        for i in range(ROUNDS):
            key = base + i
            await conn.execute('INSERT INTO "accounts" VALUES (%s, %s, 100, NULL)', [key, f"{node.name}-{i}"])
            async with conn.transaction():
                await conn.execute(
                    'INSERT INTO "orders" VALUES (%s, %s, %s, %s)',
                    [key, key, rng.randint(1, 99), "".join(rng.choices("0123456789abcdef", k=5000))],
                )
                await conn.execute(
                    """UPDATE "accounts" SET "balance" = "balance" - 1, "note" = 'ordered' WHERE "id" = %s""",
                    [key],
                )
            await conn.execute('UPDATE "orders" SET "amount" = "amount" * 2 WHERE "id" = %s', [key])
            if i % 4 == 1:
                await conn.execute('UPDATE "accounts" SET "id" = "id" + 500000 WHERE "id" = %s', [key])
            if i % 5 == 2:
                await conn.execute('DELETE FROM "orders" WHERE "id" = %s', [key])
            hot = rng.randint(1, 20)
            await conn.execute('UPDATE "hot" SET "writer" = %s, "n" = "n" + 1 WHERE "id" = %s',
                               [node.name, hot])


async def test_one_15_and_two_18_nodes_converge_under_writes(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, versions=VERSIONS)
    nodes = m.nodes
    for node in nodes:  # a conflict for certain: all three change key 0 before anything is replicated
        await execute(node.dsn(), f"""UPDATE "hot" SET "writer" = '{node.name}' WHERE "id" = 0""")
    async with running_router(m.config) as router:
        await asyncio.gather(*(writes(node, (i + 1) * 1_000_000, i) for i, node in enumerate(nodes)))
        await wait_converged(nodes, TABLES, limit=120)
        status = router.status()
        links = status.links
        assert all(link.state == "streaming" and link.last_error is None for link in links), links
        stats = {node.name: router.pumps[node.name].stats for node in nodes}
    old, *new = nodes
    # 15: what pgmesh applied there comes back in its stream, and is dropped undecoded
    assert stats[old.name].echoes > 0 and stats[old.name].echo_rows_skipped > 0
    assert stats[old.name].applied_notes == 0
    for node in new:
        # 18: not one applied transaction came back; one note per applied batch in their place
        assert stats[node.name].echoes == 0 and stats[node.name].echo_rows_skipped == 0, node.name
        assert stats[node.name].applied_notes > 0, node.name
    for node in nodes:
        assert await fetch(node.dsn(), 'SELECT count(*) FROM "accounts"') == [(3 * ROUNDS,)], node.name
        # the hot keys were written by more than one node, and each ends with one writer's version
        writers = await fetch(node.dsn(), 'SELECT count(DISTINCT "writer") FROM "hot" WHERE "id" > 0')
        assert writers[0][0] >= 2, node.name
        # key 0's conflict was decided here against each other node's change, and recorded
        decided = await fetch(
            node.dsn(),
            "SELECT source FROM pgmesh.conflict_history WHERE table_name = 'public.hot' AND key = '0'"
            " AND conflict_type = 'update_origin_differs' ORDER BY source",
        )
        assert decided == [(other.name,) for other in nodes if other is not node], node.name
