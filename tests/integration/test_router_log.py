"""The router's log (router.stream.log.store): a node that is down does not make the others keep their WAL.

With node c stopped, a and b go on writing. Their links into c fill their queues, then read the router's
log of their source instead; every source's slot is confirmed as far as the log holds it durably, so a and
b keep only a little of the WAL they write (the rest is in the router's log). When c starts again its
links read what they missed from the log, catch up and the three nodes converge, with every acknowledged
row present exactly once. (A router killed while links read the log, in a segment switch, goes on from
the log after a restart: tests/integration/test_fail_points.py.)
"""

from __future__ import annotations

import asyncio
import shutil
from typing import Any

import pytest

from protocol.lsn import parse_lsn
from router.errors import PgmeshError
from router.ops.barrier import barrier
from router.testing.mesh import execute, fetch, free_port, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = """CREATE TABLE doc (id bigint PRIMARY KEY, src text NOT NULL, body text NOT NULL);
ALTER TABLE doc ALTER body SET STORAGE EXTERNAL;"""  # never compressed: the WAL is as big as the rows
TABLES = ["doc"]
FILLER = "x" * 2000
INSERT = "INSERT INTO doc SELECT g, %s, %s || g FROM generate_series(%s::bigint, %s::bigint) g"
COUNTS = "SELECT src, count(*), count(DISTINCT id) FROM doc GROUP BY src ORDER BY 1"


async def write(node: Any, first: int, transactions: int, rows: int = 20) -> None:
    """`transactions` transactions of `rows` rows of about 2 kB each (ids from `first`)."""
    for t in range(transactions):
        base = first + t * rows
        await execute(node.dsn(), INSERT, params=[node.name, FILLER, base, base + rows - 1])


