"""Node join and part over real nodes (router.ops.join, issue 6): writes never stop."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import psycopg
import pytest

from router.errors import PgmeshError
from router.ops.join import join_node
from router.ops.part import part_node
from router.testing.mesh import (
    execute,
    fetch,
    free_port,
    make_config,
    running_router,
    wait_converged,
    wait_for,
)
from tests.fix_mesh import MeshFactory

pytestmark = pytest.mark.slow  # each join copies with Spark (a JVM); the first one takes about 45 s

BIG_ROWS = 1_000_000
SCHEMA = """
CREATE TABLE big (id bigint PRIMARY KEY, a int NOT NULL, b text, c numeric, d timestamptz);
CREATE TABLE acct (id int PRIMARY KEY, v int NOT NULL, who text);
"""
SEED = (
    f"INSERT INTO big SELECT g, g % 1000, md5(g::text) || repeat('x', 20), g / 7.0,"
    f" '2026-01-01'::timestamptz + g * interval '1 second' FROM generate_series(1, {BIG_ROWS}) g"
)
TABLES = ["big", "acct"]


async def writer(node: Any, base: int, stop: asyncio.Event, seed: int) -> int:
    """Inserts, updates and deletes on keys only this node touches, until `stop`."""
    rng = random.Random(seed)
    written = 0
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        while not stop.is_set():
            key = base + written
            await conn.execute("INSERT INTO acct (id, v, who) VALUES (%s, 0, %s)", [key, node.name])
            if written % 4 == 1:
                await conn.execute("UPDATE acct SET v = v + 1 WHERE id = %s", [base + rng.randrange(written)])
            if written % 10 == 3:
                row = base // 1_000_000 * 1000 + written % 1000 + 1  # big rows only this node updates
                await conn.execute("UPDATE big SET a = a + 1 WHERE id = %s", [row])
            if written % 25 == 7:
                await conn.execute("DELETE FROM acct WHERE id = %s", [base + written - 5])
            written += 1
            await asyncio.sleep(0.002)
    return written


async def test_join_a_fourth_node_under_writes_then_part_it(mesh: MeshFactory) -> None:
    # the same starting rows everywhere (before pgmesh: no conflicts); the join finds the running
    # router through its admin listener
    m = await mesh(nodes=3, schema=SCHEMA + SEED, spares=["d"], admin_port=free_port())
    nodes = m.all_nodes
    a, b, c, d = nodes
    three = m.config
    four = m.config_for(nodes)  # config.toml after d was added to it
    stop = asyncio.Event()
    writers = [asyncio.create_task(writer(n, (i + 1) * 1_000_000, stop, i)) for i, n in enumerate(nodes[:3])]
    try:
        async with running_router(three, reload=lambda: four) as router:
            await wait_for(lambda: all(p.stats.transactions > 50 for p in router.pumps.values()),
                           "writes flowing")
            # d joins while the router runs: it holds (replication waits, writes go on everywhere) and
            # b changes a table mid-join
            join = asyncio.create_task(join_node(four, "d", donor="a"))
            await wait_for(lambda: not router.running or join.done(), "the router to hold")
            await execute(b.dsn(), "ALTER TABLE acct ADD COLUMN note text DEFAULT 'n'")
            report = await join
            assert report.rows >= BIG_ROWS and report.positions.keys() == {"a", "b", "c"}
            # released: the router re-read the config and streams to and from d
            await wait_for(lambda: router.running and ("d", "a") in router.appliers, "the router with d")
            writers.append(asyncio.create_task(writer(d, 4_000_000, stop, 3)))
            await wait_for(lambda: router.appliers[("d", "a")].stats.applied_transactions > 20, "d's writes")
            stop.set()
            written = await asyncio.gather(*writers)
            await wait_converged(nodes, TABLES, 240)
            assert all(applier.last_error is None for applier in router.appliers.values())
            links = {(link.source, link.target): link.state for link in router.status().links}
            assert len(links) == 12 and set(links.values()) == {"streaming"}, links
    finally:
        stop.set()
        await asyncio.gather(*writers, return_exceptions=True)
    for node in nodes:
        assert await fetch(node.dsn(), "SELECT count(*) FROM big") == [(BIG_ROWS,)]
        counts = await fetch(node.dsn(), "SELECT count(*), count(DISTINCT id), count(note) FROM acct")
        assert counts[0][0] == counts[0][1] == counts[0][2] > sum(written) * 0.9, counts

    # part d: the others forget it, d keeps its rows and works on its own
    lines = await part_node(four, "d")
    assert any("dropped replication origin pgmesh_t_d" in line for line in lines), lines
    for node in nodes[:3]:
        origins = "SELECT count(*) FROM pg_replication_origin WHERE roname = 'pgmesh_t_d'"
        assert await fetch(node.dsn(), origins) == [(0,)]
    assert await fetch(d.dsn(), "SELECT count(*) FROM pg_replication_slots") == [(0,)]
    await execute(d.dsn(), "INSERT INTO acct (id, v) VALUES (-1, 1)")
    stop = asyncio.Event()
    writers = [asyncio.create_task(writer(n, (i + 5) * 1_000_000, stop, i)) for i, n in enumerate(nodes[:3])]
    async with running_router(three) as router:
        pumps = router.pumps.values()
        await wait_for(lambda: all(p.stats.transactions > 20 for p in pumps), "writes among a, b, c")
        stop.set()
        await asyncio.gather(*writers)
        await wait_converged(nodes[:3], TABLES, 120)
    assert await fetch(a.dsn(), "SELECT count(*) FROM acct WHERE id = -1") == [(0,)]
    assert (await part_node(four, "d", clean=True))  # and pgmesh's objects go from d
    assert await fetch(d.dsn(), "SELECT count(*) FROM pg_namespace WHERE nspname = 'pgmesh'") == [(0,)]
    assert c is nodes[2]


async def test_a_join_stopped_midway_is_retried_and_refusals_are_clear(mesh: MeshFactory) -> None:
    schema = "CREATE TABLE t (id int PRIMARY KEY, v text); CREATE TABLE u (k text PRIMARY KEY, n bigserial);"
    m = await mesh(nodes=2, schema=schema, spares=["c"])
    nodes = m.all_nodes
    a, b, c = nodes
    config = m.config_for(nodes)
    async with running_router(make_config(nodes[:2])):
        await execute(a.dsn(), "INSERT INTO t SELECT g, 'a' FROM generate_series(1, 5000) g")
        await execute(b.dsn(), "INSERT INTO u (k) SELECT 'k' || g FROM generate_series(1, 300) g")
        await wait_converged(nodes[:2], ["t", "u"])
        with pytest.raises(PgmeshError, match="the router is streaming from"):
            await join_node(config, "c")

    with pytest.raises(PgmeshError, match="stopped"):  # as if the job had been killed after the schema
        await join_node(config, "c", donor="b", fail_copy=True)
    assert await fetch(c.dsn(), "SELECT count(*) FROM pgmesh_join.state") == [(1,)]
    report = await join_node(config, "c", donor="b")  # the retry cleans up by itself
    assert report.rows == 5300
    assert await fetch(c.dsn(), "SELECT count(*) FROM pg_namespace WHERE nspname = 'pgmesh_join'") == [(0,)]
    sequence = "SELECT last_value >= 300 FROM pg_sequences WHERE sequencename = 'u_n_seq'"
    assert await fetch(c.dsn(), sequence) == [(True,)]
    async with running_router(config):
        await execute(c.dsn(), "INSERT INTO t VALUES (0, 'from c')")
        await wait_converged(nodes, ["t", "u"])

    with pytest.raises(PgmeshError, match="holds user tables"):  # a joined (non-empty) node
        await join_node(config, "c")
    await execute(b.dsn(), "SELECT 1")


async def test_a_join_killed_with_sigkill_mid_copy_is_retried(mesh: MeshFactory, tmp_path: Any) -> None:
    import os
    import signal
    import subprocess
    import sys

    m = await mesh(nodes=2, schema="CREATE TABLE t (id int PRIMARY KEY, v text);", spares=["c"])
    nodes = m.all_nodes
    a, _, c = nodes
    await execute(a.dsn(), "INSERT INTO t SELECT g, repeat('v', 200) FROM generate_series(1, 400000) g")
    sync = '\n[sync]\nspark_master = "local[2]"\npartitions_per_table = 4\n'
    path = m.write_config(tmp_path / "config.toml", nodes, extra=sync)
    process = subprocess.Popen(  # noqa: ASYNC220 (started once; the loop goes on while it runs)
        [sys.executable, "-m", "router", "join", "c", "--config", str(path)],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        copying = "SELECT count(*) > 0 FROM pg_stat_activity WHERE query ILIKE 'COPY %FROM STDIN%'"
        await wait_for(lambda: _has(c.dsn(), copying, [(True,)]), "the copy to run", 120)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the join, its Spark JVM and workers, as a container kill
        await asyncio.to_thread(process.wait)
    config = make_config(nodes)
    report = await join_node(config, "c")  # the retry: no --force needed, nothing left half-done
    assert report.rows == 400_000
    async with running_router(config):
        await execute(c.dsn(), "INSERT INTO t VALUES (0, 'from c')")
        await wait_converged(nodes, ["t"])


async def _has(dsn: str, query: str, expected: Any) -> bool:
    return await fetch(dsn, query) == expected
