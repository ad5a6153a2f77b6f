"""The router under adversity: a node crashing, locks and deadlocks on a target (SIGKILL mid-stream, with a
batch in the target's hands: tests/integration/test_fail_points.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from router.testing.mesh import (
    execute,
    fetch,
    running_router,
    wait_converged,
    wait_for,
)
from tests.fix_mesh import MeshFactory

SCHEMA = """
CREATE TABLE kv (id bigint PRIMARY KEY, v int NOT NULL, note text);
CREATE TABLE log (src text, seq int, payload text);
ALTER TABLE log REPLICA IDENTITY FULL;
"""
TABLES = ["kv", "log"]


async def writes(node: Any, base: int, count: int) -> None:
    """`count` source transactions, one per statement pair, into both tables."""
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        for i in range(count):
            if i % 2:
                await conn.execute("INSERT INTO log VALUES (%s, %s, 'x')", [node.name, i])
            else:
                await conn.execute("INSERT INTO kv VALUES (%s, %s, NULL)", [base + i, i])


async def test_node_crash_others_keep_replicating_then_catch_up(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, replication="queue_max_transactions = 200")
    nodes, config = m.nodes, m.config
    a, b, c = nodes
    async with running_router(config) as router:
        await asyncio.gather(writes(a, 1_000_000, 100), writes(b, 2_000_000, 100), writes(c, 3_000_000, 100))
        await wait_converged(nodes, TABLES)
        await asyncio.to_thread(c.stop, "immediate")
        await asyncio.gather(writes(a, 1_100_000, 600), writes(b, 2_100_000, 600))
        await wait_converged([a, b], TABLES)  # a and b keep replicating to each other
        states = {(lk.source, lk.target): lk.state for lk in router.status().links}
        assert states[("a", "b")] in ("streaming", "catching up") and states[("a", "c")] != "streaming"
        await asyncio.to_thread(c.start)
        await wait_converged(nodes, TABLES, 180)
        await wait_for(
            lambda: all(lk.state == "streaming" for lk in router.status().links), "every link streaming again"
        )
    (count,) = await fetch(c.dsn(), "SELECT count(*) FROM log")
    assert count[0] == 150 + 600


async def test_locks_and_deadlocks_on_target_are_retried(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    nodes, config = m.nodes, m.config
    a, b = nodes
    await execute(a.dsn(), "INSERT INTO kv VALUES (1, 0, NULL), (2, 0, NULL)")
    async with running_router(config) as router:
        await wait_converged(nodes, TABLES)
        holder = await psycopg.AsyncConnection.connect(b.dsn())
        try:
            await holder.execute("UPDATE kv SET note = 'held' WHERE id = 2")  # row 2 locked on b
            conn = await psycopg.AsyncConnection.connect(a.dsn(), autocommit=True)
            async with conn, conn.transaction():  # the applier will lock row 1, then wait for row 2
                await conn.execute("UPDATE kv SET v = v + 1 WHERE id = 1")
                await conn.execute("UPDATE kv SET v = v + 1 WHERE id = 2")

            async def applier_waits() -> bool:
                rows = await fetch(b.dsn(), "SELECT count(*) FROM pg_locks WHERE NOT granted")
                return int(rows[0][0]) > 0

            await wait_for(applier_waits, "the applier to wait for the held row lock")
            retries_before = router.appliers[("a", "b")].stats.retries
            victim = "applier"
            await holder.execute("UPDATE kv SET note = 'deadlock' WHERE id = 1")  # closes the cycle
        except psycopg.errors.DeadlockDetected:
            victim = "holder"  # the holder may be chosen instead; either way the applier must get through
        finally:
            await holder.rollback()
            await holder.close()
        await wait_converged(nodes, TABLES)
        if victim == "applier":
            assert router.appliers[("a", "b")].stats.retries > retries_before
    rows = await fetch(b.dsn(), "SELECT id, v, note FROM kv ORDER BY id")
    assert rows == [(1, 1, None), (2, 1, None)]


async def test_router_starts_while_a_node_is_down(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA)
    nodes, config = m.nodes, m.config
    a, b, c = nodes
    await writes(c, 3_000_000, 20)  # written before the router ever ran
    await asyncio.to_thread(c.stop, "immediate")
    async with running_router(config) as router:
        await asyncio.gather(writes(a, 1_000_000, 50), writes(b, 2_000_000, 50))
        await wait_converged([a, b], TABLES)  # a and b do not wait for c
        # nothing confirmed past what c may need, unless the router's log holds it durably (everything after
        # c's last known position: router.service.logs)
        progress, log = router.progress["a"], router.logs.logs["a"]
        to_c = next(link for link in progress.links if link.target == "c")
        assert log.covers(to_c.flushed, "c")
        assert progress.confirmable() <= max(to_c.flushed, log.durable)
        await asyncio.to_thread(c.start)
        await wait_converged(nodes, TABLES, 120)
    (count,) = await fetch(a.dsn(), "SELECT count(*) FROM log")
    assert count[0] == 25 + 25 + 10
