"""PostgreSQL's 028_row_filter.pl against pgmesh's design: pgmesh replicates whole tables. A user's
publication with a row filter on a table changes nothing in what pgmesh sends: rows the filter would
leave out reach b, and updates that move a row in or out of the filter are plain updates.
"""

from __future__ import annotations

from router.testing.mesh import execute, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

# (PostgreSQL refuses an UPDATE of a table whose publication filters on a column outside the replica
# identity: the original's tables are REPLICA IDENTITY FULL for that reason too)
SCHEMA = """
CREATE TABLE tab_rowfilter_1 (a int primary key, b text);
ALTER TABLE tab_rowfilter_1 REPLICA IDENTITY FULL;
"""


async def test_028_row_filter_is_not_pgmeshs(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "CREATE PUBLICATION tap_pub_1 FOR TABLE tab_rowfilter_1"
                               " WHERE (a > 1000 AND b <> 'filtered')")
        await execute(a.dsn(), "INSERT INTO tab_rowfilter_1 (a, b) VALUES (1, 'not replicated')")
        await execute(a.dsn(), "INSERT INTO tab_rowfilter_1 (a, b) VALUES (1500, 'filtered')")
        await execute(a.dsn(), "INSERT INTO tab_rowfilter_1 (a, b) VALUES (1980, 'not filtered')")
        await execute(b.dsn(), "INSERT INTO tab_rowfilter_1 (a, b) VALUES (2000, 'from b')")
        await execute(a.dsn(), "UPDATE tab_rowfilter_1 SET b = 'filtered' WHERE a = 1980")
        await execute(a.dsn(), "UPDATE tab_rowfilter_1 SET a = 1001 WHERE a = 1")
        rows = [(1001, "not replicated"), (1500, "filtered"), (1980, "filtered"), (2000, "from b")]
        await rows_everywhere(m.nodes, "SELECT a, b FROM tab_rowfilter_1 ORDER BY a", rows)
        await converge(router, m.nodes, ["tab_rowfilter_1"])
        healthy(router)
