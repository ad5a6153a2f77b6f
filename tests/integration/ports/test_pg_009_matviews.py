"""PostgreSQL's 009_matviews.pl ported to a two-node pgmesh mesh with the router running (issue 17).

The original checks that a materialized view's rows (which logical decoding produces) are not replicated
and do not hang the subscription. pgmesh replicates CREATE / REFRESH MATERIALIZED VIEW as commands
(docs/ddl.md): each node computes the view from its own rows, which are equal once converged.
"""

from __future__ import annotations

from router.testing.mesh import execute, fetch, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SCHEMA = "CREATE TABLE test1 (a int PRIMARY KEY, b text);"
VIEW = "SELECT a, b FROM testmv1 ORDER BY a"


async def test_009_matviews(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO test1 (a, b) VALUES (1, 'one'), (2, 'two')")
        await execute(b.dsn(), "INSERT INTO test1 (a, b) VALUES (3, 'three')")
        await converge(router, m.nodes, ["test1"])
        await execute(a.dsn(), "CREATE MATERIALIZED VIEW testmv1 AS SELECT * FROM test1")
        await rows_everywhere(m.nodes, VIEW, [(1, "one"), (2, "two"), (3, "three")])
        # more rows, then a refresh on the other node: every node recomputes from its own rows
        await execute(a.dsn(), "INSERT INTO test1 VALUES (4, 'four')")
        await execute(b.dsn(), "DELETE FROM test1 WHERE a = 1")
        await converge(router, m.nodes, ["test1"])
        assert await fetch(b.dsn(), "SELECT count(*) FROM testmv1") == [(3,)]  # not refreshed yet
        await execute(b.dsn(), "REFRESH MATERIALIZED VIEW testmv1")
        await rows_everywhere(m.nodes, VIEW, [(2, "two"), (3, "three"), (4, "four")])
        await execute(a.dsn(), "INSERT INTO test1 VALUES (5, 'marker')")
        await converge(router, m.nodes, ["test1"])
        healthy(router)
