"""PostgreSQL's 001_rep_changes.pl ported to a two-node pgmesh mesh with the router running (issue 17):
the same tables and statements, with writes added on the other node.

Differences by design: pgmesh replicates every table of its set (no insert-only publication: tab_ins
is a plain member; a table is left out by `[replication] exclude`, as tab_notrep is here); every node
holds the same columns (tab_mixed differs in column order only: the subscriber's local-only column `d`
has no equivalent); a table needs a key or REPLICA IDENTITY FULL, so the tables the original makes with
CREATE TABLE AS get REPLICA IDENTITY FULL before `pgmesh init`. Rows that are missing on the target
(update_missing / delete_missing in the original's log) are conflicts that pgmesh resolves and records.
"""

from __future__ import annotations

import asyncio

import pytest

from router.cluster.checks import check_cluster
from router.cluster.install import init_cluster
from router.testing.mesh import execute, fetch, running_router, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import conflicts, converge, has, healthy, rows_everywhere, same_rows

SCHEMA_A = """
CREATE TABLE tab_notrep AS SELECT generate_series(1,10) AS a;
CREATE TABLE tab_ins AS SELECT generate_series(1,1002) AS a;
ALTER TABLE tab_ins REPLICA IDENTITY FULL;
CREATE TABLE tab_full AS SELECT generate_series(1,10) AS a;
ALTER TABLE tab_full REPLICA IDENTITY FULL;
CREATE TABLE tab_full2 (x text);
ALTER TABLE tab_full2 REPLICA IDENTITY FULL;
INSERT INTO tab_full2 VALUES ('a'), ('b'), ('b');
CREATE TABLE tab_rep (a int primary key);
CREATE TABLE tab_include (a int, b text, CONSTRAINT covering PRIMARY KEY(a) INCLUDE(b));
CREATE TABLE tab_full_pk (a int primary key, b text);
ALTER TABLE tab_full_pk REPLICA IDENTITY FULL;
CREATE TABLE tab_no_replidentity_index(c1 int);
CREATE INDEX idx_no_replidentity_index ON tab_no_replidentity_index(c1);
ALTER TABLE tab_no_replidentity_index REPLICA IDENTITY FULL;
"""
MIXED_A = "CREATE TABLE tab_mixed (a int primary key, b text, c numeric)"
MIXED_B = "CREATE TABLE tab_mixed (c numeric, b text, a int primary key)"  # other column order
TABLES = ["tab_ins", "tab_full", "tab_full2", "tab_rep", "tab_include", "tab_full_pk",
          "tab_no_replidentity_index"]  # tab_mixed: compared by column name (its column order differs)
EXCLUDE = 'exclude = ["public.tab_notrep"]'
SUMMARY = "SELECT count(*), min(a), max(a) FROM {}"


