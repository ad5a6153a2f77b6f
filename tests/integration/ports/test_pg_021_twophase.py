"""PostgreSQL's 021_twophase.pl ported to a two-node pgmesh mesh with the router running (issue 17).

By design pgmesh decodes without two_phase: a prepared transaction reaches the other nodes when it is
committed (COMMIT PREPARED), never as a prepared transaction there (no pg_prepared_xacts row on the
other node, nothing held open there), and ROLLBACK PREPARED sends nothing. The data after COMMIT or
ROLLBACK PREPARED is what the original expects, also across crashes of either node.
"""

from __future__ import annotations

import asyncio

from router.testing.mesh import NODE_SETTINGS, execute, fetch, running_router, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SETTINGS = {**NODE_SETTINGS, "max_prepared_transactions": "10"}
SCHEMA = """
CREATE TABLE tab_full (a int PRIMARY KEY);
CREATE TABLE tab_copy (a int PRIMARY KEY);
"""
PREPARED = "SELECT count(*) FROM pg_prepared_xacts"


def prepare_two(first: int, second: int) -> list[str]:
    """Two rows inserted and prepared as 'test_prepared_tab'."""
    return ["BEGIN", f"INSERT INTO tab_full VALUES ({first})", f"INSERT INTO tab_full VALUES ({second})",
            "PREPARE TRANSACTION 'test_prepared_tab'"]


def count(where: str) -> str:
    return f"SELECT count(*) FROM tab_full WHERE {where}"


async def test_021_twophase(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, settings=SETTINGS)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "BEGIN", "INSERT INTO tab_full SELECT generate_series(1,10)",
                      "PREPARE TRANSACTION 'some_initial_data'", "COMMIT PREPARED 'some_initial_data'")
        await rows_everywhere(m.nodes, "SELECT count(*) FROM tab_full", [(10,)])

        # prepared on a: nothing on b until COMMIT PREPARED
        await execute(a.dsn(), "BEGIN", "INSERT INTO tab_full VALUES (11)",
                      "PREPARE TRANSACTION 'test_prepared_tab_full'")
        await execute(b.dsn(), "INSERT INTO tab_full VALUES (100)")  # b goes on meanwhile
        await rows_everywhere(m.nodes, count("a = 100"), [(1,)])
        assert await fetch(b.dsn(), PREPARED) == [(0,)]
        assert await fetch(b.dsn(), count("a = 11")) == [(0,)]
        await execute(a.dsn(), "COMMIT PREPARED 'test_prepared_tab_full'")
        await rows_everywhere(m.nodes, count("a = 11"), [(1,)])

        # ROLLBACK PREPARED, and a transaction prepared on b
        await execute(a.dsn(), "BEGIN", "INSERT INTO tab_full VALUES (12)",
                      "PREPARE TRANSACTION 'test_prepared_tab_full'")
        await execute(b.dsn(), "BEGIN", "INSERT INTO tab_full VALUES (101)", "PREPARE TRANSACTION 'on_b'")
        await execute(a.dsn(), "ROLLBACK PREPARED 'test_prepared_tab_full'")
        await execute(b.dsn(), "COMMIT PREPARED 'on_b'")
        await rows_everywhere(m.nodes, count("a IN (12, 101)"), [(1,)])
        assert await fetch(a.dsn(), count("a = 12")) == [(0,)]

        # a crash of both nodes with a transaction prepared on a, rolled back after the restart
        await execute(a.dsn(), *prepare_two(12, 13))
        await asyncio.to_thread(b.restart, "immediate")
        await asyncio.to_thread(a.restart, "immediate")
        await execute(a.dsn(), "ROLLBACK PREPARED 'test_prepared_tab'")
        # ... then committed after the restart
        await execute(a.dsn(), *prepare_two(12, 13))
        await asyncio.to_thread(b.restart, "immediate")
        await asyncio.to_thread(a.restart, "immediate")
        await execute(a.dsn(), "COMMIT PREPARED 'test_prepared_tab'")
        await rows_everywhere(m.nodes, count("a IN (12, 13)"), [(2,)])
        # the subscriber alone, then the publisher alone
        await execute(a.dsn(), *prepare_two(14, 15))
        await asyncio.to_thread(b.restart, "immediate")
        await execute(a.dsn(), "COMMIT PREPARED 'test_prepared_tab'")
        await rows_everywhere(m.nodes, count("a IN (14, 15)"), [(2,)])
        await execute(a.dsn(), *prepare_two(16, 17))
        await asyncio.to_thread(a.restart, "immediate")
        await execute(a.dsn(), "COMMIT PREPARED 'test_prepared_tab'")
        await rows_everywhere(m.nodes, count("a IN (16, 17)"), [(2,)])

        # a subtransaction rolled back inside a prepared one
        await execute(a.dsn(), "BEGIN", "INSERT INTO tab_full VALUES (21)", "SAVEPOINT sp_inner",
                      "INSERT INTO tab_full VALUES (22)", "ROLLBACK TO SAVEPOINT sp_inner",
                      "PREPARE TRANSACTION 'outer'")
        await execute(a.dsn(), "COMMIT PREPARED 'outer'")
        await rows_everywhere(m.nodes, "SELECT a FROM tab_full WHERE a IN (21, 22)", [(21,)])
        # an empty GID
        await execute(a.dsn(), "BEGIN", "INSERT INTO tab_full VALUES (51)", "PREPARE TRANSACTION ''")
        await execute(a.dsn(), "ROLLBACK PREPARED ''")
        # a table with rows only b had before (the original's copy_data = false), a prepared insert
        await execute(b.dsn(), "INSERT INTO tab_copy VALUES (88)")
        await execute(a.dsn(), "BEGIN", "INSERT INTO tab_copy VALUES (99)", "PREPARE TRANSACTION 'mygid'")
        await execute(a.dsn(), "COMMIT PREPARED 'mygid'")
        await rows_everywhere(m.nodes, "SELECT a FROM tab_copy ORDER BY a", [(88,), (99,)])

        async def streaming() -> bool:
            return all(x.state.value == "streaming" for x in router.appliers.values())

        await wait_for(streaming, "every link streaming after the crashes")
        await converge(router, m.nodes, ["tab_full", "tab_copy"])
        for node in m.nodes:
            assert await fetch(node.dsn(), PREPARED) == [(0,)]
            assert await fetch(node.dsn(), count("a = 51")) == [(0,)]
        healthy(router)
