"""PostgreSQL's 010_truncate.pl ported to a two-node pgmesh mesh with the router running (issue 17).

pgmesh replicates TRUNCATE of every member table (there is no publication without `truncate`: pub2's
case is a table left out by `[replication] exclude`, whose TRUNCATE stays local), with RESTART IDENTITY
and CASCADE as the source ran it. Rows to truncate are written on the other node, as in the original.
"""

from __future__ import annotations

import asyncio

from router.testing.mesh import execute, fetch, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, has, healthy, rows_everywhere

SCHEMA = """
CREATE TABLE tab1 (a int PRIMARY KEY);
CREATE TABLE tab2 (a int PRIMARY KEY);
CREATE TABLE tab3 (a int PRIMARY KEY);
CREATE TABLE tab4 (x int PRIMARY KEY, y int REFERENCES tab3);
CREATE SEQUENCE seq1 OWNED BY tab1.a;
ALTER SEQUENCE seq1 START 101;
"""
EMPTY = [(0, None, None)]


def summary(table: str, column: str = "a") -> str:
    return f"SELECT count(*), min({column}), max({column}) FROM {table}"


async def test_010_truncate(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, replication='exclude = ["public.tab2"]')
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(b.dsn(), "INSERT INTO tab1 VALUES (1), (2), (3)")
        await rows_everywhere(m.nodes, summary("tab1"), [(3, 1, 3)])
        await execute(a.dsn(), "TRUNCATE tab1")
        await rows_everywhere(m.nodes, summary("tab1"), EMPTY)
        assert await fetch(b.dsn(), "SELECT nextval('seq1')") == [(1,)]  # sequence not restarted

        await execute(a.dsn(), "TRUNCATE tab1 RESTART IDENTITY")
        await execute(a.dsn(), "INSERT INTO tab3 VALUES (100)")  # a marker after it
        await rows_everywhere(m.nodes, "SELECT a FROM tab3", [(100,)])
        assert await fetch(b.dsn(), "SELECT nextval('seq1')") == [(101,)]  # restarted on b too
        assert await fetch(a.dsn(), "SELECT nextval('seq1')") == [(101,)]

        # the table left out: its TRUNCATE stays on the node that ran it
        await execute(b.dsn(), "INSERT INTO tab2 VALUES (1), (2), (3)")
        await execute(a.dsn(), "INSERT INTO tab2 VALUES (7)")
        await execute(a.dsn(), "TRUNCATE tab2")
        # tables linked by a foreign key, their rows written on b
        await execute(b.dsn(), "DELETE FROM tab3")
        await execute(b.dsn(), "INSERT INTO tab3 VALUES (1), (2), (3)")
        await execute(b.dsn(), "INSERT INTO tab4 VALUES (11, 1), (111, 1), (22, 2)")
        await rows_everywhere(m.nodes, summary("tab4", "x"), [(3, 11, 111)])
        await execute(a.dsn(), "TRUNCATE tab3, tab4")
        await rows_everywhere(m.nodes, summary("tab3"), EMPTY)
        await rows_everywhere(m.nodes, summary("tab4", "x"), EMPTY)
        assert await fetch(b.dsn(), summary("tab2")) == [(3, 1, 3)]

        # several tables, one of them left out, truncated together on b this time
        await execute(a.dsn(), "INSERT INTO tab1 VALUES (1), (2), (3)")
        await execute(a.dsn(), "INSERT INTO tab2 VALUES (1), (2), (3)")
        await rows_everywhere(m.nodes, summary("tab1"), [(3, 1, 3)])
        await execute(b.dsn(), "TRUNCATE tab1, tab2")
        await execute(b.dsn(), "INSERT INTO tab3 VALUES (5)")
        await rows_everywhere(m.nodes, summary("tab3"), [(1, 5, 5)])
        assert await fetch(a.dsn(), summary("tab1")) == EMPTY
        assert await fetch(a.dsn(), summary("tab2")) == [(3, 1, 3)]
        assert await fetch(b.dsn(), summary("tab2")) == EMPTY

        # TRUNCATE in a transaction between inserts, from both nodes
        await execute(a.dsn(), "BEGIN", "INSERT INTO tab1 VALUES (10)", "TRUNCATE tab1",
                      "INSERT INTO tab1 VALUES (11)", "COMMIT")
        await rows_everywhere(m.nodes, summary("tab1"), [(1, 11, 11)])
        await converge(router, m.nodes, ["tab1", "tab3", "tab4"])
        for node in m.nodes:
            deadlocks = "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
            assert await has(node.dsn(), deadlocks, [(0,)])
        healthy(router)


async def test_010_truncate_synchronous(mesh: MeshFactory) -> None:
    """Synchronous replication to pgmesh (its walsender's application_name is pgmesh_<cluster>): a commit
    on a returns once the router confirmed it, which it does once every other node applied it durably."""
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        sync = "ALTER SYSTEM SET synchronous_standby_names TO 'pgmesh_t'"
        await execute(a.dsn(), sync, "SELECT pg_reload_conf()")
        await rows_everywhere([a], "SHOW synchronous_standby_names", [("pgmesh_t",)])
        await asyncio.wait_for(execute(a.dsn(), "INSERT INTO tab1 VALUES (1), (2), (3)"), 60)
        assert await fetch(b.dsn(), summary("tab1")) == [(3, 1, 3)]  # there when the commit returned
        await asyncio.wait_for(execute(a.dsn(), "TRUNCATE tab1"), 60)
        assert await fetch(b.dsn(), summary("tab1")) == EMPTY
        await execute(b.dsn(), "INSERT INTO tab1 VALUES (4)")  # b -> a is not synchronous, and goes on
        await rows_everywhere(m.nodes, summary("tab1"), [(1, 4, 4)])
        await execute(a.dsn(), "ALTER SYSTEM RESET synchronous_standby_names", "SELECT pg_reload_conf()")
        healthy(router)
