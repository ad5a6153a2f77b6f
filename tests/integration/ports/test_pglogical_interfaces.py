"""pglogical's interfaces.sql, ported to a two-node pgmesh mesh (issue 17).

pglogical adds a second interface (a DSN as another superuser, `super2`) to the provider node and
switches the subscription to it and back. pgmesh's equivalent is the node's `dsn` in config.toml: the
router is started with every node reached as `super2`, then again as the original user; each time the
walsender serves that user, the slot is the same one, and rows flow both ways.
"""

from __future__ import annotations

from typing import Any

from router.config.model import Config, parse_config
from router.testing.mesh import execute, fetch, running_router, wait_converged
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import healthy

SCHEMA = "CREATE TABLE public.iface (id int PRIMARY KEY, via text)"
SLOTS = "SELECT plugin, slot_type, active FROM pg_replication_slots"
SENDERS = "SELECT usename FROM pg_stat_replication"


async def _round(config: Config, nodes: list[Any], user: str, first: int) -> None:
    a, b = nodes
    async with running_router(config) as router:
        await execute(a.dsn(), f"INSERT INTO iface VALUES ({first}, '{user} from a')")
        await execute(b.dsn(), f"INSERT INTO iface VALUES ({first + 1}, '{user} from b')")
        await wait_converged(nodes, ["iface"])
        for node in nodes:
            assert await fetch(node.dsn(), SLOTS) == [("pgoutput", "logical", True)]
            assert await fetch(node.dsn(), SENDERS) == [(user,)]
        healthy(router)


async def test_interfaces(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    for node in m.nodes:  # roles are per server (never replicated): made on each node
        await execute(node.dsn(), "CREATE USER super2 SUPERUSER")
    as_super2 = parse_config(m.config_text().replace("user=postgres", "user=super2"))
    assert all("user=super2" in node.dsn for node in as_super2.nodes)

    await _round(as_super2, m.nodes, "super2", 1)
    await _round(m.config, m.nodes, "postgres", 3)
    rows = await fetch(m.nodes[1].dsn(), "SELECT id, via FROM iface ORDER BY id")
    assert rows == [
        (1, "super2 from a"), (2, "super2 from b"), (3, "postgres from a"), (4, "postgres from b")]

    for node in m.nodes:
        await execute(node.dsn(), "DROP USER super2")
        assert await fetch(node.dsn(), "SELECT plugin, slot_type FROM pg_replication_slots") == [
            ("pgoutput", "logical")]
