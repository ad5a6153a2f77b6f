"""PostgreSQL's 013_partition.pl ported to a two-node pgmesh mesh with the router running (issue 17):
the same tables and statements, run as a user would, with writes added on the other node.
"""

from __future__ import annotations

from typing import Any

import psycopg

from router.cluster.install import init_cluster
from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import has, healthy, rows_everywhere, same_rows

PARTITIONED = """
CREATE TABLE tab1 (a int PRIMARY KEY, b text) PARTITION BY LIST (a);
CREATE TABLE tab1_1 (b text, a int NOT NULL);
ALTER TABLE tab1 ATTACH PARTITION tab1_1 FOR VALUES IN (1, 2, 3);
CREATE TABLE tab1_2 PARTITION OF tab1 FOR VALUES IN (4, 5, 6);
CREATE TABLE tab1_def PARTITION OF tab1 DEFAULT;
"""

ROWS1 = "SELECT tableoid::regclass::text, a, b FROM tab1 ORDER BY a"
ROWS2 = "SELECT tableoid::regclass::text, a, b FROM tab2 ORDER BY a"


def _ddl_applied(router: Any) -> int:
    return sum(applier.stats.ddl_applied for applier in router.appliers.values())


async def test_013_partition(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=PARTITIONED)  # tab1 exists at init; tab2 comes by DDL below
    a, b = m.nodes
    async with running_router(m.config) as router:
        # (each row is updated or deleted on the node that wrote it: see the test below for the rest)
        steps = [
            (a, "INSERT INTO tab1 VALUES (1, 'r'), (0, 'r'), (4, 'r'), (10, 'r')"),
            (a, "INSERT INTO tab1_1 (a, b) VALUES (2, 'leaf')"),
            (b, "INSERT INTO tab1_2 VALUES (6, 'leaf b')"),
            (b, "INSERT INTO tab1 VALUES (20, 'b'), (21, 'b')"),
            (a, "UPDATE tab1 SET a = 30 WHERE a = 1"),  # tab1_1 -> tab1_def
            (b, "UPDATE tab1 SET a = 3, b = 'moved' WHERE a = 20"),  # tab1_def -> tab1_1
            (b, "UPDATE tab1 SET a = 5 WHERE a = 21"),  # tab1_def -> tab1_2
            (a, "UPDATE tab1_2 SET b = 'leaf upd' WHERE a = 4"),
            (a, "DELETE FROM tab1 WHERE a = 0"),
            (a, "DELETE FROM tab1_1 WHERE a = 2"),
        ]
        for node, statement in steps:
            await execute(node.dsn(), statement)
            await same_rows(a, b, ROWS1, f"tab1 equal after {statement!r}")
        rows = await fetch(b.dsn(), ROWS1)
        assert rows == [
            ("tab1_1", 3, "moved"), ("tab1_2", 4, "leaf upd"), ("tab1_2", 5, "b"), ("tab1_2", 6, "leaf b"),
            ("tab1_def", 10, "r"), ("tab1_def", 30, "r"),
        ], rows
        # one partition truncated on a: only it, also on b
        await execute(a.dsn(), "TRUNCATE tab1_2")
        await execute(a.dsn(), "INSERT INTO tab1 VALUES (40, 'marker')")  # applied after the TRUNCATE
        await wait_for(lambda: has(b.dsn(), "SELECT count(*) FROM tab1 WHERE a = 40", [(1,)]), "marker on b")
        rows = await same_rows(a, b, ROWS1, "tab1 equal after TRUNCATE tab1_2")
        assert rows == [
            ("tab1_1", 3, "moved"), ("tab1_def", 10, "r"), ("tab1_def", 30, "r"), ("tab1_def", 40, "marker"),
        ], rows
        # the other way, and in a transaction with rows before and after it
        await execute(b.dsn(), "INSERT INTO tab1 VALUES (4, 'again'), (5, 'again')")
        async with await psycopg.AsyncConnection.connect(b.dsn()) as conn:
            await conn.execute("INSERT INTO tab1_1 VALUES ('in txn', 1)")
            await conn.execute("TRUNCATE tab1_def")
            await conn.execute("INSERT INTO tab1 VALUES (50, 'after')")
            await conn.commit()
        await wait_for(lambda: has(a.dsn(), "SELECT count(*) FROM tab1 WHERE a = 50", [(1,)]), "row 50 on a")
        rows = await same_rows(a, b, ROWS1, "tab1 equal after TRUNCATE tab1_def on b")
        assert rows == [
            ("tab1_1", 1, "in txn"), ("tab1_1", 3, "moved"), ("tab1_2", 4, "again"), ("tab1_2", 5, "again"),
            ("tab1_def", 50, "after"),
        ], rows
        # the root: every partition, through pgoutput's Truncate alone (no message per partition)
        before = _ddl_applied(router)
        await execute(a.dsn(), "TRUNCATE tab1")
        await execute(a.dsn(), "INSERT INTO tab1 VALUES (60, 'after root')")
        await wait_for(lambda: has(b.dsn(), "SELECT count(*) FROM tab1 WHERE a = 60", [(1,)]), "row 60 on b")
        rows = await same_rows(a, b, ROWS1, "tab1 equal after TRUNCATE tab1")
        assert rows == [("tab1_def", 60, "after root")], rows
        assert _ddl_applied(router) == before

        # a partitioned table made by DDL while the router runs, two levels deep
        for statement in (
            "CREATE TABLE tab2 (a int PRIMARY KEY, b text) PARTITION BY RANGE (a)",
            "CREATE TABLE tab2_1 PARTITION OF tab2 FOR VALUES FROM (0) TO (10)",
            "CREATE TABLE tab2_2 PARTITION OF tab2 FOR VALUES FROM (10) TO (20) PARTITION BY RANGE (a)",
            "CREATE TABLE tab2_2x PARTITION OF tab2_2 FOR VALUES FROM (10) TO (15)",
            "CREATE TABLE tab2_2y (a int NOT NULL, b text)",
            "ALTER TABLE tab2_2 ATTACH PARTITION tab2_2y FOR VALUES FROM (15) TO (20)",
        ):
            await execute(a.dsn(), statement)
        await same_rows(a, b, "SELECT count(*) FROM pg_inherits WHERE inhparent::regclass::text LIKE 'tab2%'",
                        "tab2's partitions on b")
        await execute(a.dsn(), "INSERT INTO tab2 VALUES (1, 'x'), (11, 'x'), (16, 'y')")
        await execute(b.dsn(), "INSERT INTO tab2 VALUES (2, 'y'), (13, 'x'), (17, 'y')")
        await same_rows(a, b, ROWS2, "tab2 equal after inserts")
        await execute(b.dsn(), "TRUNCATE tab2_2y")
        await execute(b.dsn(), "INSERT INTO tab2 VALUES (3, 'marker')")
        await wait_for(lambda: has(a.dsn(), "SELECT count(*) FROM tab2 WHERE a = 3", [(1,)]), "marker on a")
        rows = await same_rows(a, b, ROWS2, "tab2 equal after TRUNCATE tab2_2y")
        assert rows == [
            ("tab2_1", 1, "x"), ("tab2_1", 2, "y"), ("tab2_1", 3, "marker"), ("tab2_2x", 11, "x"),
            ("tab2_2x", 13, "x"),
        ], rows
        await execute(a.dsn(), "TRUNCATE tab2_2")  # a partition that is itself partitioned
        await execute(a.dsn(), "INSERT INTO tab2 VALUES (4, 'marker')")
        await wait_for(lambda: has(b.dsn(), "SELECT count(*) FROM tab2 WHERE a = 4", [(1,)]), "row 4 on b")
        rows = await same_rows(a, b, ROWS2, "tab2 equal after TRUNCATE tab2_2")
        assert [r[1] for r in rows] == [1, 2, 3, 4], rows
        await wait_converged(m.nodes, ["tab1", "tab2"])
        assert all(applier.last_error is None for applier in router.appliers.values())


