"""PostgreSQL's 031_column_list.pl (and 028_row_filter.pl, test_pg_028_row_filter.py) against pgmesh's
design: pgmesh replicates whole tables, every column of every row, through its own publication. A
user's publication with a column list (or a row filter) on the same table is the user's (for their own
subscribers) and changes nothing in what pgmesh sends: here every column reaches b, from both nodes.
"""

from __future__ import annotations

from router.testing.mesh import execute, fetch, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SCHEMA = "CREATE TABLE tab1 (a int PRIMARY KEY, \"B\" int, c int);"


async def test_031_column_list_is_not_pgmeshs(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "CREATE PUBLICATION pub1 FOR TABLE tab1 (a, \"B\")")
        await execute(a.dsn(), "INSERT INTO tab1 VALUES (1, 2, 3), (4, 5, 6)")
        await execute(b.dsn(), "INSERT INTO tab1 VALUES (7, 8, 9)")
        await rows_everywhere(m.nodes, "SELECT count(*) FROM tab1", [(3,)])
        await execute(a.dsn(), "UPDATE tab1 SET c = c * 10 WHERE a = 7")
        rows = [(1, 2, 3), (4, 5, 6), (7, 8, 90)]
        await rows_everywhere(m.nodes, "SELECT a, \"B\", c FROM tab1 ORDER BY a", rows)
        await converge(router, m.nodes, ["tab1"])
        assert await fetch(a.dsn(), "SELECT count(*) FROM pg_publication WHERE pubname = 'pub1'") == [(1,)]
        healthy(router)
