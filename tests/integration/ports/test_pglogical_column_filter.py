"""pglogical's column_filter.sql, ported to a two-node pgmesh mesh (issue 17).

pglogical replicates a chosen list of columns to a subscriber whose table has other columns. pgmesh
replicates whole tables by design and keeps one schema on every node, so the same table shapes are
refused by `pgmesh init`, naming the node, the table and each column that differs; nothing is installed.
With the shapes made equal, what else the scenario does applies: rows copied in, a DROP COLUMN in a
transaction rolled back (nothing reaches the other node), then a DROP COLUMN that does (it reaches every
node, with the rows written around it).
"""

from __future__ import annotations

from typing import Any

import psycopg

from router.cluster.checks import check_cluster
from router.cluster.install import init_cluster
from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import healthy

ON_A = """CREATE TABLE public.basic_dml (
    id serial primary key,
    other integer,
    data text,
    something interval
)"""
ON_B = """CREATE TABLE public.basic_dml (
    id serial primary key,
    data text,
    something interval,
    subonly integer,
    subonly_def integer DEFAULT 99
)"""
INSERT = """INSERT INTO basic_dml(other, data, something)
VALUES (5, 'foo', '1 minute'::interval),
       (4, 'bar', '12 weeks'::interval),
       (3, 'baz', '2 years 1 hour'::interval),
       (2, 'qux', '8 months 2 days'::interval),
       (1, NULL, NULL)"""
COLUMNS = ("SELECT string_agg(attname, ',' ORDER BY attnum) FROM pg_attribute"
           " WHERE attrelid = 'basic_dml'::regclass AND attnum > 0 AND NOT attisdropped")


async def test_column_filter(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, init=False)
    a, b = m.nodes
    await execute(a.dsn(), ON_A)
    await execute(a.dsn(), INSERT)
    await execute(b.dsn(), ON_B)

    report = await check_cluster(m.config)
    assert not report.ok
    problems = [(c.node, c.relation) for c in report.problems]
    assert problems and all(relation == "public.basic_dml" for _, relation in problems), report.render()
    text = report.render()
    for column in ("other", "subonly", "subonly_def"):
        assert column in text, (column, text)
    for node in m.nodes:  # refused: nothing of pgmesh anywhere
        assert await fetch(node.dsn(), "SELECT count(*) FROM pg_namespace WHERE nspname = 'pgmesh'") == [(0,)]

    # the same shape on both nodes (b as a: every node holds the whole table), then init
    await execute(b.dsn(), "DROP TABLE basic_dml", ON_A, INSERT)
    report, _ = await init_cluster(m.config)
    assert report.ok, report.render()
    async with running_router(m.config) as router:
        async with await psycopg.AsyncConnection.connect(a.dsn()) as conn:
            await conn.execute("ALTER TABLE public.basic_dml DROP COLUMN data")
            await conn.rollback()
        await execute(a.dsn(), "INSERT INTO basic_dml VALUES (10, 10, 'after rollback', NULL)")
        await wait_converged(m.nodes, ["basic_dml"])
        assert await fetch(b.dsn(), COLUMNS) == [("id,other,data,something",)]

        await execute(b.dsn(), "ALTER TABLE public.basic_dml DROP COLUMN other")
        await execute(b.dsn(), "INSERT INTO basic_dml VALUES (11, 'after drop', '1 day')")
        await wait_for(lambda: _has(a, COLUMNS, [("id,data,something",)]), "the DROP COLUMN on a")
        await execute(a.dsn(), "INSERT INTO basic_dml VALUES (12, 'from a', NULL)")
        await wait_converged(m.nodes, ["basic_dml"])
        assert await fetch(a.dsn(), "SELECT id, data FROM basic_dml ORDER BY id") == [
            (1, "foo"), (2, "bar"), (3, "baz"), (4, "qux"), (5, None), (10, "after rollback"),
            (11, "after drop"), (12, "from a")]
        healthy(router)


async def _has(node: Any, query: str, expected: Any) -> bool:
    return bool(await fetch(node.dsn(), query) == expected)