async def test_013_partition_truncate_detached(mesh: MeshFactory) -> None:
    """A partition detached from its root is a table of its own, and it still matches `tables`: pgmesh
    keeps it replicated (upstream's subscriber stops getting it, since it leaves the publication with its
    root; rows written to it on one node would then stay there), so its TRUNCATE reaches the other node."""
    m = await mesh(nodes=2, schema=PARTITIONED + "CREATE TABLE other (id int PRIMARY KEY);")
    a, b = m.nodes
    async with running_router(m.config):
        await execute(a.dsn(), "INSERT INTO tab1 VALUES (1, 'x'), (4, 'x'), (5, 'x')")
        await same_rows(a, b, ROWS1, "tab1 equal")
        await execute(a.dsn(), "ALTER TABLE tab1 DETACH PARTITION tab1_2")
        await same_rows(a, b, "SELECT count(*) FROM pg_inherits WHERE inhrelid = 'tab1_2'::regclass",
                        "the detach on b")
        await execute(a.dsn(), "TRUNCATE tab1_2")
        await execute(a.dsn(), "INSERT INTO other VALUES (1)")
        await wait_for(lambda: has(b.dsn(), "SELECT count(*) FROM other", [(1,)]), "marker on b")
        await wait_for(lambda: has(b.dsn(), "SELECT count(*) FROM tab1_2", [(0,)]), "the TRUNCATE on b")


