"""`pgmesh push TABLE --from A --to B [--query SQL]` (router.cluster.copy.push) into a live 3-node mesh:
the pushed rows are written on B by key as B's own writes, so they replicate from there and every node
converges on them; rows only on B stay; a query's rows go the same way; bad input fails naming node and
table before anything is written."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from router.cluster.copy.push import push
from router.errors import PgmeshError
from router.ops.cli import main as pgmesh
from router.ops.compare.job import compare_cluster
from router.testing.mesh import execute, fetch, free_port, running_router, wait_converged
from tests.fix_mesh import MeshFactory
from tests.integration.test_compare import unreplicated, writing

pytestmark = pytest.mark.slow  # Spark (a JVM)

SCHEMA = """CREATE TABLE items (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v text NOT NULL,
  twice text GENERATED ALWAYS AS (v || v) STORED, n int DEFAULT 7);
CREATE TABLE live (id bigint PRIMARY KEY, v int NOT NULL);
CREATE TABLE nokey (v int);"""
ROWS = "SELECT id, v, twice, n FROM items ORDER BY id"


async def test_push_a_table_and_a_query_into_a_live_node(mesh: MeshFactory, tmp_path: Path) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, admin_port=free_port())
    a, b, c = m.nodes
    await execute(a.dsn(), "INSERT INTO items (v, n) SELECT 'row ' || g, g FROM generate_series(1, 3000) g")
    async with running_router(m.config):
        await wait_converged(m.nodes, ["items"], 60)
        # b lost some rows and changed one, and has one of its own, none of it replicated
        await unreplicated(b, "DELETE FROM items WHERE id BETWEEN 100 AND 199",
                           "UPDATE items SET v = 'wrong' WHERE id = 5",
                           "INSERT INTO items (id, v) OVERRIDING SYSTEM VALUE VALUES (900000, 'only on b')")
        async with writing(m.nodes):  # the nodes stay live meanwhile
            done = await asyncio.to_thread(push, m.config, "items", "a", "b")
        assert done.rows == 101  # 100 inserted, 1 changed; the 2,899 identical rows left alone
        assert await fetch(b.dsn(), "SELECT v, twice FROM items WHERE id = 5") == [("row 5", "row 5row 5")]
        assert await fetch(b.dsn(), "SELECT v FROM items WHERE id = 900000") == [("only on b",)]
        # a query's rows, named as the table's columns; n keeps its value where a row is updated
        config = str(m.write_config(tmp_path / "c.toml"))
        code = await asyncio.to_thread(pgmesh, [
            "push", "items", "--from", "a", "--to", "b", "--config", config,
            "--query", "SELECT id, upper(v) AS v FROM items WHERE id <= 3 -- {braces} stay;"])
        assert code == 0
        report = await compare_cluster(m.config, ["items", "live"])
        # b's writes replicated: only the row that exists on b alone differs
        assert [d.key for d in report.differences] == ["(900000)"], report.render()
        for node in m.nodes:
            rows = await fetch(node.dsn(), "SELECT id, v, n FROM items WHERE id <= 3 ORDER BY id")
            assert rows == [(1, "ROW 1", 1), (2, "ROW 2", 2), (3, "ROW 3", 3)], node.name
        assert await fetch(a.dsn(), ROWS + " LIMIT 10") == await fetch(c.dsn(), ROWS + " LIMIT 10")

    with pytest.raises(PgmeshError) as no_key:
        push(m.config, "nokey", "a", "c")
    assert "no primary key" in str(no_key.value) and "node c" in str(no_key.value)
    with pytest.raises(PgmeshError) as keyless:
        push(m.config, "items", "a", "c", "SELECT v FROM items")
    assert "key column(s) id" in str(keyless.value) and "public.items" in str(keyless.value)
    with pytest.raises(PgmeshError) as unknown:
        push(m.config, "items", "a", "c", "SELECT id, v AS w FROM items")
    assert "does not have (or generates): w" in str(unknown.value)
    with pytest.raises(PgmeshError) as twice:  # a key twice: that task writes nothing
        push(m.config, "items", "a", "c", "SELECT 1 AS id, 'x' AS v UNION ALL SELECT 1, 'y'")
    assert "node c" in str(twice.value) and "push failed" in str(twice.value)
    assert await fetch(c.dsn(), "SELECT v FROM items WHERE id = 1") == [("ROW 1",)]
