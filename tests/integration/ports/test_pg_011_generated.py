"""PostgreSQL's 011_generated.pl ported to a two-node pgmesh mesh with the router running (issue 17).

Stored generated columns are computed on each node (PostgreSQL 15's pgoutput does not send them). The
original's subscriber computes another expression (a * 22); in a mesh every node has the same table, so
both compute a * 2: a node with another expression would hold other values by design.
"""

from __future__ import annotations

from router.testing.mesh import execute, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SCHEMA = """
CREATE TABLE tab1 (a int PRIMARY KEY, b int GENERATED ALWAYS AS (a * 2) STORED);
INSERT INTO tab1 (a) VALUES (1), (2), (3);
"""


async def test_011_generated(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO tab1 VALUES (4), (5)")
        await execute(a.dsn(), "UPDATE tab1 SET a = 6 WHERE a = 5")
        await execute(b.dsn(), "INSERT INTO tab1 VALUES (7)")
        await execute(b.dsn(), "UPDATE tab1 SET a = 8 WHERE a = 7")
        await execute(b.dsn(), "DELETE FROM tab1 WHERE a = 1")
        await converge(router, m.nodes, ["tab1"])
        await rows_everywhere(m.nodes, "SELECT a, b FROM tab1 ORDER BY a",
                              [(2, 4), (3, 6), (4, 8), (6, 12), (8, 16)])
        healthy(router)
