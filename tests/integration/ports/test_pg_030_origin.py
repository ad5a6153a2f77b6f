"""PostgreSQL's 030_origin.pl ported to a three-node pgmesh mesh with the router running (issue 17).

The original sets up A <-> B with `origin = none` (no infinite recursion), adds C -> B and checks that C's
rows reach B but not A (origin none), then that an update or delete of a row last written by another
origin is detected (update_origin_differs, delete_origin_differs). In a mesh every node receives every
node's transactions directly and never a replay (no echo): C's rows reach A from C itself, once. The
conflicts are recorded in pgmesh.conflict_history and decided alike everywhere.
"""

from __future__ import annotations

import pytest

from protocol.lsn import datetime_to_pg_us
from router.testing.mesh import execute, fetch, running_router, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import conflicts, converge, healthy, rows_everywhere

SCHEMA = "CREATE TABLE tab (a int PRIMARY KEY);"
ROWS = "SELECT * FROM tab ORDER BY 1"


@pytest.mark.slow
async def test_030_origin(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA)
    a, b, c = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO tab VALUES (11);")
        await execute(b.dsn(), "INSERT INTO tab VALUES (21);")
        await rows_everywhere(m.nodes, ROWS, [(11,), (21,)])
        await execute(a.dsn(), "DELETE FROM tab;")
        await rows_everywhere(m.nodes, ROWS, [])
        # C's row reaches A and B once each: every link applied exactly C's one transaction
        before = {k: x.stats.applied_transactions for k, x in router.appliers.items()}
        await execute(c.dsn(), "INSERT INTO tab VALUES (32);")
        await rows_everywhere(m.nodes, ROWS, [(32,)])
        await converge(router, m.nodes, ["tab"])
        moved = {k: x.stats.applied_transactions - before[k] for k, x in router.appliers.items()}
        assert moved == {k: (1 if k[0] == "c" else 0) for k in moved}, moved
        echoes = sum(p.stats.echoes for p in router.pumps.values())
        ((version,),) = await fetch(c.dsn(), "SELECT current_setting('server_version_num')::int")
        if version < 160000:
            assert echoes >= 2, echoes  # b's and a's replays of C's row were seen and not sent on
        else:
            # 16+ (origin 'none'): no replay is decoded or sent; a's and b's appliers' pgmesh.applied
            # notes of C's row come in their streams instead
            assert echoes == 0, echoes
            ((when,),) = await fetch(c.dsn(), "SELECT pg_xact_commit_timestamp(xmin) FROM tab")
            for node in (a, b):
                pump = router.pumps[node.name]
                await wait_for(lambda p=pump: dict(p.seen.snapshot).get("c", 0) >= datetime_to_pg_us(when),
                               f"{node.name}'s seen vector to hold C's commit")

        # a row written by A, updated by C while B has not heard of C's change yet
        await execute(b.dsn(), "DELETE FROM tab;")
        await rows_everywhere(m.nodes, ROWS, [])
        await execute(a.dsn(), "INSERT INTO tab VALUES (32);")
        await rows_everywhere(m.nodes, ROWS, [(32,)])
        await router.pause("b")
        await execute(b.dsn(), "INSERT INTO tab VALUES (40);")  # b writes meanwhile
        await execute(c.dsn(), "UPDATE tab SET a = 33 WHERE a = 32;")
        await router.resume("b")
        await rows_everywhere(m.nodes, ROWS, [(33,), (40,)])
        await execute(b.dsn(), "DELETE FROM tab;")
        await rows_everywhere(m.nodes, ROWS, [])
        await execute(a.dsn(), "INSERT INTO tab VALUES (33);")
        await rows_everywhere(m.nodes, ROWS, [(33,)])
        await execute(c.dsn(), "DELETE FROM tab WHERE a = 33;")
        await rows_everywhere(m.nodes, ROWS, [])
        await converge(router, m.nodes, ["tab"])
        healthy(router)


async def test_030_origin_differs_is_recorded(mesh: MeshFactory) -> None:
    """Two nodes update the same row while the links are held: each node meets a row last written by
    another origin; the conflicts are recorded and the later update wins on both."""
    m = await mesh(nodes=2, schema=SCHEMA + "CREATE TABLE kv (k int PRIMARY KEY, v text);")
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO kv VALUES (1, 'a'), (2, 'a')")
        await rows_everywhere(m.nodes, "SELECT count(*) FROM kv", [(2,)])
        await router.pause(None)
        await execute(a.dsn(), "UPDATE kv SET v = 'a2' WHERE k = 1")
        await execute(b.dsn(), "UPDATE kv SET v = 'b2' WHERE k = 1")
        await execute(b.dsn(), "DELETE FROM kv WHERE k = 2")
        await execute(a.dsn(), "UPDATE kv SET v = 'a3' WHERE k = 2")
        await router.resume(None)
        await converge(router, m.nodes, ["kv"])
        assert await fetch(a.dsn(), "SELECT * FROM kv ORDER BY k") == [(1, "b2"), (2, "a3")]
        healthy(router)
    found = await conflicts(m.nodes, "public.kv")
    assert "update_origin_differs" in found and "delete_origin_differs" in found, found
