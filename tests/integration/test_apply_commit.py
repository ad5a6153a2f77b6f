"""`replication.apply_synchronous_commit`: the appliers' sessions commit as configured.

A target whose `synchronous_standby_names` names a standby that never connects makes the difference
visible: with "off" (the default, as the native apply worker) applied transactions do not wait for it and
keep flowing; with "on" the applier's session waits on it (wait event SyncRep) after its first commit,
until the setting is cleared. (The standby is named after `pgmesh init`, whose own commits would wait.)
"""

from __future__ import annotations

import pytest

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE kv (id int PRIMARY KEY, v text);"
WAITING = "SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE wait_event = 'SyncRep'"


@pytest.mark.parametrize("mode", ["off", "on"])
async def test_the_appliers_commit_as_configured(mesh: MeshFactory, mode: str) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, replication=f'apply_synchronous_commit = "{mode}"')
    a, b = m.nodes
    # after init (whose own commits would wait for it): a synchronous standby on b that never comes
    await execute(b.dsn(), "ALTER SYSTEM SET synchronous_standby_names = 'ghost'", "SELECT pg_reload_conf()")
    async with running_router(m.config):
        await execute(a.dsn(), "INSERT INTO kv VALUES (1, 'x')")
        if mode == "off":
            await execute(a.dsn(), "INSERT INTO kv VALUES (2, 'y')")
            await wait_converged(m.nodes, ["kv"], 60)
            assert (await fetch(b.dsn(), WAITING))[0][0] == 0
            return

        async def waits() -> bool:
            return int((await fetch(b.dsn(), WAITING))[0][0]) >= 1

        await wait_for(waits, "b's applier session to wait for its synchronous standby", 60)
        await execute(b.dsn(), "ALTER SYSTEM SET synchronous_standby_names = ''", "SELECT pg_reload_conf()")
        await execute(a.dsn(), "INSERT INTO kv VALUES (2, 'y')")
        await wait_converged(m.nodes, ["kv"], 60)
