"""pglogical's drop.sql, ported to a three-node pgmesh mesh (issue 17).

pglogical drops its nodes and subscriptions and checks that no slot and no walsender is left. pgmesh's
equivalent is `pgmesh part` (router stopped): the cluster forgets the node, its slot goes (no WAL held
for anyone), `--clean` removes every pgmesh object from it, and its database goes on working on its own
while the other nodes go on replicating among themselves.
"""

from __future__ import annotations

from typing import Any

from router.ops.part import part_node
from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import healthy

SCHEMA = "CREATE TABLE public.dropped (id int PRIMARY KEY, at text)"
SLOTS = "SELECT plugin, slot_type, active FROM pg_replication_slots"
PGMESH_LEFT = """SELECT
  (SELECT count(*) FROM pg_namespace WHERE nspname = 'pgmesh'),
  (SELECT count(*) FROM pg_publication),
  (SELECT count(*) FROM pg_event_trigger),
  (SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'pgmesh%'),
  (SELECT count(*) FROM pg_replication_origin),
  (SELECT count(*) FROM pg_replication_slots)"""


async def _origins(node: Any) -> list[str]:
    return [r[0] for r in await fetch(node.dsn(), "SELECT roname FROM pg_replication_origin ORDER BY roname")]


async def test_drop(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA)
    a, b, c = m.nodes
    async with running_router(m.config) as router:
        for i, node in enumerate(m.nodes):
            await execute(node.dsn(), f"INSERT INTO dropped VALUES ({i}, '{node.name}')")
        await wait_converged(m.nodes, ["dropped"])
        healthy(router)

    async def walsenders_gone() -> bool:  # a walsender ends after its client has gone, not with it
        counts = [await fetch(n.dsn(), "SELECT count(*) FROM pg_stat_replication") for n in m.nodes]
        return all(count == [(0,)] for count in counts)

    await wait_for(walsenders_gone, "the router's walsenders to end", limit=30)
    for node in m.nodes:  # the router is gone: nothing streams, every slot stays
        assert await fetch(node.dsn(), SLOTS) == [("pgoutput", "logical", False)]
        assert await fetch(node.dsn(), "SELECT count(*) FROM pg_stat_replication") == [(0,)]
    origins_of_c = [o for o in await _origins(a) if o.startswith(m.config.origin_name("c"))]
    assert origins_of_c, await _origins(a)

    lines = await part_node(m.config, "c", clean=True)
    assert any(line.startswith("node a: dropped replication origin") for line in lines), lines
    assert await fetch(c.dsn(), PGMESH_LEFT) == [(0, 0, 0, 0, 0, 0)]
    for node in (a, b):
        assert not set(origins_of_c) & set(await _origins(node))
        assert await fetch(node.dsn(), SLOTS) == [("pgoutput", "logical", False)]
    # c works on its own: its rows stay, DDL and writes there are local
    await execute(c.dsn(), "ALTER TABLE dropped ADD COLUMN only_c int",
                  "INSERT INTO dropped VALUES (10, 'c alone', 1)")
    assert await fetch(c.dsn(), "SELECT count(*) FROM dropped") == [(4,)]

    rest = m.config_for([a, b])
    async with running_router(rest) as router:
        await execute(a.dsn(), "INSERT INTO dropped VALUES (20, 'a after')")
        await execute(b.dsn(), "INSERT INTO dropped VALUES (21, 'b after')")
        await wait_converged([a, b], ["dropped"])
        assert await fetch(b.dsn(), "SELECT id FROM dropped ORDER BY id") == [(0,), (1,), (2,), (20,), (21,)]
        healthy(router)
    assert await fetch(c.dsn(), "SELECT id FROM dropped ORDER BY id") == [(0,), (1,), (2,), (10,)]

    # parting without --clean: the slot goes (no WAL held), pgmesh's schema stays
    lines = await part_node(rest, "b")
    assert f"node b: dropped slot {rest.slot_name} (it holds no WAL any more)" in lines, lines
    assert await fetch(b.dsn(), "SELECT count(*) FROM pg_replication_slots") == [(0,)]
    assert await fetch(b.dsn(), "SELECT count(*) FROM pg_namespace WHERE nspname = 'pgmesh'") == [(1,)]
    assert await fetch(a.dsn(), "SELECT count(*) FROM pg_stat_replication") == [(0,)]
