"""PostgreSQL's 006_rewrite.pl ported to a two-node pgmesh mesh with the router running (issue 17): DDL
that rewrites the heap (ADD COLUMN ... NOT NULL DEFAULT) between writes from both nodes.

pgmesh replicates the ALTER itself, so it is run once (the original runs it on each side); test1 has no
key in the original, here it is matched by all its columns (REPLICA IDENTITY FULL), and its column `c` is
named like an alias pgmesh's conflict SQL once used.
"""

from __future__ import annotations

from router.testing.mesh import execute, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SCHEMA = "CREATE TABLE test1 (a int, b text); ALTER TABLE test1 REPLICA IDENTITY FULL;"
ROWS = "SELECT a, b, c FROM test1 ORDER BY a"


async def test_006_rewrite(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO test1 (a, b) VALUES (1, 'one'), (2, 'two')")
        await rows_everywhere(m.nodes, "SELECT a, b FROM test1 ORDER BY a", [(1, "one"), (2, "two")])
        await execute(b.dsn(), "ALTER TABLE test1 ADD c int NOT NULL DEFAULT 0")
        await rows_everywhere(m.nodes, "SELECT count(c) FROM test1", [(2,)])  # the ALTER reached a
        await execute(a.dsn(), "INSERT INTO test1 (a, b, c) VALUES (3, 'three', 33)")
        await execute(b.dsn(), "INSERT INTO test1 (a, b, c) VALUES (4, 'four', 44)")
        expected = [(1, "one", 0), (2, "two", 0), (3, "three", 33), (4, "four", 44)]
        await rows_everywhere(m.nodes, ROWS, expected)
        # the rows that got the default in the rewrite are updated from both nodes
        await execute(a.dsn(), "UPDATE test1 SET c = 1 WHERE a = 1")
        await execute(b.dsn(), "UPDATE test1 SET c = 2 WHERE a = 2")
        await execute(a.dsn(), "DELETE FROM test1 WHERE a = 4")
        await converge(router, m.nodes, ["test1"])
        await rows_everywhere(m.nodes, ROWS, [(1, "one", 1), (2, "two", 2), (3, "three", 33)])
        healthy(router)


async def test_006_rewrite_concurrent_updates_of_column_c(mesh: MeshFactory) -> None:
    """Two nodes update the same row of a table with a column named `c` while the links are held: the
    conflict path's SQL must not read the user's column for its own alias (issue 17)."""
    m = await mesh(nodes=2, schema="CREATE TABLE t (a int primary key, c int);")
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO t VALUES (1, 0)")
        await rows_everywhere(m.nodes, "SELECT * FROM t", [(1, 0)])
        await router.pause(None)
        await execute(a.dsn(), "UPDATE t SET c = 1")
        await execute(b.dsn(), "UPDATE t SET c = 2")
        await router.resume(None)
        await converge(router, m.nodes, ["t"])
        await rows_everywhere(m.nodes, "SELECT * FROM t", [(1, 2)])  # the later update wins
        healthy(router)
