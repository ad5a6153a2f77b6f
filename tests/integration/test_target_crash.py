"""A target that crashes loses the applied commits it had not flushed; the link gets them again.

The appliers commit with `synchronous_commit = off` (the default `apply_synchronous_commit`, as the native
apply worker): a target that crashes may lose its last applied transactions and, in the same WAL, the
origin progress that recorded them. The router must then read the target's own word on where it stands
(its origin's progress after the crash) and send those transactions again, on either transport. The
router reaches b through a TCP proxy that is cut while b restarts, so that what b lost can be read on b
before the router reconnects: on 15 (no applied note, whose non-transactional message flushes WAL on 17+)
b's WAL writer is kept from flushing, so the loss is certain there.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from router.testing.mesh import NODE_SETTINGS, execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.test_cut_off import through_proxy

SCHEMA = "CREATE TABLE kv (id bigint PRIMARY KEY, v int NOT NULL);"
# b's WAL writer wakes rarely and never flushes for the amount written: unflushed commits stay unflushed
SETTINGS = {**NODE_SETTINGS, "wal_writer_delay": "10s", "wal_writer_flush_after": "1GB"}
ROWS = 40
ROUNDS = 3


@pytest.mark.parametrize("transport", ["pipeline", "script"])
async def test_a_target_crash_loses_unflushed_commits_and_gets_them_again(
    mesh: MeshFactory, tcp_proxy: Any, transport: str
) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, settings=SETTINGS, replication=f'apply_transport = "{transport}"')
    a, b = m.nodes
    proxy = tcp_proxy("127.0.0.1", b.port)
    config = through_proxy(m.config, b, proxy)
    ((version,),) = await fetch(b.dsn(), "SELECT current_setting('server_version_num')::int")
    lost: list[int] = []
    async with running_router(config) as router:
        await wait_for(lambda: all(x.state.value == "streaming" for x in router.appliers.values()),
                       "both links streaming")
        # Each round: rows applied on b, b crashes. The router's progress query flushes b's WAL (it reads
        # the origin's flushed position), so a round may lose nothing: up to three rounds, until one does.
        for first in range(1, ROUNDS * ROWS, ROWS):
            for i in range(first, first + ROWS):  # one transaction each: small, the pipe's
                await execute(a.dsn(), "INSERT INTO kv VALUES (%s, %s)", params=[i, i])
            rows = first + ROWS - 1

            async def applied() -> bool:
                return await fetch(b.dsn(), "SELECT count(*) FROM kv") == [(rows,)]  # noqa: B023

            await wait_for(applied, "b to have a's rows")
            proxy.cut()  # the router's sessions to b close; new ones are refused until `restore`
            await asyncio.to_thread(b.stop, "immediate")
            await asyncio.to_thread(b.start)
            ((kept,),) = await fetch(b.dsn(), "SELECT count(*) FROM kv")
            lost.append(rows - kept)
            proxy.restore()
            await wait_converged(m.nodes, ["kv"], limit=120)  # what b lost came back
            await wait_for(lambda: all(x.state.value == "streaming" for x in router.appliers.values()),
                           "both links streaming again", 60)
            if lost[-1]:
                break
    if version < 160000:  # (16+: the applied note's message may flush b's WAL)
        assert any(lost), f"b flushed every applied commit in every round: this test proved nothing ({lost})"
    for node in m.nodes:
        assert await fetch(node.dsn(), "SELECT count(*), sum(v) FROM kv") == [(rows, rows * (rows + 1) // 2)]


async def test_a_target_restarting_between_two_progress_reads_gets_what_it_lost(mesh: MeshFactory) -> None:
    """b crashes and is back before the router's next progress read: nothing but its restart (its
    postmaster's start time, read on the monitor's new connection) tells the router; its idle link into b
    must still connect again and send what b lost."""
    m = await mesh(nodes=2, schema=SCHEMA, settings=SETTINGS, replication='apply_transport = "pipeline"')
    a, b = m.nodes
    config = msgspec.structs.replace(
        m.config, replication=msgspec.structs.replace(m.config.replication, status_interval_ms=3000))
    async with running_router(config) as router:
        await wait_for(lambda: all(x.state.value == "streaming" for x in router.appliers.values()),
                       "both links streaming")
        for i in range(1, ROWS + 1):
            await execute(a.dsn(), "INSERT INTO kv VALUES (%s, %s)", params=[i, i])

        async def applied() -> bool:
            return await fetch(b.dsn(), "SELECT count(*) FROM kv") == [(ROWS,)]

        await wait_for(applied, "b to have a's rows")
        await asyncio.to_thread(b.stop, "immediate")
        await asyncio.to_thread(b.start)
        await wait_converged(m.nodes, ["kv"], limit=60)
    for node in m.nodes:
        assert await fetch(node.dsn(), "SELECT count(*), sum(v) FROM kv") == [(ROWS, ROWS * (ROWS + 1) // 2)]
