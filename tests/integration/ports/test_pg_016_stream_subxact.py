"""PostgreSQL's 016_stream_subxact.pl ported to a two-node pgmesh mesh with the router running (issue
17): a transaction with savepoints, streamed by the server while in progress. PostgreSQL 15 has no
debug_logical_replication_streaming, so the transaction is made large enough to stream at
logical_decoding_work_mem = 64kB by rows in another table first; the statements on test_tab are the
original's. Written on a, then the same on b.
"""

from __future__ import annotations

import pytest

from router.testing.mesh import NODE_SETTINGS, execute, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SETTINGS = {**NODE_SETTINGS, "logical_decoding_work_mem": "64kB"}
SCHEMA = """
CREATE TABLE test_tab (a int primary key, b bytea, c timestamptz DEFAULT now(), d bigint DEFAULT 999);
INSERT INTO test_tab VALUES (1, 'foo', '2020-01-01'), (2, 'bar', '2020-01-01');
CREATE TABLE filler (id int primary key, pad text);
"""
PAD = "INSERT INTO filler SELECT i, repeat('x', 100) FROM generate_series({}, {}) i"


def steps(first: int, pad_from: int) -> list[str]:
    """The original's transaction (keys offset by `first` - 3), after 2000 filler rows."""
    out = ["BEGIN", PAD.format(pad_from, pad_from + 1999)]
    for n, (lo, hi) in enumerate([(3, 5), (6, 8), (9, 11), (12, 14), (15, 17)]):
        if n:
            out.append(f"SAVEPOINT s{n}")
        out += [
            f"INSERT INTO test_tab SELECT i, sha256(i::text::bytea) FROM generate_series({lo + first - 3},"
            f" {hi + first - 3}) s(i)",
            "UPDATE test_tab SET b = sha256(b) WHERE mod(a,2) = 0",
            "DELETE FROM test_tab WHERE mod(a,3) = 0",
        ]
    return [*out, "COMMIT"]


@pytest.mark.slow
async def test_016_stream_subxact(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, settings=SETTINGS)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), *steps(3, 1))
        counts = "SELECT count(*), count(c), count(d = 999) FROM test_tab"
        await rows_everywhere(m.nodes, counts, [(12, 12, 12)])
        await converge(router, m.nodes, ["test_tab", "filler"])
        await execute(a.dsn(), "DELETE FROM test_tab WHERE (a > 2)")
        await rows_everywhere(m.nodes, "SELECT count(*) FROM test_tab", [(2,)])
        await execute(b.dsn(), *steps(3, 10001))
        await rows_everywhere(m.nodes, "SELECT count(*) FROM test_tab", [(12,)])
        await converge(router, m.nodes, ["test_tab", "filler"])
        healthy(router)
