"""Conflicting writes on three real nodes with the router running: every node ends with the same rows."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import psycopg
import pytest

from router.testing.mesh import execute, fetch, running_router, wait_converged
from tests.fix_mesh import MeshFactory

SCHEMA = """
CREATE TABLE kv (id int PRIMARY KEY, v int NOT NULL, who text NOT NULL, email text UNIQUE);
CREATE TABLE inventory (id int PRIMARY KEY, name text NOT NULL, qty int NOT NULL);
ALTER TABLE inventory REPLICA IDENTITY FULL;
"""
TABLES = ["kv", "inventory"]
KEYS = 200


async def chaos(node: Any, seed: int, ops: int) -> None:
    """Updates, deletes and inserts on keys every node touches, and inserts on a shared unique email."""
    rng = random.Random(seed)
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        for i in range(ops):
            key = rng.randrange(1, KEYS + 50)
            choice = rng.random()
            if choice < 0.55:
                await conn.execute(
                    "UPDATE kv SET v = %s, who = %s WHERE id = %s", [rng.randrange(1000), node.name, key]
                )
            elif choice < 0.7:
                await conn.execute("DELETE FROM kv WHERE id = %s", [key])
            elif choice < 0.9:
                await conn.execute(
                    "INSERT INTO kv VALUES (%s, %s, %s, NULL) ON CONFLICT (id) DO UPDATE SET v = excluded.v",
                    [key, i, node.name],
                )
            else:  # the same email from different ids on different nodes: a secondary-key conflict
                email = f"user{rng.randrange(20)}@example.com"
                await conn.execute(
                    "INSERT INTO kv VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
                    [1000 + seed * 100 + i % 100, i, node.name, email],
                )


async def dump_differences(nodes: list[Any], router: Any) -> None:
    """On a failure: the rows that differ, with their versions and conflict history, and the links."""
    query = (
        "SELECT id, v, who, email, (pg_xact_commit_timestamp_origin(xmin)).timestamp,"
        " (pg_xact_commit_timestamp_origin(xmin)).roident FROM kv ORDER BY id"
    )
    rows = [{r[0]: r for r in await fetch(n.dsn(), query)} for n in nodes]
    for key in sorted(set().union(*rows)):
        versions = [r.get(key) for r in rows]
        if len({v[1:4] if v else None for v in versions}) > 1:
            print(f"key {key}: " + " | ".join(f"{n.name}={v}" for n, v in zip(nodes, versions, strict=True)))
            for n in nodes:
                for h in await fetch(
                    n.dsn(), "SELECT * FROM pgmesh.conflict_history WHERE key = %s", [str(key)]
                ):
                    print(f"    {n.name}: {h}")
    for link in router.status().links:
        print(link)


@pytest.mark.slow
@pytest.mark.parametrize("resolver", ["last_update_wins", "node_priority"])
async def test_conflicting_writes_on_three_nodes_converge(mesh: MeshFactory, resolver: str) -> None:
    extra = f'[conflicts]\nresolver = "{resolver}"\nnode_priority = ["b", "a", "c"]\n'
    m = await mesh(nodes=3, schema=SCHEMA, extra=extra)
    nodes, config = m.nodes, m.config
    a = nodes[0]
    await execute(a.dsn(), f"INSERT INTO kv SELECT i, 0, 'seed', NULL FROM generate_series(1, {KEYS}) i")
    async with running_router(config) as router:
        await wait_converged(nodes, TABLES)
        for round_ in range(3):
            await router.pause(None)  # hold every link: the writes below are truly concurrent
            await asyncio.gather(*(chaos(n, round_ * 10 + i, 300) for i, n in enumerate(nodes)))
            await router.resume(None)
        try:
            await wait_converged(nodes, TABLES, 180)
        except AssertionError:
            await dump_differences(nodes, router)
            raise
        assert all(applier.last_error is None for applier in router.appliers.values())
        decided = router.conflicts_decided()  # the links', and the recorders' late ones
    recorded = 0
    types = set()
    for node in nodes:
        rows = await fetch(
            node.dsn(), "SELECT conflict_type, count(*) FROM pgmesh.conflict_history GROUP BY 1"
        )
        recorded += sum(int(r[1]) for r in rows)
        types |= {r[0] for r in rows}
    assert recorded == decided > 50
    assert {"update_origin_differs", "delete_missing", "insert_exists"} <= types, types
    (emails,) = await fetch(
        a.dsn(), "SELECT count(*) = count(DISTINCT email) FROM kv WHERE email IS NOT NULL"
    )
    assert emails == (True,)


async def test_inventory_delta_columns_add_up(mesh: MeshFactory) -> None:
    extra = '[[tables]]\nname = "public.inventory"\ndelta_columns = ["qty"]\n'
    m = await mesh(nodes=2, schema=SCHEMA, extra=extra)
    nodes, config = m.nodes, m.config
    a, b = nodes
    await execute(a.dsn(), "INSERT INTO inventory VALUES (1, 'widget', 10)")
    async with running_router(config) as router:
        await wait_converged(nodes, TABLES)
        await router.pause(None)
        await execute(a.dsn(), "UPDATE inventory SET qty = qty - 3 WHERE id = 1")  # site a sells 3
        await execute(b.dsn(), "UPDATE inventory SET qty = qty - 2 WHERE id = 1")  # site b sells 2
        await router.resume(None)
        await wait_converged(nodes, TABLES)
    for node in nodes:
        assert await fetch(node.dsn(), "SELECT qty FROM inventory WHERE id = 1") == [(5,)]
