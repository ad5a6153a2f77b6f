"""PostgreSQL's 022_twophase_cascade.pl ported to a three-node pgmesh mesh with the router running
(issue 17). The original cascades A -> B -> C; a mesh sends A's transactions to B and C directly (and
never B's replay of them on to C: no echo).

By design a prepared transaction reaches the other nodes at COMMIT PREPARED (see test_pg_021_twophase);
the streamed case uses logical_decoding_work_mem = 64kB, as the original does.
"""

from __future__ import annotations

import pytest

from router.testing.mesh import NODE_SETTINGS, execute, fetch, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SETTINGS = {**NODE_SETTINGS, "max_prepared_transactions": "10", "logical_decoding_work_mem": "64kB"}
SCHEMA = """
CREATE TABLE tab_full (a int PRIMARY KEY);
INSERT INTO tab_full SELECT generate_series(1,10);
CREATE TABLE test_tab (a int primary key, b bytea, c timestamptz DEFAULT now(), d bigint DEFAULT 999);
INSERT INTO test_tab VALUES (1, 'foo', '2020-01-01'), (2, 'bar', '2020-01-01');
"""
PREPARED = "SELECT count(*) FROM pg_prepared_xacts"


@pytest.mark.slow
async def test_022_twophase_cascade(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, settings=SETTINGS)
    a, b, c = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "BEGIN", "INSERT INTO tab_full VALUES (11)",
                      "PREPARE TRANSACTION 'test_prepared_tab_full'")
        await execute(c.dsn(), "INSERT INTO tab_full VALUES (31)")
        await rows_everywhere(m.nodes, "SELECT count(*) FROM tab_full WHERE a = 31", [(1,)])
        for node in (b, c):
            assert await fetch(node.dsn(), PREPARED) == [(0,)]
        await execute(a.dsn(), "COMMIT PREPARED 'test_prepared_tab_full'")
        await rows_everywhere(m.nodes, "SELECT count(*) FROM tab_full WHERE a = 11", [(1,)])

        await execute(a.dsn(), "BEGIN", "INSERT INTO tab_full VALUES (12)",
                      "PREPARE TRANSACTION 'test_prepared_tab_full'")
        await execute(a.dsn(), "ROLLBACK PREPARED 'test_prepared_tab_full'")
        await execute(a.dsn(), "BEGIN", "INSERT INTO tab_full VALUES (21)", "SAVEPOINT sp_inner",
                      "INSERT INTO tab_full VALUES (22)", "ROLLBACK TO SAVEPOINT sp_inner",
                      "PREPARE TRANSACTION 'outer'")
        await execute(a.dsn(), "COMMIT PREPARED 'outer'")
        await rows_everywhere(m.nodes, "SELECT a FROM tab_full WHERE a IN (12, 21, 22)", [(21,)])

        # streamed (over 64kB) and prepared, then committed
        await execute(
            a.dsn(), "BEGIN",
            "INSERT INTO test_tab SELECT i, sha256(i::text::bytea) FROM generate_series(3, 5000) s(i)",
            "UPDATE test_tab SET b = sha256(b) WHERE mod(a,2) = 0",
            "DELETE FROM test_tab WHERE mod(a,3) = 0",
            "PREPARE TRANSACTION 'test_prepared_tab'",
        )
        await execute(a.dsn(), "COMMIT PREPARED 'test_prepared_tab'")
        await rows_everywhere(m.nodes, "SELECT count(*), count(c), count(d = 999) FROM test_tab",
                              [(3334, 3334, 3334)])
        await converge(router, m.nodes, ["tab_full", "test_tab"])

        # streamed rows after a savepoint, rolled back to it, then the prepared rest committed
        await execute(a.dsn(), "DELETE FROM test_tab WHERE a > 2")
        await execute(
            a.dsn(), "BEGIN",
            "INSERT INTO test_tab VALUES (9999, 'foobar')",
            "SAVEPOINT sp_inner",
            "INSERT INTO test_tab SELECT i, sha256(i::text::bytea) FROM generate_series(3, 5000) s(i)",
            "UPDATE test_tab SET b = sha256(b) WHERE mod(a,2) = 0",
            "DELETE FROM test_tab WHERE mod(a,3) = 0",
            "ROLLBACK TO SAVEPOINT sp_inner",
            "PREPARE TRANSACTION 'outer'",
        )
        await execute(a.dsn(), "COMMIT PREPARED 'outer'")
        await rows_everywhere(m.nodes, "SELECT count(*) FROM test_tab WHERE b = 'foobar'", [(1,)])
        await rows_everywhere(m.nodes, "SELECT count(*) FROM test_tab", [(3,)])
        await converge(router, m.nodes, ["tab_full", "test_tab"])
        for node in m.nodes:
            assert await fetch(node.dsn(), PREPARED) == [(0,)]
        healthy(router)
