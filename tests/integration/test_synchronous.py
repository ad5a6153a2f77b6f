"""Synchronous replication (`synchronous = 1`, docs/synchronous.md) on three real nodes.

`pgmesh init` names the router's replication connection in each node's synchronous_standby_names; a
commit on a returns only once another node has applied it: a reader that looks right after each commit
always finds the row on b or c. With c stopped, commits on a go on (b applies them; the router's log
holds them for c). With b and c stopped, a commit on a waits in SyncRep, as with PostgreSQL's own
synchronous replication, and returns once b is back; nothing is lost.
"""

from __future__ import annotations

import asyncio

import msgspec
import psycopg
import pytest

from router.cluster.install import init_cluster
from router.cluster.synchronous import standby_names
from router.errors import PgmeshError
from router.ops.control import render_status
from router.ops.join import join_node
from router.testing.mesh import execute, fetch, free_port, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE doc (id bigint PRIMARY KEY, src text NOT NULL)"
TABLES = ["doc"]
INSERT = "INSERT INTO doc VALUES (%s, 'a')"
FOUND = "SELECT count(*) FROM doc WHERE id = %s"
# a's backends waiting for their commit to be confirmed by the synchronous standby (the router)
RELOAD = "SELECT pg_reload_conf()"
WAITING = "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"


async def test_init_names_the_router_and_status_shows_it(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, replication="synchronous = 1")
    a = m.nodes[0]
    ((names,),) = await fetch(a.dsn(), "SHOW synchronous_standby_names")
    assert names == m.config.standby_name
    async with running_router(m.config) as router:
        state = "SELECT sync_state FROM pg_stat_replication WHERE application_name = %s"
        await wait_for(lambda: _answers(a.dsn(), state, [m.config.standby_name], [("sync",)]),
                       "a's walsender to the router to be synchronous")

        def applying() -> list[list[str] | None]:
            return [s.synchronous.applying if s.synchronous is not None and s.synchronous.satisfied else None
                    for s in sorted(router.status().sources, key=lambda s: s.node)]

        await wait_for(lambda: applying() == [["b", "c"], ["a", "c"], ["a", "b"]],
                       "every node's k to be satisfied by both its targets")
        sync = next(s for s in router.status().sources if s.node == "a").synchronous
        assert sync is not None and sync.k == 1
        router.reporter.export(router)
        text = router.metrics.render()
        assert 'pgmesh_synchronous_k{node="a"} 1' in text
        assert 'pgmesh_synchronous_satisfied{node="a"} 1' in text
        assert "synchronous a: k = 1, applying: b, c" in render_status(router.status())
    # a DBA's own value that does not name the router is never overwritten: init says what to do
    await execute(a.dsn(), "ALTER SYSTEM SET synchronous_standby_names = 'standby1'", RELOAD)
    with pytest.raises(PgmeshError, match="does not name the router"):
        await standby_names(m.config, waiting=True)
    await execute(a.dsn(), f"ALTER SYSTEM SET synchronous_standby_names = '{names}'", RELOAD)
    # stepping down: synchronous = 0 and init again resets the setting pgmesh made
    down = msgspec.structs.replace(m.config, replication=msgspec.structs.replace(m.config.replication,
                                                                                 synchronous=0))
    report, lines = await init_cluster(down)
    assert report.ok and any("synchronous_standby_names reset" in line for line in lines), lines
    for node in m.nodes:
        assert await fetch(node.dsn(), "SHOW synchronous_standby_names") == [("",)], node.name


Rows = list[tuple[object, ...]]


async def _answers(dsn: str, query: str, params: list[object] | None, expected: Rows) -> bool:
    return await fetch(dsn, query, params) == expected


async def test_a_commit_returns_once_another_node_has_it(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, replication="synchronous = 1")
    a, b, c = m.nodes
    async with running_router(m.config):
        writer = await psycopg.AsyncConnection.connect(a.dsn(), autocommit=True)
        readers = [await psycopg.AsyncConnection.connect(n.dsn(), autocommit=True) for n in (b, c)]
        try:
            missed = []
            for i in range(1, 201):
                await writer.execute(INSERT, [i])
                seen = 0
                for reader in readers:
                    row = await (await reader.execute(FOUND, [i])).fetchone()
                    seen += row[0] if row else 0
                if not seen:
                    missed.append(i)
            assert not missed, f"rows on neither b nor c when their commit returned on a: {missed}"
        finally:
            for conn in [writer, *readers]:
                await conn.close()
        await wait_converged(m.nodes, TABLES)


async def test_a_node_that_loses_its_targets_waits_then_goes_on(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, replication="synchronous = 1")
    a, b, c = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), INSERT, params=[1])
        await wait_converged(m.nodes, TABLES)
        c.stop("fast")  # one target left: commits on a go on
        for i in range(2, 22):
            await asyncio.wait_for(execute(a.dsn(), INSERT, params=[i]), 60)
        assert await fetch(b.dsn(), "SELECT count(*) FROM doc") == [(21,)]
        b.stop("fast")  # none left: a commit on a waits, as with PostgreSQL's own synchronous replication
        commit = asyncio.create_task(execute(a.dsn(), INSERT, params=[100]))
        try:
            await wait_for(lambda: _answers(a.dsn(), WAITING, None, [(1,)]),
                           "the commit on a to wait for its synchronous standby")

            def unsatisfied() -> bool:
                sync = next(s for s in router.status().sources if s.node == "a").synchronous
                return sync is not None and not sync.satisfied

            await wait_for(unsatisfied, "status to say a's k is not satisfied")
            assert not commit.done()  # (still waiting: pg_stat_activity says so)
            b.start()
            await asyncio.wait_for(asyncio.shield(commit), 120)
        finally:
            if not commit.done():
                commit.cancel()
        c.start()
        await wait_converged(m.nodes, TABLES, limit=180)
        for node in m.nodes:
            assert await fetch(node.dsn(), "SELECT count(*), max(id) FROM doc") == [(22, 100)], node.name


async def test_a_joined_node_waits_for_the_router_as_the_others_do(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, replication="synchronous = 1", spares=["c"],
                   admin_port=free_port())
    a, b = m.nodes
    c = m.node("c")
    three = m.config_for(m.all_nodes)  # the router leaves c out until it joined
    async with running_router(three, reload=lambda: three):  # (as `pgmesh run` re-reads its file)
        await execute(a.dsn(), INSERT, params=[1])
        # join writes its own bookkeeping on a and b while it holds the router: none of it waits
        report = await join_node(three, "c", donor="a")
        assert report.positions.keys() == {"a", "b"}
        show = "SELECT current_setting('synchronous_standby_names')"
        assert await fetch(c.dsn(), show) == [(m.config.standby_name,)]  # set last, as `pgmesh init` does
        await execute(c.dsn(), "INSERT INTO doc VALUES (2, 'c')")  # returns once another node has it
        on = [(await fetch(n.dsn(), FOUND, params=[2]))[0][0] for n in (a, b)]
        assert 1 in on, on
        await wait_converged(m.all_nodes, TABLES)