async def test_013_partition_changes_from_the_other_node(mesh: MeshFactory) -> None:
    """Rows moved across partitions by the other node, onto a key deleted before."""
    m = await mesh(nodes=2, schema=PARTITIONED)
    a, b = m.nodes
    async with running_router(m.config):
        steps = [
            (a, "INSERT INTO tab1 VALUES (1, 'r'), (0, 'r'), (4, 'r'), (5, 'r'), (10, 'r')"),
            (a, "INSERT INTO tab1_1 (a, b) VALUES (3, 'leaf')"),
            (b, "INSERT INTO tab1_2 VALUES (6, 'leaf b')"),
            (b, "INSERT INTO tab1 VALUES (2, 'b'), (20, 'b')"),
            (a, "UPDATE tab1 SET a = 30 WHERE a = 1"),
            (b, "UPDATE tab1 SET a = 1, b = 'moved' WHERE a = 20"),  # onto the key a moved away
            (a, "UPDATE tab1 SET b = 'by a' WHERE a = 6"),
            (b, "DELETE FROM tab1 WHERE a = 0"),
        ]
        for node, statement in steps:
            await execute(node.dsn(), statement)
            await same_rows(a, b, ROWS1, f"tab1 equal after {statement!r}")
        rows = await fetch(a.dsn(), ROWS1)
        assert rows == [
            ("tab1_1", 1, "moved"), ("tab1_1", 2, "b"), ("tab1_1", 3, "leaf"), ("tab1_2", 4, "r"),
            ("tab1_2", 5, "r"), ("tab1_2", 6, "by a"), ("tab1_def", 10, "r"), ("tab1_def", 30, "r"),
        ], rows


async def test_013_partition_truncate_cascade(mesh: MeshFactory) -> None:
    """TRUNCATE of a partition that a foreign key references (through its root) needs CASCADE; the
    referencing table is emptied on every node, the other partitions are kept."""
    ref = "CREATE TABLE ref (id int PRIMARY KEY, a int REFERENCES tab1);"
    m = await mesh(nodes=2, schema=PARTITIONED + ref)
    a, b = m.nodes
    async with running_router(m.config):
        await execute(a.dsn(), "INSERT INTO tab1 VALUES (1, 'x'), (4, 'x'), (5, 'x')")
        await same_rows(a, b, ROWS1, "tab1 on b")
        await execute(b.dsn(), "INSERT INTO ref VALUES (1, 1), (2, 4)")
        await same_rows(a, b, "SELECT * FROM ref ORDER BY id", "ref on a")
        await execute(a.dsn(), "TRUNCATE tab1_2 CASCADE")
        await execute(a.dsn(), "INSERT INTO tab1 VALUES (7, 'marker')")
        await wait_for(lambda: has(b.dsn(), "SELECT count(*) FROM tab1 WHERE a = 7", [(1,)]), "marker on b")
        assert await same_rows(a, b, ROWS1, "tab1 equal") == [("tab1_1", 1, "x"), ("tab1_def", 7, "marker")]
        assert await same_rows(a, b, "SELECT * FROM ref", "ref equal") == []


# A partitioned table without a key, matched by all its columns (REPLICA IDENTITY FULL): the first row
# of each partition sits at the same ctid, (0,1).
FULL_PARTITIONED = """
CREATE TABLE pf (a int, b text) PARTITION BY RANGE (a);
CREATE TABLE pf_1 PARTITION OF pf FOR VALUES FROM (0) TO (100);
CREATE TABLE pf_2 PARTITION OF pf FOR VALUES FROM (100) TO (200);
ALTER TABLE pf REPLICA IDENTITY FULL;
ALTER TABLE pf_1 REPLICA IDENTITY FULL;
ALTER TABLE pf_2 REPLICA IDENTITY FULL;
"""
ROWS_PF = "SELECT tableoid::regclass::text, a, b FROM pf ORDER BY a, b"


async def test_013_partition_full_identity_touches_one_row(mesh: MeshFactory) -> None:
    """An UPDATE / DELETE matched by all columns changes exactly one row, in its own partition."""
    m = await mesh(nodes=2, schema=FULL_PARTITIONED)
    a, b = m.nodes
    async with running_router(m.config) as router:
        steps = [
            (a, "INSERT INTO pf VALUES (1, 'one'), (101, 'one hundred one')"),
            (a, "UPDATE pf SET b = 'changed' WHERE a = 1"),
            (b, "UPDATE pf SET b = 'changed on b' WHERE a = 101"),
            (a, "DELETE FROM pf WHERE a = 1"),
        ]
        for node, statement in steps:
            await execute(node.dsn(), statement)
            await same_rows(a, b, ROWS_PF, f"pf equal after {statement!r}")
        assert await fetch(b.dsn(), ROWS_PF) == [("pf_2", 101, "changed on b")]
        assert all(applier.last_error is None for applier in router.appliers.values())


