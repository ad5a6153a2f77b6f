"""Meshes of 5, 8 and 19 nodes (19: the size BDR is tested at) converge under writes on every node.

Each node runs with a small `shared_buffers`, so that 19 servers fit beside the router. Every node writes
its own keys (inserts, updates, key changes, deletes, a multi-table transaction) and, at the same time,
updates a few keys every node updates (conflicts, decided the same way everywhere). One router holds
N*(N-1) links. The `mesh` fixture then checks each link's applied mark against its origin (16+).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import psycopg
import pytest

from router.testing.mesh import NODE_SETTINGS, execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = """
CREATE TABLE accounts (id bigint PRIMARY KEY, owner text NOT NULL, balance int NOT NULL, note text);
CREATE TABLE hot (id int PRIMARY KEY, v text NOT NULL, n int NOT NULL);
CREATE TABLE events (node text, seq int);
ALTER TABLE events REPLICA IDENTITY FULL;
"""
TABLES = ["accounts", "hot", "events"]
HOT_KEYS = 5
SMALL = {**NODE_SETTINGS, "shared_buffers": "16MB", "max_connections": "100", "max_wal_size": "256MB"}


async def writes(node: Any, base: int, rounds: int, seed: int) -> None:
    rng = random.Random(seed)
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        for i in range(rounds):
            key = base + i
            await conn.execute("INSERT INTO accounts VALUES (%s, %s, 100, NULL)", [key, node.name])
            async with conn.transaction():
                await conn.execute("UPDATE accounts SET balance = balance - 1 WHERE id = %s", [key])
                await conn.execute("INSERT INTO events VALUES (%s, %s)", [node.name, i])
            hot = rng.randrange(HOT_KEYS)
            await conn.execute("UPDATE hot SET v = %s, n = n + 1 WHERE id = %s", [f"{node.name}-{i}", hot])
            if i % 4 == 1:
                await conn.execute("UPDATE accounts SET id = id + 500000 WHERE id = %s", [key])
            if i % 5 == 2:
                await conn.execute("DELETE FROM events WHERE node = %s AND seq = %s", [node.name, i])


async def converge_under_writes(mesh: MeshFactory, nodes: int, rounds: int) -> None:
    m = await mesh(nodes=nodes, schema=SCHEMA, settings=SMALL)
    hot = f"INSERT INTO hot SELECT i, 'start', 0 FROM generate_series(0, {HOT_KEYS - 1}) i"
    await execute(m.nodes[0].dsn(), hot)
    async with running_router(m.config) as router:
        await wait_converged(m.nodes, TABLES, 120)
        await asyncio.gather(*(writes(n, (i + 1) * 1_000_000, rounds, i) for i, n in enumerate(m.nodes)))
        await wait_converged(m.nodes, TABLES, 600)
        await wait_for(
            lambda: all(lk.state == "streaming" and lk.last_error is None for lk in router.status().links),
            "every link streaming without an error",
        )
        assert len(router.status().links) == nodes * (nodes - 1)
    for node in m.nodes:
        ((count,),) = await fetch(node.dsn(), "SELECT count(*) FROM accounts")
        assert count == nodes * rounds


@pytest.mark.parametrize("nodes", [5, 8])
async def test_five_and_eight_nodes_converge_under_writes(mesh: MeshFactory, nodes: int) -> None:
    await converge_under_writes(mesh, nodes, 60)


@pytest.mark.timeout(900)  # 19 servers and 342 links on two cores: about 20 s here
async def test_nineteen_nodes_converge_under_light_writes(mesh: MeshFactory) -> None:
    await converge_under_writes(mesh, 19, 10)
