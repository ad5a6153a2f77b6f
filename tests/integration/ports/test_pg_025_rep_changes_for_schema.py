"""PostgreSQL's 025_rep_changes_for_schema.pl ported to a two-node pgmesh mesh with the router running
(issue 17): the replicated set is one schema (`[replication] tables = ["sch1.*"]`, pgmesh's counterpart of
FOR TABLES IN SCHEMA), with a partitioned table whose partitions live in public (published through
their root), a table created in the schema later (it joins by itself: no REFRESH PUBLICATION), and tables
moved out of the schema or dropped.
"""

from __future__ import annotations

from router.testing.mesh import execute, fetch, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SCHEMA = """
CREATE SCHEMA sch1;
CREATE TABLE sch1.tab1 AS SELECT generate_series(1,10) AS a;
ALTER TABLE sch1.tab1 REPLICA IDENTITY FULL;
CREATE TABLE sch1.tab2 AS SELECT generate_series(1,10) AS a;
ALTER TABLE sch1.tab2 REPLICA IDENTITY FULL;
CREATE TABLE sch1.tab1_parent (a int PRIMARY KEY, b text) PARTITION BY LIST (a);
CREATE TABLE public.tab1_child1 PARTITION OF sch1.tab1_parent FOR VALUES IN (1, 2, 3);
CREATE TABLE public.tab1_child2 PARTITION OF sch1.tab1_parent FOR VALUES IN (4, 5, 6);
INSERT INTO sch1.tab1_parent values (1),(4);
CREATE TABLE public.other (a int);
"""


def summary(table: str) -> str:
    return f"SELECT count(*), min(a), max(a) FROM {table}"


async def test_025_rep_changes_for_schema(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, replication='tables = ["sch1.*"]')
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO sch1.tab1 VALUES(generate_series(11,20))")
        await execute(a.dsn(), "INSERT INTO sch1.tab1_parent values (2),(5)")
        await execute(b.dsn(), "INSERT INTO sch1.tab1_parent values (3),(6)")
        await execute(b.dsn(), "INSERT INTO public.other VALUES (1)")  # outside the set
        await rows_everywhere(m.nodes, summary("sch1.tab1"), [(20, 1, 20)])
        await rows_everywhere(m.nodes, "SELECT a, b FROM sch1.tab1_parent ORDER BY 1",
                              [(1, None), (2, None), (3, None), (4, None), (5, None), (6, None)])
        assert await fetch(a.dsn(), "SELECT count(*) FROM public.other") == [(0,)]

        # a table created in the schema later joins by itself once it has a key
        await execute(a.dsn(), "CREATE TABLE sch1.tab3 (a int PRIMARY KEY)")
        await execute(a.dsn(), "INSERT INTO sch1.tab3 SELECT generate_series(1,10)")
        await rows_everywhere(m.nodes, summary("sch1.tab3"), [(10, 1, 10)])
        await execute(b.dsn(), "INSERT INTO sch1.tab3 VALUES(11)")
        await rows_everywhere(m.nodes, summary("sch1.tab3"), [(11, 1, 11)])

        await execute(b.dsn(), "DROP TABLE sch1.tab2")
        await rows_everywhere(m.nodes, "SELECT to_regclass('sch1.tab2') IS NULL", [(True,)])
        await execute(a.dsn(), "INSERT INTO sch1.tab1 VALUES(21)")
        await rows_everywhere(m.nodes, summary("sch1.tab1"), [(21, 1, 21)])
        await converge(router, m.nodes, ["sch1.tab1", "sch1.tab1_parent"])
        healthy(router)


async def test_025_table_moved_out_of_the_schema(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, replication='tables = ["sch1.*"]')
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "CREATE TABLE sch1.tab3 (a int PRIMARY KEY)")
        await execute(a.dsn(), "INSERT INTO sch1.tab3 SELECT generate_series(1,11)")
        await rows_everywhere(m.nodes, summary("sch1.tab3"), [(11, 1, 11)])
        await execute(a.dsn(), "ALTER TABLE sch1.tab3 SET SCHEMA public")
        await rows_everywhere(m.nodes, "SELECT to_regclass('public.tab3') IS NOT NULL", [(True,)])
        await execute(a.dsn(), "INSERT INTO public.tab3 VALUES(12)")
        await execute(a.dsn(), "INSERT INTO sch1.tab1 VALUES(21)")  # a marker after it
        await rows_everywhere(m.nodes, summary("sch1.tab1"), [(11, 1, 21)])
        assert await fetch(b.dsn(), summary("public.tab3")) == [(11, 1, 11)]
        healthy(router)
