"""pglogical's node_origin_cascade.sql, ported to a three-node pgmesh mesh with the router running (issue 17).

pglogical chains three nodes (orig_provider -> provider -> subscriber, `forward_origins := '{}'`): a row
reaches the next node only, and is not forwarded. In a pgmesh mesh every node's changes go from that node
straight to every other node, and a change applied on a node is never sent on (it carries a replication
origin: no echo, no cascade). So: a writes the "top level" table, b the "mid level" one (made by DDL on
a and b), every node ends with both, each row applied once per other node, and each applied row carries
the origin of the node that wrote it (c got a's rows from a, not through b).
"""

from __future__ import annotations

from typing import Any

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import healthy

TABLE = """CREATE TABLE public.{name} (
    id serial primary key,
    other integer,
    data text,
    something interval
)"""
INSERT = """INSERT INTO {name}(other, data, something)
VALUES (5, 'foo', '1 minute'::interval),
       (4, 'bar', '12 weeks'::interval),
       (3, 'baz', '2 years 1 hour'::interval),
       (2, 'qux', '8 months 2 days'::interval),
       (1, NULL, NULL)"""
# which origin each row was applied under, here (0: written here)
ORIGINS = """SELECT coalesce(o.roname, 'local'), count(*)
FROM {name} t
LEFT JOIN pg_replication_origin o ON o.roident = (pg_xact_commit_timestamp_origin(t.xmin)).roident
GROUP BY 1 ORDER BY 1"""


async def _everywhere(nodes: list[Any], query: str) -> bool:
    for node in nodes:
        if await fetch(node.dsn(), query) != [(True,)]:
            return False
    return True


async def test_node_origin_cascade(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3)
    a, b, c = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), TABLE.format(name="top_level_tbl"))
        await execute(b.dsn(), TABLE.format(name="mid_level_tbl"))
        made = "SELECT to_regclass('top_level_tbl') IS NOT NULL AND to_regclass('mid_level_tbl') IS NOT NULL"
        await wait_for(lambda: _everywhere(m.nodes, made), "both tables on every node")

        await execute(a.dsn(), INSERT.format(name="top_level_tbl"))
        await execute(b.dsn(), INSERT.format(name="mid_level_tbl"))
        await wait_converged(m.nodes, ["top_level_tbl", "mid_level_tbl"])
        for name in ("top_level_tbl", "mid_level_tbl"):
            rows = await fetch(c.dsn(), f"SELECT id, other, data, something::text FROM {name} ORDER BY id")
            assert rows == [
                (1, 5, "foo", "00:01:00"), (2, 4, "bar", "84 days"), (3, 3, "baz", "2 years 01:00:00"),
                (4, 2, "qux", "8 mons 2 days"), (5, 1, None, None),
            ], (name, rows)

        from_a, from_b = m.config.origin_name("a"), m.config.origin_name("b")
        assert await fetch(c.dsn(), ORIGINS.format(name="top_level_tbl")) == [(from_a, 5)]
        assert await fetch(c.dsn(), ORIGINS.format(name="mid_level_tbl")) == [(from_b, 5)]
        assert await fetch(b.dsn(), ORIGINS.format(name="top_level_tbl")) == [(from_a, 5)]
        assert await fetch(a.dsn(), ORIGINS.format(name="top_level_tbl")) == [("local", 5)]
        assert await fetch(a.dsn(), ORIGINS.format(name="mid_level_tbl")) == [(from_b, 5)]
        # one transaction of rows per link from its writer, none through a third node, none back
        rows = {name: applier.stats.applied_rows for name, applier in router.appliers.items()}
        assert rows[("a", "c")] == rows[("a", "b")] == rows[("b", "a")] == rows[("b", "c")] == 5, rows
        assert rows[("c", "a")] == rows[("c", "b")] == 0, rows

        await execute(a.dsn(), "DROP TABLE public.top_level_tbl CASCADE")
        await execute(b.dsn(), "DROP TABLE public.mid_level_tbl CASCADE")
        gone = "SELECT to_regclass('top_level_tbl') IS NULL AND to_regclass('mid_level_tbl') IS NULL"
        await wait_for(lambda: _everywhere(m.nodes, gone), "both tables dropped everywhere")
        healthy(router)
