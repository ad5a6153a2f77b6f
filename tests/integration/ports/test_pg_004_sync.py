"""PostgreSQL's 004_sync.pl ported to a two-node pgmesh mesh with the router running (issue 17).

The original tests the initial table copy of a subscription (and its retry after a constraint
violation). In pgmesh the nodes start alike (`pgmesh init` takes the rows every node already has; a new
node is copied by `pgmesh join`, tests/integration/test_join.py), and a table created later joins the
replicated set by itself: here one made with CREATE TABLE ... AS on a (every node computes its rows from
the same statement, see docs/ddl.md), given its key afterwards (as pg_dump output does), then written
on both nodes.
"""

from __future__ import annotations

from router.testing.mesh import execute, fetch, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SCHEMA = "CREATE TABLE tab_rep (a int primary key); INSERT INTO tab_rep SELECT generate_series(1,10);"


async def test_004_sync(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO tab_rep SELECT generate_series(11,20)")
        await rows_everywhere(m.nodes, "SELECT count(*) FROM tab_rep", [(20,)])
        # a table made after the mesh was set up, with rows, then its key
        await execute(a.dsn(), "CREATE TABLE tab_rep_next (a) AS SELECT generate_series(1,10)")
        await rows_everywhere(m.nodes, "SELECT count(*) FROM tab_rep_next", [(10,)])
        await execute(a.dsn(), "ALTER TABLE tab_rep_next ADD PRIMARY KEY (a)")
        keyed = "SELECT count(*) FROM pg_index WHERE indrelid = 'tab_rep_next'::regclass AND indisprimary"
        await rows_everywhere(m.nodes, keyed, [(1,)])
        await execute(a.dsn(), "INSERT INTO tab_rep_next SELECT generate_series(11,20)")
        await execute(b.dsn(), "INSERT INTO tab_rep_next SELECT generate_series(21,30)")
        await rows_everywhere(m.nodes, "SELECT count(*), min(a), max(a) FROM tab_rep_next", [(30, 1, 30)])
        await converge(router, m.nodes, ["tab_rep", "tab_rep_next"])
        assert await fetch(b.dsn(), "SELECT count(*) FROM tab_rep") == [(20,)]
        healthy(router)
