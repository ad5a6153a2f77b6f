"""pglogical's multiple_upstreams.sql, ported to a three-node pgmesh mesh with the router running (issue 17).

pglogical subscribes one node to two providers that each write their own rows of one table (with a
second unique key). In a mesh every node is upstream of the others: a and c write their rows, b gets
both sets once, and its own row reaches both. Each node has one slot, read by the router.
"""

from __future__ import annotations

from typing import Any

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import healthy

TABLE = "CREATE TABLE public.multi_ups_tbl(id integer primary key, key text unique not null, data text)"
ROWS = "SELECT id, key, data FROM multi_ups_tbl ORDER BY id"


async def _everywhere(nodes: list[Any], query: str, expected: Any) -> bool:
    for node in nodes:
        if await fetch(node.dsn(), query) != expected:
            return False
    return True


async def test_multiple_upstreams(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3)
    a, b, c = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), TABLE)
        made = "SELECT to_regclass('public.multi_ups_tbl') IS NOT NULL"
        await wait_for(lambda: _everywhere(m.nodes, made, [(True,)]), "multi_ups_tbl on every node")

        for i in (1, 2, 3):
            await execute(a.dsn(), f"INSERT INTO multi_ups_tbl VALUES({i}, 'key{i}', 'data{i}')")
        for i in (4, 5, 6):
            await execute(c.dsn(), f"INSERT INTO multi_ups_tbl VALUES({i}, 'key{i}', 'data{i}')")
        await execute(b.dsn(), "INSERT INTO multi_ups_tbl VALUES(7, 'key7', 'data7 from b')")
        await wait_converged(m.nodes, ["multi_ups_tbl"])
        assert await fetch(b.dsn(), ROWS) == [
            *((i, f"key{i}", f"data{i}") for i in range(1, 7)), (7, "key7", "data7 from b")]
        # each change was applied once per other node: no conflict (an echo would be one)
        assert sum(applier.stats.conflicts for applier in router.appliers.values()) == 0

        for node in m.nodes:
            assert await fetch(node.dsn(), "SELECT plugin, slot_type, active FROM pg_replication_slots") == [
                ("pgoutput", "logical", True)]
            assert await fetch(node.dsn(), "SELECT count(*) FROM pg_stat_replication") == [(1,)]

        await execute(a.dsn(), "DROP TABLE public.multi_ups_tbl CASCADE")
        gone = "SELECT to_regclass('public.multi_ups_tbl') IS NULL"
        await wait_for(lambda: _everywhere(m.nodes, gone, [(True,)]), "multi_ups_tbl dropped everywhere")
        healthy(router)
