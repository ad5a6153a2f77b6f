"""PostgreSQL's 005_encoding.pl ported to a two-node pgmesh mesh with the router running (issue 17): a
UTF8 database on a, a LATIN1 one on b. Text is converted by each server (pgmesh applies in the target's
client encoding conversion like any client); a character LATIN1 cannot hold pauses the link into b with
the server's error (SQLSTATE 22P05) naming node and table; nothing is skipped.
"""

from __future__ import annotations

from typing import Any

from router.testing.mesh import execute, fetch, prepare_mesh, running_router, wait_for
from tests.fix_cluster import NodeFactory
from tests.integration.ports.common import healthy, rows_everywhere

SCHEMA = "CREATE TABLE test1 (a int primary key, b text);"


class Database:
    """One database of a node, as the mesh sees a node (a name and a DSN)."""

    def __init__(self, node: Any, dbname: str) -> None:
        self.node, self.name, self.dbname = node, node.name, dbname

    def dsn(self) -> str:
        return str(self.node.dsn(dbname=self.dbname))


async def test_005_encoding(pg_nodes: NodeFactory) -> None:
    a, node_b = pg_nodes(names=["a", "b"])
    await execute(node_b.dsn(dbname="postgres"),
                  "CREATE DATABASE latin ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
    b = Database(node_b, "latin")
    m = await prepare_mesh([a, b], SCHEMA)
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO test1 VALUES (1, 'Motörhead')")
        await execute(b.dsn(), "INSERT INTO test1 VALUES (2, 'Ærøskøbing')")
        expected = [(1, "Motörhead"), (2, "Ærøskøbing")]
        await rows_everywhere(m.nodes, "SELECT a, b FROM test1 ORDER BY a", expected)
        latin1 = "SELECT a FROM test1 WHERE b = E'Mot\\xf6rhead'"  # the LATIN1 byte of ö
        assert await fetch(b.dsn(), latin1) == [(1,)]
        healthy(router)
        # a character LATIN1 has not
        link = router.appliers[("a", "b")]
        await execute(a.dsn(), "INSERT INTO test1 VALUES (3, '10 €')")
        await wait_for(lambda: link.state.value == "error", "a's link to b to pause")
        error = link.last_error or ""
        assert "node b" in error and "22P05" in error, error
        assert await fetch(b.dsn(), "SELECT count(*) FROM test1") == [(2,)]


async def test_005_encoding_ddl_from_a_latin1_node(pg_nodes: NodeFactory) -> None:
    a, node_b = pg_nodes(names=["a", "b"])
    await execute(node_b.dsn(dbname="postgres"),
                  "CREATE DATABASE latin ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
    b = Database(node_b, "latin")
    m = await prepare_mesh([a, b], SCHEMA)
    async with running_router(m.config) as router:
        await execute(b.dsn(), "COMMENT ON TABLE test1 IS 'Motörhead'")
        await rows_everywhere(m.nodes, "SELECT obj_description('test1'::regclass)", [("Motörhead",)], 20)
        healthy(router)
