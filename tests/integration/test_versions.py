"""Nodes of different PostgreSQL major versions in one mesh: they start as asked, and replicate both ways.

Owns: proving the harness's version per node (`mesh(versions=[15, 18])`) gives each node the server it
asked for, the smallest mixed-version replication check (a row inserted on each node reaches the
other), a conflict between a 15 and an 18 node (one winner, recorded on both) and DDL both ways
(ADD COLUMN on either reaches the other); test_upgrade.py joins 18 nodes into a 15 cluster.
Must not: test the router's behaviour per version in depth (the stream and apply tests do), or sleep
(every wait polls a condition). A version that is not installed here skips the test.
"""

from __future__ import annotations

from typing import Any

import pytest

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_cluster import VERSION_ENV, NodeFactory, require_versions
from tests.fix_mesh import MeshFactory

SCHEMA = 'CREATE TABLE "notes" ("id" int PRIMARY KEY, "written_on" text NOT NULL);'
pytestmark = pytest.mark.versions  # pins its nodes' versions: runs once, not again under PGMESH_TEST_PG
VERSIONS = [15, 18]


async def server_major(node: Any) -> int:
    rows = await fetch(node.dsn(), "SELECT current_setting('server_version_num')::int / 10000")
    return int(rows[0][0])


async def test_each_node_runs_the_version_it_asked_for(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, versions=VERSIONS, init=False)
    assert [await server_major(node) for node in m.nodes] == VERSIONS


async def test_nodes_without_a_version_follow_pgmesh_test_pg(
    pg_nodes: NodeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_versions([18])
    monkeypatch.setenv(VERSION_ENV, "18")
    plain, asked = pg_nodes(names=["plain", "asked"], versions=[None, 15])
    assert [await server_major(plain), await server_major(asked)] == [18, 15]


async def test_mixed_versions_replicate_both_ways(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, versions=VERSIONS)
    a, b = m.nodes
    assert [await server_major(a), await server_major(b)] == VERSIONS
    async with running_router(m.config):
        await execute(a.dsn(), """INSERT INTO "notes" VALUES (1, 'a (15)')""")
        await execute(b.dsn(), """INSERT INTO "notes" VALUES (2, 'b (18)')""")
        await wait_converged(m.nodes, ["notes"], limit=60)
    for node in m.nodes:
        rows = await fetch(node.dsn(), 'SELECT "id", "written_on" FROM "notes" ORDER BY "id"')
        assert rows == [(1, "a (15)"), (2, "b (18)")], node.name


async def test_a_conflict_between_15_and_18_has_one_winner_recorded_on_both(mesh: MeshFactory) -> None:
    """The same keys updated on both nodes while the links wait: the later update wins on both sides (key 1
    on the 18 node, key 2 on the 15 one), and each node records the conflict it decided."""
    m = await mesh(nodes=2, schema=SCHEMA, versions=VERSIONS)
    a, b = m.nodes
    await execute(a.dsn(), """INSERT INTO "notes" VALUES (1, 'first'), (2, 'first')""")
    async with running_router(m.config) as router:
        await wait_converged(m.nodes, ["notes"], limit=60)
        await router.pause(None)
        await execute(a.dsn(), """UPDATE "notes" SET "written_on" = 'a (15)' WHERE "id" = 1""")
        await execute(b.dsn(), """UPDATE "notes" SET "written_on" = 'b (18)' WHERE "id" = 1""")
        await execute(b.dsn(), """UPDATE "notes" SET "written_on" = 'b (18)' WHERE "id" = 2""")
        await execute(a.dsn(), """UPDATE "notes" SET "written_on" = 'a (15)' WHERE "id" = 2""")
        await router.resume(None)
        await wait_converged(m.nodes, ["notes"], limit=60)
        await wait_for(lambda: all(x.stats.conflicts >= 2 for x in router.appliers.values()), "both decided")
        assert all(applier.last_error is None for applier in router.appliers.values())
    history = 'SELECT "key", "conflict_type", "remote_origin" FROM pgmesh.conflict_history ORDER BY "key"'
    for node, other in ((a, b), (b, a)):
        rows = await fetch(node.dsn(), 'SELECT "id", "written_on" FROM "notes" ORDER BY "id"')
        assert rows == [(1, "b (18)"), (2, "a (15)")], node.name
        recorded = await fetch(node.dsn(), history)
        assert [(key, kind) for key, kind, _ in recorded] == [("1", "update_origin_differs"),
                                                             ("2", "update_origin_differs")], recorded
        assert all(other.name in str(origin) for _, _, origin in recorded), (node.name, recorded)


async def columns(node: Any) -> list[str]:
    query = ("SELECT column_name::text FROM information_schema.columns WHERE table_name = 'notes'"
             " ORDER BY ordinal_position")
    return [row[0] for row in await fetch(node.dsn(), query)]


async def test_ddl_from_15_reaches_18_and_back(mesh: MeshFactory) -> None:
    """ALTER TABLE ADD COLUMN on the 15 node reaches the 18 node, with the rows written after it, and
    the same the other way (docs/ddl.md: captured by the event triggers, replayed by the applier)."""
    m = await mesh(nodes=2, schema=SCHEMA, versions=VERSIONS)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), """INSERT INTO "notes" VALUES (1, 'a (15)')""",
                      """ALTER TABLE "notes" ADD COLUMN "from_15" int DEFAULT 15""",
                      """INSERT INTO "notes" VALUES (2, 'a (15)', 150)""")
        await wait_for(lambda: _has_columns(b, ["id", "written_on", "from_15"]), "15's column on 18")
        await execute(b.dsn(), """INSERT INTO "notes" VALUES (3, 'b (18)', 180)""",
                      """ALTER TABLE "notes" ADD COLUMN "from_18" text DEFAULT 'eighteen'""",
                      """INSERT INTO "notes" VALUES (4, 'b (18)', 181, 'set on 18')""")
        every = ["id", "written_on", "from_15", "from_18"]
        await wait_for(lambda: _has_columns(a, every), "18's column on 15")
        await wait_converged(m.nodes, ["notes"], limit=60)
        assert sum(applier.stats.ddl_applied for applier in router.appliers.values()) == 2
        assert all(applier.last_error is None for applier in router.appliers.values())
    expected = [(1, 15, "eighteen"), (2, 150, "eighteen"), (3, 180, "eighteen"), (4, 181, "set on 18")]
    for node in m.nodes:
        rows = await fetch(node.dsn(), 'SELECT "id", "from_15", "from_18" FROM "notes" ORDER BY "id"')
        assert rows == expected, node.name


async def _has_columns(node: Any, expected: list[str]) -> bool:
    return await columns(node) == expected
