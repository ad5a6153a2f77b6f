"""What PostgreSQL 16+ changes for the router, tested on whichever version the nodes run (issue 19).

1. A commit record right after a non-transactional logical message: the message carries the end of its
   record, the commit starts there (same LSN). On 16+ every applier batch ends with such a message
   (`pgmesh.applied`, router.apply.link.LinkSession.applied_note); the source took the next commit on
   the node for one sent again and dropped it (rows missing on every other node, every link
   streaming). Here a client emits the message itself inside its transactions, on any version.
2. Every path that commits applied transactions tells the target's seen vector (router.stream.seen):
   on 15 through their echoes, on 16+ (no echo is sent) through the pgmesh.applied note each path
   writes after its commit: a large transaction, and the careful path (a conflict; on 15 a change
   decided against may write nothing, so no echo tells of it: that check is for 16+).
3. A node that only applies: on 16+ its stream holds only those notes, and its slot is still confirmed
   to its WAL end (a note passes as an echo does).
"""

from __future__ import annotations

from typing import Any

import psycopg

from protocol.lsn import datetime_to_pg_us
from router.apply.statements import KEY_LOCKS_MAX
from router.service.supervisor import Router
from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE t (id int PRIMARY KEY, v text)"
ROUNDS = 20


async def test_a_commit_right_after_a_non_transactional_message_is_replicated(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config):
        async with await psycopg.AsyncConnection.connect(a.dsn(), autocommit=True) as conn:
            for i in range(ROUNDS):
                async with conn.transaction():
                    await conn.execute("INSERT INTO t VALUES (%s, 'a')", [i])
                    # its record ends where the COMMIT's begins: the commit's LSN is the message's
                    await conn.execute("SELECT pg_logical_emit_message(false, 'pgmesh.test', 'x')")
        await wait_converged(m.nodes, ["t"], limit=60)
    assert await fetch(b.dsn(), "SELECT count(*) FROM t") == [(ROUNDS,)]


async def commit_time(node: Any, key: int) -> int:
    """The commit time of row `key` on `node` as it is now (µs since 2000-01-01)."""
    query = "SELECT pg_xact_commit_timestamp(xmin) FROM t WHERE id = %s"
    ((when,),) = await fetch(node.dsn(), query, [key])
    return datetime_to_pg_us(when)


async def seen_holds(router: Router, target: Any, source: Any, when: int) -> None:
    """Wait until `target`'s seen vector holds `source`'s commit at `when`."""
    pump = router.pumps[target.name]
    await wait_for(lambda: dict(pump.seen.snapshot).get(source.name, 0) >= when,
                   f"{target.name}'s seen vector to hold {source.name}'s commit at {when}")


async def test_large_and_careful_transactions_reach_the_seen_vector(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        big = KEY_LOCKS_MAX * 4
        await execute(a.dsn(), f"INSERT INTO t SELECT g, 'big' FROM generate_series(1, {big}) g")
        await wait_converged(m.nodes, ["t"], limit=60)
        assert router.appliers[("a", "b")].stats.copied_transactions == 1  # the large path
        await seen_holds(router, b, a, await commit_time(a, 1))
        await router.pause(None)
        await execute(a.dsn(), "INSERT INTO t VALUES (0, 'a')")
        await execute(b.dsn(), "INSERT INTO t VALUES (0, 'b')")  # a conflict each way: the careful path
        from_a, from_b = await commit_time(a, 0), await commit_time(b, 0)
        await router.resume(None)
        await wait_converged(m.nodes, ["t"], limit=60)
        assert router.appliers[("a", "b")].stats.conflicts == router.appliers[("b", "a")].stats.conflicts == 1
        ((version,),) = await fetch(a.dsn(), "SELECT current_setting('server_version_num')::int")
        if version >= 160000:  # (on 15 a change decided against may write nothing: no echo, known less)
            await seen_holds(router, b, a, from_a)
            await seen_holds(router, a, b, from_b)


async def test_a_node_that_only_applies_has_its_slot_confirmed_to_its_end(mesh: MeshFactory) -> None:
    """3. On 16+ b's own stream holds nothing but the notes of what was applied there: its slot is still
    confirmed up to b's WAL end (the notes pass as echoes do; else WAL piles up on b and a `pgmesh ddl
    --wait` barrier waits for ever)."""
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config):
        for i in range(3):
            await execute(a.dsn(), f"INSERT INTO t VALUES ({i}, 'a')")
        await wait_converged(m.nodes, ["t"], limit=60)
        ((end,),) = await fetch(b.dsn(), "SELECT pg_current_wal_lsn()::text")
        query = ("SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots"
                 " WHERE slot_name = %s")
        await wait_for(lambda: _true(fetch(b.dsn(), query, [end, m.config.slot_name])),
                       f"b's slot confirmed to {end}")


async def _true(rows: Any) -> bool:
    return bool((await rows)[0][0])
