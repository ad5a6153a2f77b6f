"""Nodes of different PostgreSQL major versions in one mesh: they start as asked, and replicate both ways.

Owns: proving the harness's version per node (`mesh(versions=[15, 18])`) gives each node the server it
asked for, and the smallest mixed-version replication check (a row inserted on each node reaches the
other). Must not: test the router's behaviour per version in depth (the stream and apply tests do), or
sleep (every wait polls a condition). A version that is not installed here skips the test.
"""

from __future__ import annotations

from typing import Any

import pytest

from router.testing.mesh import execute, fetch, running_router, wait_converged
from tests.fix_cluster import VERSION_ENV, NodeFactory, require_versions
from tests.fix_mesh import MeshFactory

SCHEMA = 'CREATE TABLE "notes" ("id" int PRIMARY KEY, "written_on" text NOT NULL);'
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
