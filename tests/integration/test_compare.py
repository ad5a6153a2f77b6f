"""`pgmesh compare` (router.ops.compare) on a real 3-node mesh with the router running.

Divergences are made on purpose: rows changed on one node in a session whose changes replication does not
carry (a replication origin of its own: the router forwards only a node's own changes). Compare must find
all of them and only them, with the nodes idle and under a live write load on other keys (whose
in-flight changes it reads again once every link has applied past its first read, so none is reported).
A table without a key is compared as a multiset alike on Spark and on the command's threads.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from router.ops.cli import main as pgmesh
from router.ops.compare.job import compare_cluster
from router.ops.compare.lanes import SPARK_AFTER_S
from router.ops.compare.repair import repair_cluster
from router.testing.mesh import execute, fetch, free_port, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

pytestmark = pytest.mark.slow  # Spark (a JVM)

SCHEMA = """CREATE TABLE t (id bigint PRIMARY KEY, v text NOT NULL, n int);
CREATE TABLE k (name text PRIMARY KEY, v int NOT NULL);
CREATE TABLE live (id bigint PRIMARY KEY, v int NOT NULL);"""
TABLES = ["t", "k", "live"]


async def unreplicated(node: Any, *statements: str) -> None:
    """Run `statements` on `node` in a session whose changes the router does not carry."""
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        await conn.execute("SELECT pg_replication_origin_create('test_local') WHERE NOT EXISTS"
                           " (SELECT 1 FROM pg_replication_origin WHERE roname = 'test_local')")
        await conn.execute("SELECT pg_replication_origin_session_setup('test_local')")
        async with conn.transaction():
            for statement in statements:
                await conn.execute(statement.encode())


@contextlib.asynccontextmanager
async def writing(nodes: list[Any]) -> AsyncIterator[list[int]]:
    """Updates and inserts on `live` on every node, until the block ends: the count written."""
    done = asyncio.Event()
    count = [0]

    async def write(node: Any, offset: int) -> None:
        async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
            i = 0
            while not done.is_set() and i < 20_000:
                i += 1
                await conn.execute(
                    "INSERT INTO live VALUES (%s, 0) ON CONFLICT (id) DO UPDATE SET v = live.v + 1",
                    [offset + i % 500],
                )
                count[0] += 1

    tasks = [asyncio.create_task(write(node, 1_000_000 * (n + 1))) for n, node in enumerate(nodes)]
    try:
        yield count
    finally:
        done.set()
        await asyncio.gather(*tasks)


async def test_compare_finds_every_divergence_and_only_them(mesh: MeshFactory, tmp_path: Any) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, admin_port=free_port())
    a, b, c = m.nodes
    async with running_router(m.config):
        await execute(a.dsn(), "INSERT INTO t SELECT g, 'row ' || g, g % 7 FROM generate_series(1, 200000) g")
        await execute(b.dsn(), "INSERT INTO k SELECT 'name ' || g, g FROM generate_series(1, 3000) g")
        await execute(a.dsn(), "ANALYZE t; ANALYZE k")
        await wait_converged(m.nodes, TABLES)

        report = await compare_cluster(m.config)
        assert report.differences == [] and report.unsettled == [] and report.exit_code == 0, report.render()
        assert report.tables == ["public.k", "public.live", "public.t"]
        assert not report.spark  # a few ranges: the command's own threads end before Spark would pay

        await unreplicated(b, "UPDATE t SET v = 'changed' WHERE id IN (7, 150001)",
                           "INSERT INTO t VALUES (300000, 'only on b', NULL)")
        await unreplicated(c, "DELETE FROM t WHERE id = 99999", "UPDATE t SET n = NULL WHERE id = 42")
        await unreplicated(a, "UPDATE k SET v = -1 WHERE name = 'name 2999'")
        expected = {("public.t", "(7)"), ("public.t", "(150001)"), ("public.t", "(300000)"),
                    ("public.t", "(99999)"), ("public.t", "(42)"), ("public.k", '("name 2999")')}

        for spark_after_s in (0.0, SPARK_AFTER_S):  # on Spark only, then on the command's threads
            report = await compare_cluster(m.config, spark_after_s=spark_after_s)
            assert {(d.table, d.key) for d in report.differences} == expected, report.render()
            assert report.exit_code == 1 and report.unsettled == []
            assert report.spark == (spark_after_s == 0)
        missing = {d.key: [n for n, h in d.rows.items() if h is None] for d in report.differences}
        assert missing["(300000)"] == ["a", "c"] and missing["(99999)"] == ["c"] and missing["(7)"] == []

        async with writing(m.nodes) as written:  # a live load on other keys: nothing false reported
            await wait_for(lambda: written[0] > 300, "the writes on every node to start")
            report = await compare_cluster(m.config)
        assert written[0] > 0
        assert {(d.table, d.key) for d in report.differences} == expected, report.render()
        await wait_converged(m.nodes, ["live"])

        path = tmp_path / "config.toml"
        path.write_text(m.config_text())
        code = await asyncio.to_thread(pgmesh, ["compare", "--config", str(path), "k"])
        assert code == 1

        repaired = await repair_cluster(m.config)
        assert {(f.table, f.key) for f in repaired.fixes} == expected, repaired.render()
        by_key = {f.key: f for f in repaired.fixes}
        assert by_key["(7)"].winner == "b" and sorted(by_key["(7)"].written) == ["a", "c"]  # b's is newest
        assert by_key["(99999)"].written == ["c"]  # the row beats a node without it
        assert sorted(by_key["(300000)"].written) == ["a", "c"]
        await wait_converged(m.nodes, TABLES)
        again = await compare_cluster(m.config)
        assert again.differences == [] and again.exit_code == 0, again.render()
        for node in m.nodes:  # every fix recorded where it was written, nothing echoed elsewhere
            rows = await fetch(node.dsn(), "SELECT key FROM pgmesh.conflict_history WHERE source = 'repair'")
            fixed = {f.key for f in repaired.fixes if node.name in f.written}
            assert {r[0] for r in rows} == fixed, node.name
        # a later write anywhere still replicates over the repaired rows
        await execute(c.dsn(), "UPDATE t SET v = 'after repair' WHERE id IN (7, 300000)")
        await wait_converged(m.nodes, ["t"])


async def test_keyless_table_alike_on_spark_and_on_the_threads(mesh: MeshFactory) -> None:
    """A table without a key is compared as a multiset by the same task on Spark as on the command's own
    threads: a duplicate more on one node, a row missing on the other, each with its copies per node."""
    m = await mesh(nodes=2, schema="CREATE TABLE h (a int, b text); INSERT INTO h SELECT g % 100, 'x'"
                   " FROM generate_series(1, 5000) g;"
                   " INSERT INTO h VALUES (7, 'two'), (7, 'two'), (8, 'one')")
    a, b = m.nodes
    await unreplicated(a, "INSERT INTO h VALUES (7, 'two')")
    await unreplicated(b, "DELETE FROM h WHERE b = 'one'")
    expected = {"(7,two)": {"a": 3, "b": 2}, "(8,one)": {"a": 1, "b": 0}}
    for spark_after_s in (0.0, SPARK_AFTER_S):
        report = await compare_cluster(m.config, router_running=False, spark_after_s=spark_after_s)
        assert {d.key: d.counts for d in report.differences} == expected, report.render()
        assert report.tables == ["public.h"] and report.exit_code == 1
        assert report.spark == (spark_after_s == 0)