async def test_001_rep_changes(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA_A, replication=EXCLUDE, init=False)
    a, b = m.nodes
    await execute(a.dsn(), MIXED_A, "INSERT INTO tab_mixed (a, b, c) VALUES (1, 'foo', 1.1)")
    await execute(b.dsn(), MIXED_B, "INSERT INTO tab_mixed (a, b, c) VALUES (1, 'foo', 1.1)")
    report, _ = await init_cluster(m.config)
    assert report.ok, report.render()
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO tab_ins SELECT generate_series(1,50)",
                      "DELETE FROM tab_ins WHERE a > 20", "UPDATE tab_ins SET a = -a")
        await execute(a.dsn(), "INSERT INTO tab_rep SELECT generate_series(1,50)",
                      "DELETE FROM tab_rep WHERE a > 20", "UPDATE tab_rep SET a = -a")
        await execute(a.dsn(), "INSERT INTO tab_mixed VALUES (2, 'bar', 2.2)")
        await execute(a.dsn(), "INSERT INTO tab_full_pk VALUES (1, 'foo'), (2, 'baz')")
        await execute(a.dsn(), "INSERT INTO tab_include SELECT generate_series(1,50)",
                      "DELETE FROM tab_include WHERE a > 20", "UPDATE tab_include SET a = -a")
        await execute(a.dsn(), "INSERT INTO tab_no_replidentity_index VALUES(1)")
        # the other way
        await execute(b.dsn(), "INSERT INTO tab_rep SELECT generate_series(101,110)",
                      "DELETE FROM tab_rep WHERE a > 105", "UPDATE tab_rep SET a = a + 100")
        await execute(b.dsn(), "INSERT INTO tab_include SELECT generate_series(101,110)",
                      "DELETE FROM tab_include WHERE a > 105")
        await execute(b.dsn(), "INSERT INTO tab_mixed (a, b, c) VALUES (3, 'from b', 3.3)")
        await converge(router, m.nodes, TABLES)
        # every change of tab_ins is replicated (the original publishes its inserts only: 1052|1|1002)
        assert await fetch(b.dsn(), SUMMARY.format("tab_ins")) == [(40, -20, -1)]
        assert await fetch(b.dsn(), SUMMARY.format("tab_rep")) == [(25, -20, 205)]
        assert await fetch(a.dsn(), SUMMARY.format("tab_include")) == [(25, -20, 105)]
        assert await fetch(a.dsn(), "SELECT c1 FROM tab_no_replidentity_index") == [(1,)]
        mixed = "SELECT a, b, c::text FROM tab_mixed ORDER BY a"
        for node in m.nodes:
            expected = [(1, "foo", "1.1"), (2, "bar", "2.2"), (3, "from b", "3.3")]
            assert await fetch(node.dsn(), mixed) == expected
        # the table left out stays apart
        assert await fetch(b.dsn(), "SELECT count(*) FROM tab_notrep") == [(10,)]

        # duplicate rows matched by all their columns; updates from both nodes
        await execute(a.dsn(), "INSERT INTO tab_full SELECT generate_series(1,10)")
        await same_rows(a, b, "SELECT a, count(*) FROM tab_full GROUP BY a ORDER BY a", "duplicates on b")
        await execute(a.dsn(), "UPDATE tab_full SET a = a * a")
        await execute(a.dsn(), "UPDATE tab_full2 SET x = 'bb' WHERE x = 'b'")
        await execute(a.dsn(), "UPDATE tab_mixed SET b = 'baz' WHERE a = 1")
        await execute(b.dsn(), "UPDATE tab_full_pk SET b = 'bar' WHERE a = 1")
        await converge(router, m.nodes, TABLES)
        assert await fetch(b.dsn(), SUMMARY.format("tab_full")) == [(20, 1, 100)]
        assert await fetch(b.dsn(), "SELECT x FROM tab_full2 ORDER BY 1") == [("a",), ("bb",), ("bb",)]
        assert await fetch(a.dsn(), "SELECT * FROM tab_full_pk ORDER BY a") == [(1, "bar"), (2, "baz")]

        # toasted values: a large one, then an update that leaves it unchanged (not sent)
        await execute(a.dsn(), "UPDATE tab_mixed SET b = repeat('xyzzy', 100000) WHERE a = 2")
        lengths = "SELECT a, length(b), c::text FROM tab_mixed ORDER BY a"
        await rows_everywhere(m.nodes, lengths, [(1, 3, "1.1"), (2, 500000, "2.2"), (3, 6, "3.3")])
        await execute(b.dsn(), "UPDATE tab_mixed SET c = 3.3 WHERE a = 2")
        await rows_everywhere(m.nodes, lengths, [(1, 3, "1.1"), (2, 500000, "3.3"), (3, 6, "3.3")])

        # dropped columns: the update before the DROP, the DROP (replicated), an update after it
        await execute(a.dsn(), "UPDATE tab_mixed SET b = 'bar', c = 2.2 WHERE a = 2")
        await execute(a.dsn(), "ALTER TABLE tab_mixed DROP COLUMN b")
        await execute(a.dsn(), "UPDATE tab_mixed SET c = 11.11 WHERE a = 1")
        await execute(b.dsn(), "UPDATE tab_mixed SET c = 22.22 WHERE a = 2")
        await rows_everywhere(m.nodes, "SELECT a, c::text FROM tab_mixed ORDER BY a",
                              [(1, "11.11"), (2, "22.22"), (3, "3.3")])

        # a transaction that touches only the table left out reaches no other node (as the original's
        # empty transaction is skipped): b's link counts one transaction, the marker's
        link = router.appliers[("a", "b")]
        await wait_for(lambda: link.pending == 0, "a's link to b idle")
        before = link.stats.applied_transactions
        await execute(a.dsn(), "INSERT INTO tab_notrep VALUES (11)")
        await execute(a.dsn(), "INSERT INTO tab_rep VALUES (1000)")
        await wait_for(lambda: has(b.dsn(), "SELECT count(*) FROM tab_rep WHERE a = 1000", [(1,)]), "marker")
        # the row is visible once the batch commits, the count a moment later (when its round trip returns)
        await wait_for(lambda: link.stats.applied_transactions > before, "the marker's transaction counted")
        assert link.stats.applied_transactions == before + 1
        assert await fetch(b.dsn(), "SELECT count(*) FROM tab_notrep") == [(10,)]
        await converge(router, m.nodes, TABLES)
        healthy(router)


