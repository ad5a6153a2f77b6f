"""A node that only receives (router.cluster.receive): one-way links into it from every node that sends,
none out of it; its local writes to replicated tables are refused (nothing would carry them), its other
tables stay writable; a table made later by replicated DDL gets the same guard; `pgmesh push` into it
writes as the appliers do; `init` without the flag makes it send again."""

from __future__ import annotations

import asyncio

import msgspec
import psycopg
import pytest

from router.cluster.copy.push import push
from router.cluster.install import init_cluster
from router.config.model import Config
from router.ops.control import offline_status, render_status
from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE items (id int PRIMARY KEY, v text);"


def receiving(config: Config, name: str, on: bool = True) -> Config:
    nodes = [msgspec.structs.replace(n, receive_only=on) if n.name == name else n for n in config.nodes]
    return msgspec.structs.replace(config, nodes=nodes)


async def test_a_receive_only_node_gets_everything_and_sends_nothing(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA + "CREATE TABLE local_notes (n int);", init=False,
                   replication='exclude = ["public.local_notes"]')
    a, b, c = m.nodes
    config = receiving(m.config, "c")
    _, lines = await init_cluster(config)
    assert any(line.startswith("node c: receives only") for line in lines), lines
    async with running_router(config) as router:
        assert set(router.appliers) == {("a", "b"), ("b", "a"), ("a", "c"), ("b", "c")}
        assert router.status().receive_only == ["c"]
        assert "topology: c only receive(s)" in render_status(router.status())
        await execute(a.dsn(), "INSERT INTO items VALUES (1, 'from a')")
        await execute(b.dsn(), "INSERT INTO items VALUES (2, 'from b')")
        await wait_converged(m.nodes, ["items"], 60)
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction) as refused:
            await execute(c.dsn(), "UPDATE items SET v = 'on c' WHERE id = 1")
        assert "only receives" in str(refused.value) and "UPDATE on public.items" in str(refused.value)
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            await execute(c.dsn(), "TRUNCATE items")
        await execute(c.dsn(), "INSERT INTO local_notes VALUES (1)")  # not replicated: writable
        # a table created by replicated DDL is guarded on c as well
        await execute(a.dsn(), "CREATE TABLE later (id int PRIMARY KEY)")
        await execute(a.dsn(), "INSERT INTO later VALUES (1)")
        for node in (b, c):
            await wait_for(lambda node=node: _has_table(node, "later"), f"the new table on {node.name}", 60)
        await wait_converged(m.nodes, ["items", "later"], 60)
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            await execute(c.dsn(), "DELETE FROM later")
        # push into it: written as the appliers write
        await execute(a.dsn(), "CREATE TABLE pushed (id int PRIMARY KEY, v text)")
        await wait_for(lambda: _has_table(c, "pushed"), "the new table on c", 60)
        async with await psycopg.AsyncConnection.connect(a.dsn(), autocommit=True) as conn:
            await conn.execute("SELECT pg_replication_origin_create('test_local')")
            await conn.execute("SELECT pg_replication_origin_session_setup('test_local')")
            await conn.execute("INSERT INTO pushed VALUES (1, 'only on a')")  # not replicated
        done = await asyncio.to_thread(push, config, "pushed", "a", "c")
        assert done.rows == 1 and await fetch(c.dsn(), "SELECT v FROM pushed") == [("only on a",)]
        assert await fetch(b.dsn(), "SELECT count(*) FROM pushed") == [(0,)]
    offline = await offline_status(config)  # the router stopped: the same links, no c -> x
    assert {(x.source, x.target) for x in offline.links} == {("a", "b"), ("b", "a"), ("a", "c"), ("b", "c")}
    # without the flag, init takes the guard away: c sends again
    _, lines = await init_cluster(m.config)
    assert any("node c: sends again" in line for line in lines), lines
    async with running_router(m.config):
        await execute(c.dsn(), "UPDATE items SET v = 'on c' WHERE id = 1")
        await wait_for(lambda: _v(a, 1, "on c"), "c's update on a", 60)


async def _has_table(node: object, name: str) -> bool:
    rows = await fetch(node.dsn(), "SELECT to_regclass(%s) IS NOT NULL", [name])  # type: ignore[attr-defined]
    return bool(rows[0][0])


async def _v(node: object, key: int, value: str) -> bool:
    rows = await fetch(node.dsn(), "SELECT v FROM items WHERE id = %s", [key])  # type: ignore[attr-defined]
    return rows == [(value,)]
