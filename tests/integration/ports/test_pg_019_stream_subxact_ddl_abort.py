"""PostgreSQL's 019_stream_subxact_ddl_abort.pl ported to a two-node pgmesh mesh with the router running
(issue 17): a transaction streamed in progress (made large enough by filler rows first) that adds and
drops columns between savepoints, then rolls back to the first one: only the DDL before it stays. The
ALTERs are replicated by pgmesh, so the other node starts with the original's publisher table.
"""

from __future__ import annotations

import pytest

from router.testing.mesh import NODE_SETTINGS, execute, fetch, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SETTINGS = {**NODE_SETTINGS, "logical_decoding_work_mem": "64kB"}
SCHEMA = """
CREATE TABLE test_tab (a int primary key, b bytea);
INSERT INTO test_tab VALUES (1, 'foo'), (2, 'bar');
CREATE TABLE filler (id int primary key, pad text);
"""
COLUMNS = "SELECT string_agg(attname, ',' ORDER BY attnum) FROM pg_attribute" \
          " WHERE attrelid = 'test_tab'::regclass AND attnum > 0 AND NOT attisdropped"


def sha(n: int) -> str:
    return f"sha256({n}::text::bytea)"


@pytest.mark.slow
async def test_019_stream_subxact_ddl_abort(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, settings=SETTINGS)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(
            a.dsn(), "BEGIN",
            "INSERT INTO filler SELECT i, repeat('x', 100) FROM generate_series(1, 2000) i",
            f"INSERT INTO test_tab VALUES (3, {sha(3)})",
            "ALTER TABLE test_tab ADD COLUMN c INT",
            "SAVEPOINT s1",
            f"INSERT INTO test_tab VALUES (4, {sha(4)}, -4)",
            "ALTER TABLE test_tab ADD COLUMN d INT",
            "SAVEPOINT s2",
            f"INSERT INTO test_tab VALUES (5, {sha(5)}, -5, 5*2)",
            "ALTER TABLE test_tab ADD COLUMN e INT",
            "SAVEPOINT s3",
            f"INSERT INTO test_tab VALUES (6, {sha(6)}, -6, 6*2, -6*3)",
            "ALTER TABLE test_tab DROP COLUMN c",
            "ROLLBACK TO s1",
            f"INSERT INTO test_tab VALUES (4, {sha(4)}, 4)",
            "COMMIT",
        )
        await rows_everywhere(m.nodes, "SELECT count(*), count(c) FROM test_tab", [(4, 1)], 120)
        await rows_everywhere(m.nodes, COLUMNS, [("a,b,c",)])
        await execute(b.dsn(), f"INSERT INTO test_tab VALUES (7, {sha(7)}, 7)")
        await rows_everywhere(m.nodes, "SELECT count(*), count(c) FROM test_tab", [(5, 2)])
        await converge(router, m.nodes, ["test_tab", "filler"], 120)
        with_c = "SELECT a, c FROM test_tab WHERE c IS NOT NULL ORDER BY a"
        assert await fetch(a.dsn(), with_c) == [(4, 4), (7, 7)]
        healthy(router)
