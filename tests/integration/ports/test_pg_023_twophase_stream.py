"""PostgreSQL's 023_twophase_stream.pl ported to a two-node pgmesh mesh with the router running (issue 17):
prepared transactions large enough to stream (logical_decoding_work_mem = 64kB), committed or rolled
back, also with a DDL inside and with rows on the other node. By design (see test_pg_021_twophase) pgmesh
applies a prepared transaction at COMMIT PREPARED; nothing is ever prepared on the other node.
"""

from __future__ import annotations

import pytest

from router.testing.mesh import NODE_SETTINGS, execute, fetch, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SETTINGS = {**NODE_SETTINGS, "max_prepared_transactions": "10", "logical_decoding_work_mem": "64kB"}
SCHEMA = """
CREATE TABLE test_tab (a int primary key, b bytea, c timestamptz DEFAULT now(), d bigint DEFAULT 999);
INSERT INTO test_tab VALUES (1, 'foo', '2020-01-01'), (2, 'bar', '2020-01-01');
"""
BIG = [
    "INSERT INTO test_tab SELECT i, sha256(i::text::bytea) FROM generate_series(3, 5000) s(i)",
    "UPDATE test_tab SET b = sha256(b) WHERE mod(a,2) = 0",
    "DELETE FROM test_tab WHERE mod(a,3) = 0",
]
COUNTS = "SELECT count(*), count(c), count(d = 999) FROM test_tab"


@pytest.mark.slow
async def test_023_twophase_stream(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, settings=SETTINGS)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "BEGIN", *BIG, "PREPARE TRANSACTION 'test_prepared_tab'")
        assert await fetch(b.dsn(), "SELECT count(*) FROM pg_prepared_xacts") == [(0,)]
        await execute(a.dsn(), "COMMIT PREPARED 'test_prepared_tab'")
        await rows_everywhere(m.nodes, COUNTS, [(3334, 3334, 3334)], 120)
        await execute(a.dsn(), "DELETE FROM test_tab WHERE a > 2")
        await rows_everywhere(m.nodes, COUNTS, [(2, 2, 2)])
        # rolled back: nothing reaches b
        await execute(a.dsn(), "BEGIN", *BIG, "PREPARE TRANSACTION 'test_prepared_tab'")
        await execute(a.dsn(), "ROLLBACK PREPARED 'test_prepared_tab'")
        # on b, with a savepoint rolled back and rows after it
        await execute(b.dsn(), "BEGIN", "INSERT INTO test_tab VALUES (9999, 'foobar')", "SAVEPOINT sp_inner",
                      *BIG, "ROLLBACK TO SAVEPOINT sp_inner", "INSERT INTO test_tab VALUES (10000, 'after')",
                      "PREPARE TRANSACTION 'outer'")
        await execute(b.dsn(), "COMMIT PREPARED 'outer'")
        await rows_everywhere(m.nodes, COUNTS, [(4, 4, 4)], 120)
        # a streamed prepared transaction with an ADD COLUMN inside
        await execute(a.dsn(), "BEGIN", *BIG, "ALTER TABLE test_tab ADD COLUMN e INT",
                      "INSERT INTO test_tab VALUES (20000, 'e', now(), 999, 1)", "PREPARE TRANSACTION 'ddl'")
        await execute(a.dsn(), "COMMIT PREPARED 'ddl'")
        # 9999 is a multiple of 3: BIG deletes it
        await rows_everywhere(m.nodes, "SELECT count(*), count(e) FROM test_tab", [(3336, 1)], 120)
        await converge(router, m.nodes, ["test_tab"], 120)
        for node in m.nodes:
            assert await fetch(node.dsn(), "SELECT count(*) FROM pg_prepared_xacts") == [(0,)]
        healthy(router)
