"""Tombstone pruning on real nodes with the router running (router.conflicts.pruning): the tombstones of
a delete-heavy run stay bounded and go once the writes stop; a paused link stops pruning on its target;
a late change older than a tombstone the horizon has not passed is still decided against it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from protocol.lsn import datetime_to_pg_us
from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE t (id int PRIMARY KEY, v text NOT NULL);"
# A small margin and a short interval: pruning keeps up within the test's time.
FAST = "[conflicts]\ntombstone_margin_ms = 200\ntombstone_prune_interval_ms = 200\ntombstone_keep = \"0s\"\n"
ROUNDS = 150
ROWS = 100  # rows inserted then deleted per round and node


async def tombstones(node: Any) -> int:
    return int((await fetch(node.dsn(), "SELECT count(*) FROM pgmesh.tombstones"))[0][0])


async def churn(node: Any, base: int, peak: dict[str, int], nodes: list[Any],
                caught_up: Callable[[], bool]) -> None:
    """Insert a batch of the node's own keys, delete it, again and again; note the tombstone peaks.

    Paced to the mesh: every 5 rounds it waits until the node's links have applied what it wrote. The
    node's own deletes cost it no trigger now (router.apply.recorder), so unpaced it writes faster
    than two cores apply it elsewhere: the tombstones then grow with the links' backlog, as they must
    (a lagging link may still bring a change older than them), not with what was deleted."""
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        for i in range(ROUNDS):
            first = base + i * ROWS
            last = first + ROWS - 1
            await conn.execute("INSERT INTO t SELECT g, 'x' FROM generate_series(%s::int, %s) g",
                               [first, last])
            await conn.execute("DELETE FROM t WHERE id BETWEEN %s AND %s", [first, last])
            if i % 5 == 4:
                for other in nodes:
                    peak[other.name] = max(peak.get(other.name, 0), await tombstones(other))
                await wait_for(caught_up, f"{node.name}'s links caught up", limit=60)


@pytest.mark.slow
async def test_delete_heavy_run_keeps_tombstones_bounded(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, extra=FAST)
    nodes = m.nodes
    writers = nodes[:2]  # c only applies: its slot's readings move the horizons of a and b
    deleted_per_node = ROUNDS * ROWS * len(writers)  # every node records every deletion (own or applied)
    peak: dict[str, int] = {}
    # a tombstone whose commit time is unknown (a frozen xid): older than anything, pruned as well
    await execute(nodes[2].dsn(), "INSERT INTO pgmesh.tombstones VALUES ('public.t', '{0}', '2')")
    async with running_router(m.config) as router:
        assert router.pruner is not None
        def caught_up(source: str) -> Callable[[], bool]:
            links = [a for (s, _), a in router.appliers.items() if s == source]
            return lambda: all(a.pending <= 2 for a in links)

        await asyncio.gather(*(churn(n, 1_000_000 * (k + 1), peak, nodes, caught_up(n.name))
                               for k, n in enumerate(writers)))
        await wait_converged(nodes, ["t"])
        # bounded while the writes ran: well under what was deleted (here a sixth or so)
        for node in nodes:
            assert peak[node.name] < deleted_per_node // 3, (node.name, peak, deleted_per_node)
        # and gone once they stopped (the sources are caught up: their clocks move every horizon on)
        for node in nodes:
            await wait_for(lambda n=node: _none_left(n), f"{node.name}'s tombstones pruned", limit=90)
        # every idle source's slot is seen caught up with its WAL: its clock is the links' safe time
        tracker = router.pruner.tracker
        await wait_for(lambda: all(tracker.safe_time(n.name, "-", None) is not None for n in nodes),
                       "every source seen caught up")
        stats = router.pruner.stats
        assert all(stats[n.name].pruned > 0 for n in nodes), stats
        text = router.metrics.render()
        assert 'pgmesh_tombstones_pruned_total{node="a"}' in text
        assert 'pgmesh_tombstone_horizon_age_seconds{node="c"}' in text


async def _count_is(node: Any, n: int) -> bool:
    return await tombstones(node) == n


async def _none_left(node: Any) -> bool:
    return await tombstones(node) == 0


async def _commit_time(node: Any, key: int) -> int:
    rows = await fetch(node.dsn(), "SELECT pg_xact_commit_timestamp(xmin) FROM t WHERE id = %s", [key])
    return datetime_to_pg_us(rows[0][0])


@pytest.mark.slow
async def test_paused_link_stops_pruning_and_a_late_change_meets_the_tombstone(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, extra=FAST)
    a, b = m.nodes
    await execute(a.dsn(), "INSERT INTO t SELECT g, 'first' FROM generate_series(1, 10) g")
    async with running_router(m.config) as router:
        pruner = router.pruner
        assert pruner is not None
        await wait_converged(m.nodes, ["t"])
        await router.pause("b")  # a -> b holds: a's next change reaches b late
        await execute(a.dsn(), "UPDATE t SET v = 'late' WHERE id = 1")
        late = await _commit_time(a, 1)
        await execute(b.dsn(), "DELETE FROM t WHERE id BETWEEN 1 AND 5")  # newer than a's update
        # b's own deletes: recorded by the router from b's stream, shortly after their commit
        await wait_for(lambda: _count_is(b, 5), "b's deletions recorded")
        deleted_at = (await fetch(
            b.dsn(), "SELECT min(pg_xact_commit_timestamp(xid(xid))) FROM pgmesh.tombstones"
            " WHERE table_name = 'public.t'"))[0][0]
        assert datetime_to_pg_us(deleted_at) > late
        # b's deletions reach a (b -> a runs): a prunes its tombstones...
        await wait_for(lambda: _none_left(a), "a's tombstones pruned", limit=60)
        # ...while b, whose incoming link is paused, keeps its own through several rounds
        rounds = pruner.stats["b"].rounds
        await wait_for(lambda: pruner.stats["b"].rounds >= rounds + 5, "five pruning rounds on b")
        assert await tombstones(b) == 5
        assert pruner.stats["b"].pruned == 0
        assert pruner.stats["b"].horizon is None or pruner.stats["b"].horizon < datetime_to_pg_us(deleted_at)
        assert 'pgmesh_tombstone_horizon_age_seconds{node="b"}' in router.metrics.render()
        # a's older update arrives at b, meets no row, and loses to b's tombstone
        await router.resume("b")
        applier = router.appliers[("a", "b")]
        await wait_for(lambda: (applier.last_commit_time or 0) >= late, "a's late update applied on b")
        await wait_converged(m.nodes, ["t"])
        for node in m.nodes:
            assert await fetch(node.dsn(), "SELECT id FROM t WHERE id <= 5") == []
        # the link runs again: b's tombstones go too
        await wait_for(lambda: _none_left(b), "b's tombstones pruned after the resume", limit=60)
