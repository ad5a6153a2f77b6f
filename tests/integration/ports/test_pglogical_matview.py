"""pglogical's matview.sql, ported to a two-node pgmesh mesh with the router running (issue 17).

A table and a materialized view over it, made by DDL in one query string while the router runs. pgmesh
replicates REFRESH MATERIALIZED VIEW as a command (docs/ddl.md): each node recomputes the view from its
own rows, at the command's place in the source's commit order, so the view holds the rows committed
before the REFRESH on every node. Added for a mesh: rows and a REFRESH ... CONCURRENTLY from b.
"""

from __future__ import annotations

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import has, healthy, same_rows

SCHEMA = """CREATE TABLE public.test_tbl(id serial primary key, data text);
CREATE MATERIALIZED VIEW public.test_mv AS (SELECT * FROM public.test_tbl)"""

TBL = "SELECT id, data FROM test_tbl ORDER BY id"
MV = "SELECT id, data FROM test_mv ORDER BY id"


async def test_matview(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), SCHEMA)
        exists = "SELECT to_regclass('public.test_mv') IS NOT NULL"
        await wait_for(lambda: has(b.dsn(), exists, [(True,)]), "test_tbl and test_mv on b")

        await execute(a.dsn(), "INSERT INTO test_tbl VALUES (1, 'a')")
        await execute(a.dsn(), "REFRESH MATERIALIZED VIEW test_mv")
        await execute(a.dsn(), "INSERT INTO test_tbl VALUES (2, 'b')")
        assert await same_rows(a, b, TBL, "test_tbl on b") == [(1, "a"), (2, "b")]
        # the REFRESH ran on b after row 1 and before row 2, as on a
        assert await same_rows(a, b, MV, "test_mv on b") == [(1, "a")]

        await execute(a.dsn(), "CREATE UNIQUE INDEX ON public.test_mv(id)")
        await execute(a.dsn(), "INSERT INTO test_tbl VALUES (3, 'c')")
        await execute(a.dsn(), "REFRESH MATERIALIZED VIEW CONCURRENTLY test_mv")
        await execute(a.dsn(), "INSERT INTO test_tbl VALUES (4, 'd')")
        await execute(a.dsn(), "REFRESH MATERIALIZED VIEW public.test_mv")
        await execute(a.dsn(), "INSERT INTO test_tbl VALUES (5, 'e')")
        await execute(a.dsn(), "REFRESH MATERIALIZED VIEW CONCURRENTLY public.test_mv")
        expected = [(1, "a"), (2, "b"), (3, "c"), (4, "d"), (5, "e")]
        assert await same_rows(a, b, TBL, "test_tbl on b") == expected
        assert await same_rows(a, b, MV, "test_mv on b") == expected

        # from b: a row, then a concurrent refresh, then a row the view must not hold yet
        await execute(b.dsn(), "INSERT INTO test_tbl VALUES (6, 'f from b')")
        await execute(b.dsn(), "REFRESH MATERIALIZED VIEW CONCURRENTLY public.test_mv")
        await execute(b.dsn(), "INSERT INTO test_tbl VALUES (7, 'g from b')")
        await wait_converged(m.nodes, ["test_tbl"])
        assert await same_rows(a, b, MV, "test_mv on a") == [*expected, (6, "f from b")]
        assert (await fetch(a.dsn(), "SELECT count(*) FROM test_tbl"))[0][0] == 7

        await execute(a.dsn(), "DROP TABLE public.test_tbl CASCADE")
        gone = "SELECT to_regclass('public.test_mv') IS NULL AND to_regclass('public.test_tbl') IS NULL"
        await wait_for(lambda: has(b.dsn(), gone, [(True,)]), "test_tbl and test_mv dropped on b")
        healthy(router)