async def test_001_rows_missing_on_the_target(mesh: MeshFactory) -> None:
    """The original deletes rows on the subscriber behind replication, then updates and deletes them on
    the publisher (update_missing, delete_missing). In a mesh the delete is on b while the links are
    held: a's update and delete meet rows b no longer has, and b's delete meets a's newer row."""
    m = await mesh(nodes=2, schema=SCHEMA_A, replication=EXCLUDE)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO tab_full_pk VALUES (1, 'foo'), (2, 'baz')")
        await execute(a.dsn(), "UPDATE tab_full SET a = a * a")
        await converge(router, m.nodes, ["tab_full_pk", "tab_full"])
        await router.pause(None)
        await execute(b.dsn(), "DELETE FROM tab_full_pk")
        await execute(b.dsn(), "DELETE FROM tab_full WHERE a = 25")
        await execute(a.dsn(), "UPDATE tab_full_pk SET b = 'quux' WHERE a = 1")
        await execute(a.dsn(), "UPDATE tab_full SET a = a + 1 WHERE a = 25")
        await execute(a.dsn(), "DELETE FROM tab_full_pk WHERE a = 2")
        await router.resume(None)
        await converge(router, m.nodes, ["tab_full_pk", "tab_full"])
        # last update wins: a's update of row 1 is newer than b's delete, row 2 is deleted on both
        assert await fetch(b.dsn(), "SELECT * FROM tab_full_pk ORDER BY a") == [(1, "quux")]
        healthy(router)
    assert await conflicts(m.nodes, "public.tab_full_pk"), "no conflict recorded for tab_full_pk"


@pytest.mark.slow
async def test_001_source_restart(mesh: MeshFactory) -> None:
    """The original restarts the publisher and checks the subscriber streams again after catching up."""
    m = await mesh(nodes=2, schema=SCHEMA_A, replication=EXCLUDE)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO tab_ins SELECT generate_series(1001,1100)")
        await execute(b.dsn(), "INSERT INTO tab_rep SELECT generate_series(1,20)")
        await asyncio.to_thread(a.restart, "fast")
        await rows_everywhere(m.nodes, SUMMARY.format("tab_rep"), [(20, 1, 20)])
        await execute(a.dsn(), "DELETE FROM tab_rep WHERE a > 10")
        await execute(b.dsn(), "INSERT INTO tab_ins VALUES (-1)")
        await converge(router, m.nodes, ["tab_ins", "tab_rep"])
        assert await fetch(b.dsn(), SUMMARY.format("tab_ins")) == [(1103, -1, 1100)]
        assert await fetch(a.dsn(), SUMMARY.format("tab_rep")) == [(10, 1, 10)]

        async def streaming() -> bool:
            return all(x.state.value == "streaming" for x in router.appliers.values())

        await wait_for(streaming, "every link streaming after the restart")
        healthy(router)


async def test_001_table_without_columns_is_refused_by_init(mesh: MeshFactory) -> None:
    """tab_no_col (no columns at all, REPLICA IDENTITY FULL; the original replicates its inserts): its rows
    cannot be told apart, so no update, delete or conflict on it can be decided. `pgmesh init` refuses it
    up front, naming node and table (docs/limits.md), instead of installing and failing."""
    m = await mesh(nodes=2, schema="CREATE TABLE tab_no_col(); ALTER TABLE tab_no_col REPLICA IDENTITY FULL;",
                   init=False)
    report = await check_cluster(m.config)
    problems = [(c.node, c.relation) for c in report.problems]
    assert problems == [("a", "public.tab_no_col"), ("b", "public.tab_no_col")], report.render()
    assert "has no columns" in report.render() and "give it columns and a primary key" in report.render()
    for node in m.nodes:
        assert await fetch(node.dsn(), "SELECT count(*) FROM pg_namespace WHERE nspname = 'pgmesh'") == [(0,)]


async def test_001_replica_identity_nothing_is_refused_by_init(mesh: MeshFactory) -> None:
    """tab_nothing (REPLICA IDENTITY NOTHING: inserts only, in the original) cannot be a member: `pgmesh
    init` says so, naming the table and what to do."""
    m = await mesh(nodes=2, schema="CREATE TABLE tab_nothing (a int PRIMARY KEY);"
                   "ALTER TABLE tab_nothing REPLICA IDENTITY NOTHING;", init=False)
    report = await check_cluster(m.config)
    assert not report.ok
    text = report.render()
    assert "tab_nothing" in text and "REPLICA IDENTITY NOTHING" in text, text
