"""PostgreSQL's 026_stats.pl against pgmesh: the original counts apply and sync errors per subscription
(pg_stat_subscription_stats) and resets them. pgmesh's counterpart is each link's counters, which
`pgmesh status` and the metrics read: an apply error counts once and leaves the link held with it,
conflicts are counted as they are recorded, applied transactions go on after `pgmesh resume`.
"""

from __future__ import annotations

from router.testing.mesh import execute, fetch, running_router, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SCHEMA = "CREATE TABLE test_tab1 (a int PRIMARY KEY);"
LOCAL = "SET pgmesh.ddl_local = on; "


async def test_026_stats(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        link = router.appliers[("a", "b")]
        await execute(a.dsn(), "INSERT INTO test_tab1 VALUES (1)")
        await rows_everywhere(m.nodes, "SELECT count(*) FROM test_tab1", [(1,)])
        await wait_for(lambda: link.stats.applied_transactions >= 1, "a's link to b to count its transaction")
        assert link.stats.errors == 0
        # an apply error: b refuses the row
        await execute(b.dsn(), LOCAL + "ALTER TABLE test_tab1 ADD CONSTRAINT small CHECK (a < 10)")
        await execute(a.dsn(), "INSERT INTO test_tab1 VALUES (11)")
        await wait_for(lambda: link.state.value == "error", "a's link to b held on the error")
        assert link.stats.errors == 1
        status = {(x.source, x.target): x for x in router.status().links}
        assert status[("a", "b")].state == "error" and "small" in (status[("a", "b")].last_error or "")
        assert status[("b", "a")].state == "streaming" and status[("b", "a")].last_error is None
        await execute(b.dsn(), LOCAL + "ALTER TABLE test_tab1 DROP CONSTRAINT small")
        applied = link.stats.applied_transactions
        await router.resume("b")
        await rows_everywhere(m.nodes, "SELECT count(*) FROM test_tab1", [(2,)])
        await wait_for(lambda: link.stats.applied_transactions == applied + 1, "the held transaction counted")
        assert link.stats.errors == 1
        # conflicts: counted as recorded
        await router.pause(None)
        await execute(a.dsn(), "INSERT INTO test_tab1 VALUES (20)")
        await execute(b.dsn(), "INSERT INTO test_tab1 VALUES (20)")
        await router.resume(None)
        await converge(router, m.nodes, ["test_tab1"])
        history = "SELECT count(*) FROM pgmesh.conflict_history"

        async def counted_as_recorded() -> bool:
            recorded = 0
            for node in m.nodes:
                recorded += (await fetch(node.dsn(), history))[0][0]
            counted = router.conflicts_decided()
            return bool(counted == recorded >= 1)

        await wait_for(counted_as_recorded, "the conflicts counted as recorded", 20)
        healthy(router)
