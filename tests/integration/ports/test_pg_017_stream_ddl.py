"""PostgreSQL's 017_stream_ddl.pl ported to a two-node pgmesh mesh with the router running (issue 17):
small and large (streamed at logical_decoding_work_mem = 64kB) transactions that add columns between
their rows. pgmesh replicates the ALTERs, so the other node starts with the original's publisher table
and gets each column from the transaction itself; b writes rows with every column at the end.
"""

from __future__ import annotations

import pytest

from router.testing.mesh import NODE_SETTINGS, execute, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SETTINGS = {**NODE_SETTINGS, "logical_decoding_work_mem": "64kB"}
SCHEMA = """
CREATE TABLE test_tab (a int primary key, b bytea);
INSERT INTO test_tab VALUES (1, 'foo'), (2, 'bar');
"""
SHA = "sha256({}::text::bytea)"


def rows(lo: int, hi: int, *extra: str) -> str:
    columns = ", ".join(["i", SHA.format("i"), *extra])
    return f"INSERT INTO test_tab SELECT {columns} FROM generate_series({lo}, {hi}) s(i)"


@pytest.mark.slow
async def test_017_stream_ddl(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, settings=SETTINGS)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "BEGIN", f"INSERT INTO test_tab VALUES (3, {SHA.format(3)})",
                      "ALTER TABLE test_tab ADD COLUMN c INT", "SAVEPOINT s1",
                      f"INSERT INTO test_tab VALUES (4, {SHA.format(4)}, -4)", "COMMIT")
        await execute(a.dsn(), "BEGIN", rows(5, 1000, "-i"), "ALTER TABLE test_tab ADD COLUMN d INT",
                      "SAVEPOINT s1", rows(1001, 2000, "-i", "2*i"), "COMMIT")
        await execute(a.dsn(), "BEGIN", rows(2001, 2001, "-i", "2*i"),
                      "ALTER TABLE test_tab ADD COLUMN e INT", "SAVEPOINT s1",
                      rows(2002, 2002, "-i", "2*i", "-3*i"), "COMMIT")
        counts = "SELECT count(*), count(c), count(d), count(e) FROM test_tab"
        await rows_everywhere(m.nodes, counts, [(2002, 1999, 1002, 1)], 120)
        # a large one whose DDL comes after its rows, then a small one that uses the new column
        await execute(a.dsn(), "BEGIN", rows(2003, 5000, "-i", "2*i", "-3*i"),
                      "ALTER TABLE test_tab ADD COLUMN f INT", "COMMIT")
        await execute(a.dsn(), "BEGIN", rows(5001, 5005, "-i", "2*i", "-3*i", "4*i"), "COMMIT")
        counts = "SELECT count(*), count(c), count(d), count(e), count(f) FROM test_tab"
        await rows_everywhere(m.nodes, counts, [(5005, 5002, 4005, 3004, 5)], 120)
        # b, with every column, small and large
        await execute(b.dsn(), rows(6001, 6005, "-i", "2*i", "-3*i", "4*i"))
        await execute(b.dsn(), "BEGIN", rows(7001, 9000, "-i", "2*i", "-3*i", "4*i"),
                      "ALTER TABLE test_tab ADD COLUMN g INT",
                      rows(9001, 9010, "-i", "2*i", "-3*i", "4*i", "5*i"), "COMMIT")
        counts = "SELECT count(*), count(f), count(g) FROM test_tab"
        await rows_everywhere(m.nodes, counts, [(7020, 2020, 10)], 120)
        await converge(router, m.nodes, ["test_tab"], 120)
        healthy(router)
