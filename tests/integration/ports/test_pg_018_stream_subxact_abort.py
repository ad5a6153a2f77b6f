"""PostgreSQL's 018_stream_subxact_abort.pl ported to a two-node pgmesh mesh with the router running
(issue 17): savepoints rolled back (in order, out of order, and the whole transaction) in transactions
streamed in progress. PostgreSQL 15 has no debug_logical_replication_streaming: 2000 filler rows first
make each one stream at logical_decoding_work_mem = 64kB; the statements on test_tab are the original's.
Each case runs on a, then on b.
"""

from __future__ import annotations

import pytest

from router.testing.mesh import NODE_SETTINGS, execute, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SETTINGS = {**NODE_SETTINGS, "logical_decoding_work_mem": "64kB"}
SCHEMA = """
CREATE TABLE test_tab (a int primary key, b bytea, c INT, d INT, e INT);
INSERT INTO test_tab VALUES (1, 'foo'), (2, 'bar');
CREATE TABLE test_tab_2 (a int);
ALTER TABLE test_tab_2 REPLICA IDENTITY FULL;
CREATE TABLE filler (id int primary key, pad text);
"""
COUNTS = "SELECT count(*), count(c) FROM test_tab"


def ins(n: int) -> str:
    return f"INSERT INTO test_tab VALUES ({n}, sha256({n}::text::bytea))"


def pad(start: int) -> str:
    return f"INSERT INTO filler SELECT i, repeat('x', 100) FROM generate_series({start}, {start + 1999}) i"


CASES = [
    # rollbacks to savepoints, in order
    ([ins(3), "SAVEPOINT s1", ins(4), "SAVEPOINT s2", ins(5), "SAVEPOINT s3", ins(6), "ROLLBACK TO s2",
      ins(7), "ROLLBACK TO s1", ins(8), "SAVEPOINT s4", ins(9), "SAVEPOINT s5", ins(10), "COMMIT"], (6, 0)),
    # a release, then a rollback to an outer savepoint
    ([ins(11), "SAVEPOINT s1", ins(12), "SAVEPOINT s2", ins(13), "SAVEPOINT s3", ins(14), "RELEASE s2",
      ins(15), "ROLLBACK TO s1", "COMMIT"], (7, 0)),
    # the whole transaction rolled back
    ([ins(16), "SAVEPOINT s1", ins(17), "SAVEPOINT s2", ins(18), "ROLLBACK"], (7, 0)),
]


@pytest.mark.slow
async def test_018_stream_subxact_abort(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, settings=SETTINGS)
    a, b = m.nodes
    async with running_router(m.config) as router:
        for round_, node in enumerate((a, b)):
            for n, (statements, expected) in enumerate(CASES):
                await execute(node.dsn(), "BEGIN", pad(round_ * 100000 + n * 10000 + 1), *statements)
                await rows_everywhere(m.nodes, COUNTS, [expected], 120)
            await converge(router, m.nodes, ["test_tab", "filler"], 120)
            await execute(node.dsn(), "DELETE FROM test_tab WHERE (a > 2)")
            await rows_everywhere(m.nodes, COUNTS, [(2, 0)])
        # test_tab_2: a streamed transaction rolled back, then one with a subtransaction rolled back
        await execute(a.dsn(), "BEGIN", pad(900001), "INSERT INTO test_tab_2 values(1)", "ROLLBACK")
        await execute(b.dsn(), "BEGIN", pad(910001), "INSERT INTO test_tab_2 values(1)", "SAVEPOINT sp",
                      "INSERT INTO test_tab_2 values(1)", "ROLLBACK TO sp", "COMMIT")
        await rows_everywhere(m.nodes, "SELECT count(*) FROM test_tab_2", [(1,)], 120)
        await converge(router, m.nodes, ["test_tab", "test_tab_2", "filler"], 120)
        healthy(router)
