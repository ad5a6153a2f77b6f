"""PostgreSQL's 015_stream.pl ported to a two-node pgmesh mesh with the router running (issue 17): large
transactions that the server streams while in progress (logical_decoding_work_mem = 64kB), two of them
interleaved, with writes on the other node.

The original's subscriber has two extra columns with local defaults; in a mesh every node has them, and
the values a node computes (c = now()) travel with the rows.
"""

from __future__ import annotations

import psycopg
import pytest

from router.testing.mesh import NODE_SETTINGS, execute, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SETTINGS = {**NODE_SETTINGS, "logical_decoding_work_mem": "64kB"}
SCHEMA = """
CREATE TABLE test_tab (a int primary key, b varchar, c timestamptz DEFAULT now(), d bigint DEFAULT 999);
INSERT INTO test_tab VALUES (1, 'foo', '2020-01-01'), (2, 'bar', '2020-01-01');
"""
COUNTS = "SELECT count(*), count(c), count(d = 999) FROM test_tab"
EPOCH = "extract(epoch from c) = 987654321"
INSERT = "INSERT INTO test_tab SELECT i, md5(i::text) FROM generate_series({}, {}) s(i)"


@pytest.mark.slow
async def test_015_stream(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, settings=SETTINGS)
    a, b = m.nodes
    async with running_router(m.config) as router:
        # two transactions over 64kB each, interleaved; b writes meanwhile
        async with await psycopg.AsyncConnection.connect(a.dsn()) as first:
            await first.execute(INSERT.format(3, 5000))
            await first.execute("UPDATE test_tab SET b = md5(b) WHERE mod(a,2) = 0")
            await first.execute("DELETE FROM test_tab WHERE mod(a,3) = 0")
            await execute(a.dsn(), "BEGIN",
                          INSERT.format(5001, 9999),
                          "DELETE FROM test_tab WHERE a > 5000", "COMMIT")
            await execute(b.dsn(), INSERT.format(20001, 20100))
            await first.commit()
        await rows_everywhere(m.nodes, COUNTS, [(3434, 3434, 3434)], 120)

        await execute(a.dsn(), "BEGIN",
                      INSERT.format(5001, 10000),
                      "UPDATE test_tab SET b = md5(b) WHERE mod(a,2) = 0",
                      "DELETE FROM test_tab WHERE mod(a,3) = 0", "COMMIT")
        # 6667 as in the original, and b's 66 rows that are not multiples of 3
        await rows_everywhere(m.nodes, COUNTS, [(6733, 6733, 6733)], 120)

        # local values of c on b, then a large update of b on a: c keeps b's values everywhere
        await execute(b.dsn(), "UPDATE test_tab SET c = 'epoch'::timestamptz + 987654321 * interval '1s'")
        await rows_everywhere(m.nodes, f"SELECT count(*) FROM test_tab WHERE {EPOCH}",
                              [(6733,)], 120)
        await execute(a.dsn(), "UPDATE test_tab SET b = md5(a::text)")
        await converge(router, m.nodes, ["test_tab"], 120)
        await rows_everywhere(
            m.nodes, f"SELECT count(*), count({EPOCH}), count(d = 999) FROM test_tab",
            [(6733, 6733, 6733)])
        healthy(router)