async def wal_lsn(node: Any) -> int:
    (row,) = await fetch(node.dsn(), "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
    return int(row[0])


async def retained(node: Any, slot: str) -> int:
    """What pgmesh's slot on `node` keeps of its WAL now (a checkpoint first: the slot's restart_lsn moves
    at the running-transactions records the server writes then)."""
    await execute(node.dsn(), "CHECKPOINT")
    query = "SELECT pg_current_wal_lsn() - restart_lsn FROM pg_replication_slots WHERE slot_name = %s"
    (row,) = await fetch(node.dsn(), query, params=[slot])
    return int(row[0])


async def check_rows(nodes: list[Any], expected: dict[str, int]) -> None:
    for node in nodes:
        rows = await fetch(node.dsn(), COUNTS)
        assert rows == [(src, n, n) for src, n in sorted(expected.items())], f"node {node.name}: {rows}"


async def test_a_stopped_node_does_not_make_the_others_keep_their_wal(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, replication="queue_max_transactions = 50")
    a, b, c = m.nodes
    slot = m.config.slot_name
    async with running_router(m.config) as router:
        await write(a, 1, 5)
        await wait_converged(m.nodes, TABLES)
        c.stop("fast")
        start = {n.name: await wal_lsn(n) for n in (a, b)}
        await asyncio.gather(write(a, 1_000_000, 300), write(b, 2_000_000, 300))
        written = {n.name: await wal_lsn(n) - start[n.name] for n in (a, b)}
        assert min(written.values()) > 10 << 20, written  # tens of MB each

        def readers() -> dict[str, list[str]]:
            return {s.node: s.log.readers for s in router.status().sources if s.log is not None}

        await wait_for(lambda: readers().get("a") == ["c"] and readers().get("b") == ["c"],
                       "the links into c to read the router log")

        async def kept_little() -> bool:
            kept = {n.name: await retained(n, slot) for n in (a, b)}
            return all(kept[name] < written[name] / 10 for name in kept)

        await wait_for(kept_little, "a and b to keep under 10% of the WAL they wrote", 90)
        sources = {s.node: s for s in router.status().sources}
        for name in "ab":
            log = sources[name].log
            assert log is not None and log.state == "appending" and log.bytes > written[name] / 4, log
        text = router.metrics.render()
        assert 'pgmesh_router_log_readers{node="a"} 1' in text
        c.start()
        await wait_converged(m.nodes, TABLES, limit=240)
        await wait_for(lambda: not any(readers().values()), "the links into c to catch up with the log", 120)
        await check_rows(m.nodes, {"a": 5 * 20 + 300 * 20, "b": 300 * 20})


async def test_with_every_link_behind_a_dead_node_goes_to_the_log_past_its_hold(mesh: MeshFactory) -> None:
    """Two nodes: no other link needs the stream to move, so the link into the stopped node waits (the
    backpressure of a slow target) until it has applied nothing for `hold_s` seconds, then reads the log."""
    m = await mesh(nodes=2, schema=SCHEMA, replication="queue_max_transactions = 20",
                   extra="[log]\nhold_s = 2\n")
    a, b = m.nodes
    async with running_router(m.config) as router:
        await write(a, 1, 3)
        await wait_converged(m.nodes, TABLES)
        b.stop("fast")
        start = await wal_lsn(a)
        await write(a, 1_000_000, 300)
        written = await wal_lsn(a) - start

        def readers() -> list[str]:
            return next(s.log.readers for s in router.status().sources if s.node == "a" and s.log is not None)

        await wait_for(lambda: readers() == ["b"], "the link into b to read the router log")

        async def kept_little() -> bool:
            return await retained(a, m.config.slot_name) < written / 4

        await wait_for(kept_little, "a to keep a fraction of the WAL it wrote", 90)
        b.start()
        await wait_converged(m.nodes, TABLES, limit=240)
        await check_rows(m.nodes, {"a": 3 * 20 + 300 * 20})


async def test_a_lost_router_log_stops_the_links_it_left_short(mesh: MeshFactory) -> None:
    """The log is deleted while c is down and a's slot is confirmed past what c has: the restarted router
    stops a -> c with an error naming the node, the position and what to run, instead of skipping."""
    m = await mesh(nodes=3, schema=SCHEMA, replication="queue_max_transactions = 50")
    a, b, c = m.nodes
    async with running_router(m.config) as router:
        await write(a, 1, 3)
        await wait_converged(m.nodes, TABLES)
        c.stop("fast")
        await write(a, 1_000_000, 100)

        async def confirmed_past_c() -> bool:
            source = next(s for s in router.status().sources if s.node == "a")
            link = next(lk for lk in router.status().links if lk.source == "a" and lk.target == "c")
            return source.log is not None and source.log.readers == ["c"] and \
                parse_lsn(source.confirmed_lsn) > parse_lsn(link.flushed_lsn)

        await wait_for(confirmed_past_c, "a's slot to be confirmed past what c has, on the log's account")
    shutil.rmtree(m.log_dir)  # the router's logs are lost
    c.start()
    async with running_router(m.config) as router:
        def a_to_c() -> tuple[str, str | None]:
            link = next(lk for lk in router.status().links if lk.source == "a" and lk.target == "c")
            return link.state, link.last_error

        await wait_for(lambda: a_to_c()[0] == "error", "a -> c to stop on the lost log")
        error = a_to_c()[1]
        assert error is not None and "router log" in error and "pgmesh compare" in error, error
        assert "node c" in error and "pgmesh resume c" in error, error
        await wait_converged([a, b], TABLES)
        rows = await fetch(c.dsn(), "SELECT count(*) FROM doc WHERE src = 'a'")
        assert rows == [(3 * 20,)]  # nothing of what only the lost log held was skipped past
    paused = await fetch(c.dsn(), "SELECT paused, reason FROM pgmesh.links WHERE source = 'a'")
    assert paused[0][0] and "router log" in paused[0][1]  # a restart remembers it


async def test_a_barrier_waits_for_a_paused_node_past_what_the_log_confirmed(mesh: MeshFactory) -> None:
    """b is paused: a's slot is confirmed past what b has on the log's account, but a barrier (what
    `pgmesh ddl --wait` and locked DDL wait for) is reached only once b has applied it."""
    m = await mesh(nodes=2, schema=SCHEMA, replication="queue_max_transactions = 50", admin_port=free_port())
    a, _ = m.nodes
    async with running_router(m.config) as router:
        await write(a, 1, 3)
        await wait_converged(m.nodes, TABLES)
        await router.pause("b")
        await write(a, 1_000_000, 100)

        async def confirmed_past_b() -> bool:
            source = next(s for s in router.status().sources if s.node == "a")
            link = next(lk for lk in router.status().links if lk.source == "a")
            return parse_lsn(source.confirmed_lsn) > parse_lsn(link.flushed_lsn)

        await wait_for(confirmed_past_b, "a's slot to be confirmed past what b has, on the log's account", 90)
        with pytest.raises(PgmeshError, match=r"barrier not reached .*a -> b"):
            await barrier(m.config, limit=1.0)
        await router.resume("b")
        await barrier(m.config, limit=90)
        await check_rows(m.nodes, {"a": 3 * 20 + 100 * 20})