LIST_ON_A = """
CREATE TABLE tab3 (a int PRIMARY KEY, b text) PARTITION BY LIST (a);
CREATE TABLE tab3_1 PARTITION OF tab3 FOR VALUES IN (1, 2, 3);
CREATE TABLE tab3_2 PARTITION OF tab3 FOR VALUES IN (4, 5, 6);
CREATE TABLE tab3_def PARTITION OF tab3 DEFAULT;
"""
RANGE_ON_B = """
CREATE TABLE tab3 (a int PRIMARY KEY, b text) PARTITION BY RANGE (a);
CREATE TABLE tab3_low (b text, a int NOT NULL);
ALTER TABLE tab3 ATTACH PARTITION tab3_low FOR VALUES FROM (MINVALUE) TO (5);
CREATE TABLE tab3_high PARTITION OF tab3 FOR VALUES FROM (5) TO (MAXVALUE);
"""
ROWS3 = "SELECT a, b FROM tab3 ORDER BY a"


async def test_013_partitioned_differently_on_each_node(mesh: MeshFactory) -> None:
    """The original's subscriber partitions its tables otherwise than the publisher; rows travel under the
    root's name, so each node routes them to its own partitions."""
    m = await mesh(nodes=2, init=False)
    a, b = m.nodes
    await execute(a.dsn(), LIST_ON_A)
    await execute(b.dsn(), RANGE_ON_B)
    report, _ = await init_cluster(m.config)
    assert report.ok, report.render()
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO tab3 VALUES (1, 'a'), (4, 'a'), (10, 'a')")
        await execute(b.dsn(), "INSERT INTO tab3 VALUES (2, 'b'), (6, 'b')")
        await rows_everywhere(m.nodes, "SELECT count(*) FROM tab3", [(5,)])
        await execute(a.dsn(), "UPDATE tab3 SET a = 3 WHERE a = 10")  # a: def -> tab3_1; b: high -> low
        await execute(b.dsn(), "UPDATE tab3 SET a = 7, b = 'moved' WHERE a = 2")  # b: low -> high
        await execute(a.dsn(), "DELETE FROM tab3 WHERE a = 4")
        rows = [(1, "a"), (3, "a"), (6, "b"), (7, "moved")]
        await rows_everywhere(m.nodes, ROWS3, rows)
        where_b = "SELECT tableoid::regclass::text, a FROM tab3 ORDER BY a"
        assert await fetch(b.dsn(), where_b) == [("tab3_low", 1), ("tab3_low", 3), ("tab3_high", 6),
                                                 ("tab3_high", 7)]
        await execute(b.dsn(), "TRUNCATE tab3")
        # a's insert comes after b's TRUNCATE has reached a, as the original waits between the steps (a
        # TRUNCATE at once with an insert on the other node is the known hole, docs/conflicts.md)
        await rows_everywhere(m.nodes, ROWS3, [])
        await execute(a.dsn(), "INSERT INTO tab3 VALUES (5, 'after')")
        await rows_everywhere(m.nodes, ROWS3, [(5, "after")])
        await same_rows(a, b, ROWS3, "tab3 equal")
        healthy(router)


async def test_013_truncate_of_a_partition_the_other_node_lacks(mesh: MeshFactory) -> None:
    """A TRUNCATE of one partition reaches a node that partitions the table otherwise as a DELETE of the
    rows within that partition's bounds on the source (a list partition on a, a range one on b); its
    partition-level TRUNCATE on a node that has the same partition stays a TRUNCATE."""
    m = await mesh(nodes=2, init=False)
    a, b = m.nodes
    await execute(a.dsn(), LIST_ON_A)
    await execute(b.dsn(), RANGE_ON_B)
    report, _ = await init_cluster(m.config)
    assert report.ok, report.render()
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO tab3 VALUES (1, 'a'), (4, 'a'), (10, 'a')")
        await rows_everywhere(m.nodes, "SELECT count(*) FROM tab3", [(3,)])
        await execute(a.dsn(), "TRUNCATE tab3_2")
        await execute(a.dsn(), "INSERT INTO tab3 VALUES (20, 'marker')")
        await rows_everywhere(m.nodes, ROWS3, [(1, "a"), (10, "a"), (20, "marker")], 20)
        # b's range partition below 5 (MINVALUE to 5), which a (LIST) does not have
        await execute(b.dsn(), "INSERT INTO tab3 VALUES (-7, 'b'), (4, 'b'), (5, 'b')")
        await rows_everywhere(m.nodes, "SELECT count(*) FROM tab3", [(6,)])
        await execute(b.dsn(), "TRUNCATE tab3_low")
        await rows_everywhere(m.nodes, ROWS3, [(5, "b"), (10, "a"), (20, "marker")], 20)
        healthy(router)
