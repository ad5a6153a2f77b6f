"""A transaction rolled back after its origin set-up is not taken for applied (router.progress.applied).

On PostgreSQL 16+ such a rollback still moves the origin to the LSN the set-up gave it: a backend ends
that way when the router is killed while a batch is in the server's hands, on SIGTERM (a fast shutdown,
`pg_terminate_backend`) or on an error at COMMIT. The test makes that happen on purpose: an applier
session of the router's own kind applies a source transaction, runs the router's own set-up statement
and is terminated before COMMIT. The router started afterwards must still apply the transaction.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import psycopg
import pytest

from protocol.lsn import parse_lsn
from router.apply.sessions import open_session, take_origin
from router.apply.statements import setup_statement
from router.cluster.install import init_cluster
from router.errors import ConfigError
from router.progress.applied import MARK_START
from router.service.supervisor import Router
from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE kv (id bigint PRIMARY KEY, v text NOT NULL);"
PROGRESS = "SELECT pg_catalog.pg_replication_origin_progress(%s, false)::text"


async def test_a_rollback_after_the_setup_leaves_the_transaction_to_apply(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    await execute(a.dsn(), "INSERT INTO kv VALUES (1, 'from a')")
    (row,) = await fetch(a.dsn(), "SELECT pg_catalog.pg_current_wal_lsn()::text")
    past = str(row[0])  # at or after the end of a's transaction: a position that skips it
    origin = m.config.origin_name("a")
    session = await open_session(b.dsn(), source="a")
    try:
        major = session.get_server_version().major
        if major >= 16:  # as the applier's connection does (router.apply.link.LinkSession.open)
            await session.execute(MARK_START, origin, "a")
        await take_origin(session, origin)
        pid = await session.fetchval("SELECT pg_catalog.pg_backend_pid()")
        await session.execute("BEGIN")
        await session.execute("INSERT INTO kv VALUES (1, 'from a')")
        await session.execute(setup_statement(f"'{past}'", "now()", None, major >= 16))
        await execute(b.dsn(), f"SELECT pg_catalog.pg_terminate_backend({pid})")  # before COMMIT

        async def gone() -> bool:
            rows = await fetch(b.dsn(), f"SELECT 1 FROM pg_catalog.pg_stat_activity WHERE pid = {pid}")
            return not rows

        await wait_for(gone, "the terminated session to end", 30)
    finally:
        session.terminate()
    (progress,) = await fetch(b.dsn(), PROGRESS, [origin])
    if major >= 16:  # what the mark is for: the rollback moved the origin past a's transaction
        assert progress[0] is not None and parse_lsn(progress[0]) >= parse_lsn(past)
    assert await fetch(b.dsn(), "SELECT * FROM kv") == []
    async with running_router(m.config):
        await wait_converged(m.nodes, ["kv"], 60)
        assert await fetch(b.dsn(), "SELECT id, v FROM kv") == [(1, "from a")]
        await execute(a.dsn(), "INSERT INTO kv VALUES (2, 'later')")  # past where the rollback left it
        await wait_converged(m.nodes, ["kv"], 60)


async def test_an_unset_source_fails_before_the_origin_moves(mesh: MeshFactory) -> None:
    """A session that set no source (a path that forgot it) fails in the set-up statement itself, before
    the origin has its LSN: the rollback leaves the origin where it was."""
    m = await mesh(nodes=2, schema=SCHEMA)
    b = m.nodes[1]
    origin = m.config.origin_name("a")
    session = await open_session(b.dsn())
    try:
        await take_origin(session, origin)
        await session.execute("BEGIN")
        await session.execute("INSERT INTO kv VALUES (1, 'x')")
        try:
            await session.execute(setup_statement("'9/0'", "now()", None, True))
        except Exception as exc:
            assert "pgmesh.source" in str(exc)
        else:
            raise AssertionError("the set-up ran without a source")
        await session.execute("ROLLBACK")
    finally:
        await asyncio.wait_for(session.close(), 10)
    (progress,) = await fetch(b.dsn(), PROGRESS, [origin])
    assert progress[0] in (None, "0/0")
    async with await psycopg.AsyncConnection.connect(b.dsn(), autocommit=True) as conn:
        cur = await conn.execute("SELECT applied::text FROM pgmesh.links WHERE source = 'a'")
        assert await cur.fetchall() == [(None,)]  # nor the mark


async def test_a_node_without_the_mark_column_asks_for_init_which_adds_it(mesh: MeshFactory) -> None:
    """An installation from before the mark: the router refuses to start, naming the node and `pgmesh
    init`; init adds the column (empty) and the router then runs."""
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    await execute(b.dsn(), "ALTER TABLE pgmesh.links DROP COLUMN applied")
    with pytest.raises(ConfigError, match=r"node b: .*run `pgmesh init`"):
        async with running_router(m.config):
            pass
    await init_cluster(m.config)
    assert await fetch(b.dsn(), "SELECT applied FROM pgmesh.links") == [(None,)]
    async with running_router(m.config):
        await execute(a.dsn(), "INSERT INTO kv VALUES (7, 'after init')")
        await wait_converged(m.nodes, ["kv"], 60)


async def test_a_stopping_router_lets_the_batch_in_hand_commit(mesh: MeshFactory) -> None:
    """A router told to stop while a batch is in the target's hands waits for it to commit (within
    `Router.stop_wait_s`) instead of cutting it short: cut short, on 16+ it would leave the origin ahead
    of the applied mark (the fixture's teardown checks they agree), and the change unapplied until a
    restart."""
    m = await mesh(nodes=2, schema=SCHEMA + "INSERT INTO kv VALUES (1, 'old');")
    a, b = m.nodes
    router = Router(m.config)
    router.stop_wait_s = 120.0  # the test decides when the batch may commit
    stop = asyncio.Event()
    task = asyncio.create_task(router.run(stop))
    try:
        await asyncio.wait_for(router.started.wait(), 60)
        applier = router.appliers[("a", "b")]
        async with await psycopg.AsyncConnection.connect(b.dsn()) as local:
            await local.execute("SELECT * FROM kv WHERE id = 1 FOR UPDATE")  # holds the row: the batch waits
            await execute(a.dsn(), "UPDATE kv SET v = 'new' WHERE id = 1")
            waiting = ("SELECT 1 FROM pg_catalog.pg_stat_activity WHERE wait_event_type = 'Lock'"
                       " AND backend_type = 'client backend'")
            await wait_for(lambda: _any(fetch(b.dsn(), waiting)), "a's update to wait for b's row lock", 60)
            stop.set()
            await wait_for(lambda: not applier.ready_for_more, "the applier to take no batch more", 60)
            assert not task.done()  # waiting for the batch in hand
            await local.rollback()  # lets the batch go on
        await asyncio.wait_for(task, 60)
    finally:
        stop.set()
        if not task.done():
            task.cancel()
    assert await fetch(b.dsn(), "SELECT v FROM kv") == [("new",)]  # applied before the router stopped
    (row,) = await fetch(a.dsn(), "SELECT pg_catalog.pg_current_wal_lsn()::text")
    (progress,) = await fetch(b.dsn(), PROGRESS, [m.config.origin_name("a")])
    assert progress[0] is not None and parse_lsn(progress[0]) <= parse_lsn(str(row[0]))


async def _any(rows: Awaitable[list[Any]]) -> bool:
    return bool(await rows)
