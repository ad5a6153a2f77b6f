"""A hold nobody releases (`POST /hold` from a join killed in its step) ends by itself after the router's
`hold_max_s` (router.service.supervisor): the router streams again, and nothing written meanwhile is lost."""

from __future__ import annotations

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE t (id int PRIMARY KEY, v text)"


async def test_a_hold_nobody_releases_ends_by_itself(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        router.hold_max_s = 1.0
        await execute(a.dsn(), "INSERT INTO t VALUES (1, 'before')")
        await wait_converged(m.nodes, ["t"])
        await router.hold()
        await wait_for(lambda: router._held.is_set(), "held")
        await execute(a.dsn(), "INSERT INTO t VALUES (2, 'while held')")
        await wait_for(lambda: not router._held.is_set() and router.running, "streaming again")
        await wait_for(lambda: _has(b.dsn(), 2), "the row written while held, on b")


async def _has(dsn: str, key: int) -> bool:
    return bool(await fetch(dsn, f"SELECT 1 FROM t WHERE id = {key}"))
