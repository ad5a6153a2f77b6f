"""`pgmesh part NODE` online (router.ops.part): with the router running and the other nodes written to,
what the parted node committed reaches every other node first (the drain), the part is recorded in the
cluster's own state (the router, `init` and a restart leave the node out with the config unchanged), and
`--clean` leaves a database that keeps working on its own (its snowflake ids from its own sequence)."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from router.cluster.install import init_cluster
from router.errors import PgmeshError
from router.ops.control import offline_status
from router.ops.part import part_node
from router.sequences.convert import convert_sequences
from router.testing.mesh import execute, fetch, free_port, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE items (id bigserial PRIMARY KEY, v text NOT NULL);"


async def _write(node: Any, stop: asyncio.Event, written: list[int]) -> None:
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        while not stop.is_set() and written[0] < 20_000:
            cur = await conn.execute("INSERT INTO items (v) VALUES (%s) RETURNING id", [node.name])
            row = await cur.fetchone()
            assert row is not None
            written[0] += 1
            written.append(int(row[0]))


async def test_part_online_under_writes_loses_nothing(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, admin_port=free_port())
    a, b, c = m.nodes
    await convert_sequences(m.config, "snowflake")
    ids: dict[str, list[int]] = {n.name: [0] for n in m.nodes}
    stops = {n.name: asyncio.Event() for n in m.nodes}
    async with running_router(m.config) as router:
        writers = [asyncio.create_task(_write(n, stops[n.name], ids[n.name])) for n in m.nodes]
        await wait_for(lambda: all(v[0] > 200 for v in ids.values()), "writes on every node", 60)
        stops["c"].set()  # the application leaves c; its last commits may still be on their way
        await writers[2]
        lines = await part_node(m.config, "c")
        assert any("c: drained" in line for line in lines), lines
        for node in (a, b):  # everything c committed is on a and b
            on_node = {r[0] for r in await fetch(node.dsn(), "SELECT id FROM items WHERE v = 'c'")}
            assert on_node == set(ids["c"][1:]), node.name
        # the router runs on without c (released after the part), the config unchanged
        await wait_for(lambda: {(x.source, x.target) for x in router.status().links}
                       == {("a", "b"), ("b", "a")}, "the router rebuilt without c", 60)
        await wait_for(lambda: all(v[0] > ids[k][0] - 1 for k, v in ids.items()), "writes go on", 5)
        for name in ("a", "b"):
            stops[name].set()
        await asyncio.gather(*writers)
        await wait_converged([a, b], ["items"], 120)
    for node in (a, b):
        assert await fetch(node.dsn(), "SELECT node FROM pgmesh.parted") == [("c",)]
        assert await fetch(node.dsn(), "SELECT count(*) FROM pg_replication_origin"
                           " WHERE roname LIKE 'pgmesh%c'") == [(0,)]
    assert await fetch(c.dsn(), "SELECT count(*) FROM pg_replication_slots") == [(0,)]
    count = len(ids["a"]) + len(ids["b"]) + len(ids["c"]) - 3
    assert await fetch(a.dsn(), "SELECT count(*) FROM items") == [(count,)]
    # the offline status (as compare, repair, ddl and sequences) leaves c out too
    offline = await offline_status(m.config)
    assert {(x.source, x.target) for x in offline.links} == {("a", "b"), ("b", "a")}
    assert {s.node for s in offline.sources} == {"a", "b"}
    # a restart and init with the same config leave c out
    _, lines = await init_cluster(m.config)
    assert "node c: parted, left out (`pgmesh join c` brings it back)" in lines
    async with running_router(m.config) as router:
        assert set(router.appliers) == {("a", "b"), ("b", "a")}
    # --clean: pgmesh goes from c, which keeps working on its own, ids from its own sequence
    await execute(c.dsn(), "INSERT INTO items (v) VALUES ('before clean')")
    lines = await part_node(m.config, "c", clean=True)
    assert any("snowflake -> its own sequence" in line for line in lines), lines
    highest = (await fetch(c.dsn(), "SELECT max(id) FROM items"))[0][0]
    await execute(c.dsn(), "INSERT INTO items (v) VALUES ('standalone')")
    assert await fetch(c.dsn(), "SELECT id FROM items WHERE v = 'standalone'") == [(highest + 1,)]
    assert await fetch(c.dsn(), "SELECT count(*) FROM pg_namespace WHERE nspname = 'pgmesh'") == [(0,)]


async def test_part_without_the_router_refuses_what_did_not_reach_the_others(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, admin_port=free_port())
    c = m.nodes[2]
    await execute(c.dsn(), "INSERT INTO items (v) VALUES ('only on c so far')")
    with pytest.raises(PgmeshError) as refused:
        await part_node(m.config, "c")
    assert "node c" in str(refused.value) and "have not reached every other node" in str(refused.value)
    assert await fetch(c.dsn(), "SELECT count(*) FROM pg_replication_slots") == [(1,)]  # nothing changed
    async with running_router(m.config):  # with the router it drains them first
        await part_node(m.config, "c")
    for node in m.nodes[:2]:
        assert await fetch(node.dsn(), "SELECT v FROM items") == [("only on c so far",)]
