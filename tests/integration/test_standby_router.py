"""Standby routers ([ha], router.service.lease, docs/ha.md; issue 24 item 2): two `pgmesh run` processes for
one cluster, exactly one applies. The active one killed: the standby applies within the documented time.
The active one cut off from a majority (TCP proxies): it stops, the standby takes over, and after the heal
the old one stays standby. The active one frozen (SIGSTOP) past its lease: the standby takes over and the
old one, woken, applies nothing more (its sessions were ended and it may open none: router.apply.fence).
Every case ends with every acknowledged transaction on every node exactly once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

from router.testing.mesh import (
    execute,
    fetch,
    wait_converged,
    wait_for,
)
from router.testing.proxy import TcpProxy
from router.testing.routers import Routers, ha_section
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE acct (id bigint PRIMARY KEY, v int NOT NULL, who text);"
LEASE_S = 3.0
HA = ha_section(LEASE_S)
# docs/ha.md: a standby applies within lease_s + its start-up; the waits below allow generously more (a
# loaded machine), the bench (bench/micro/failover.py) measures it
TAKEOVER_LIMIT_S = 3 * (LEASE_S + LEASE_S / 3 + 5)
R1_SESSIONS = "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'pgmesh router t r1-%'"


async def writer(node: Any, base: int, stop: asyncio.Event, acked: list[int]) -> None:
    """Inserts on keys only this node writes and an update of an earlier one every third, until `stop`;
    `acked` gets each key whose insert was acknowledged."""
    written = 0
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        while not stop.is_set():
            await conn.execute("INSERT INTO acct (id, v, who) VALUES (%s, 0, %s)",
                               [base + written, node.name])
            acked.append(base + written)
            if written % 3 == 2:
                await conn.execute("UPDATE acct SET v = v + 1 WHERE id = %s", [base + written // 2])
            written += 1
            await asyncio.sleep(0.01)


class Load:
    """A writer on every node; `check` says every acknowledged row is on every node exactly once."""

    def __init__(self, nodes: Sequence[Any]) -> None:
        self.nodes = nodes
        self.stop = asyncio.Event()
        self.acked: dict[str, list[int]] = {n.name: [] for n in nodes}
        self.tasks = [asyncio.create_task(writer(n, (i + 1) * 1_000_000, self.stop, self.acked[n.name]))
                      for i, n in enumerate(nodes)]

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)

    async def check(self) -> None:
        await wait_converged(self.nodes, ["acct"], 180)
        for node in self.nodes:
            rows = await fetch(node.dsn(), "SELECT who, count(*), count(DISTINCT id), sum(v) FROM acct"
                                           " GROUP BY who ORDER BY who")
            for who, n, distinct, total in rows:
                if who == "probe":  # (`arrives`)
                    continue
                acked = self.acked[who]
                assert n == distinct == len(acked), (node.name, who, n, distinct, len(acked))
                assert total == len(acked) // 3, (node.name, who, total, len(acked))  # each update once


async def arrives(source: Any, target: Any, key: int, limit: float) -> float:
    """Insert `key` on `source` and wait until `target` has it: seconds taken."""
    t0 = time.monotonic()
    await execute(source.dsn(), f"INSERT INTO acct (id, v, who) VALUES ({key}, 0, 'probe')")
    await wait_for(lambda: _has(target.dsn(), key), f"row {key} from {source.name} on {target.name}", limit)
    return time.monotonic() - t0


async def _has(dsn: str, key: int) -> bool:
    return bool(await fetch(dsn, f"SELECT 1 FROM acct WHERE id = {key}"))


async def holders(nodes: Sequence[Any]) -> set[str]:
    """The holders named by live lease rows."""
    out = set()
    for node in nodes:
        rows = await fetch(node.dsn(), "SELECT holder FROM pgmesh.lease WHERE expires_at > now()")
        out |= {r[0] for r in rows}
    return out


class Scenario:
    """Three nodes, the routers of one test and a writer on every node (once `load` is called); at the end
    every router is stopped, and on failure their output printed."""

    def __init__(self, m: Any, tmp: Path) -> None:
        self.m = m
        self.routers = Routers(tmp, HA, log_level=os.environ.get("PGMESH_TEST_ROUTER_LOG", "INFO"))
        self.writes: Load | None = None

    async def start_both(self, nodes: Sequence[Any] | None = None) -> None:
        """r1 first (over `nodes`, default the mesh's), active; then r2 over the mesh's nodes, a standby."""
        self.routers.start("r1", nodes or self.m.nodes)
        await wait_for(lambda: self.routers.is_("r1", "active"), "r1 active", 60)
        self.routers.start("r2", self.m.nodes)
        await wait_for(lambda: self.routers.is_("r2", "standby"), "r2 a standby", 60)

    def load(self) -> Load:
        self.writes = Load(self.m.nodes)
        return self.writes

    async def __aenter__(self) -> Scenario:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            print(self.routers.output())
        if self.writes is not None:  # (finished by the test, unless it failed)
            self.writes.stop.set()
            await asyncio.gather(*self.writes.tasks, return_exceptions=True)
        await self.routers.stop()


@pytest.mark.slow
async def test_the_standby_takes_over_when_the_active_router_is_killed(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    m = await mesh(nodes=3, schema=SCHEMA)
    a, b, c = m.nodes
    async with Scenario(m, tmp_path) as s:
        await s.start_both()
        load = s.load()
        await arrives(a, b, 1, 60)
        s.routers.signal("r1", signal.SIGKILL)
        took = await arrives(c, a, 2, TAKEOVER_LIMIT_S)  # applied by r2
        assert await s.routers.role("r2") == "active"
        lease = await s.routers.lease("r2")
        assert lease is not None and lease["term"] >= 2 and all(
            row["holder"] == lease["holder"] for row in lease["nodes"].values()), lease
        await load.finish()
        await load.check()
    print(f"failover: the standby applied {took:.1f} s after the kill")


@pytest.mark.slow
async def test_a_router_cut_off_from_a_majority_stops_and_stays_standby_after_the_heal(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    m = await mesh(nodes=3, schema=SCHEMA)
    a, b, c = m.nodes
    proxies = {n.name: TcpProxy("127.0.0.1", n.port).start() for n in (b, c)}
    # r1 reaches b and c only through the proxies; r2 reaches every node directly
    cut_off = [a] + [SimpleNamespace(name=n.name, dsn=lambda n=n: n.dsn().replace(
        f"port={n.port}", f"port={proxies[n.name].port}")) for n in (b, c)]
    try:
        async with Scenario(m, tmp_path) as s:
            routers = s.routers
            await s.start_both(cut_off)
            load = s.load()
            await arrives(a, b, 1, 60)
            for proxy in proxies.values():
                proxy.blackhole()
            # r1 reaches a only: it stops applying at its deadline and is a standby; r2 takes over
            await wait_for(lambda: routers.is_("r1", "standby"), "r1 stepped down", TAKEOVER_LIMIT_S)
            await wait_for(lambda: routers.is_("r2", "active"), "r2 active", TAKEOVER_LIMIT_S)
            await arrives(b, a, 2, TAKEOVER_LIMIT_S)
            # r1's sessions on a were ended by r2's takeover of a's row
            await wait_for(lambda: _none(a.dsn(), R1_SESSIONS), "no session of r1 on a", 30)
            for proxy in proxies.values():
                proxy.restore()
            # healed: r1 reads every row again, sees r2's term, stays standby
            lease = await routers.lease("r2")
            assert lease is not None
            term = lease["term"]

            async def r1_saw_r2() -> bool:
                mine = await routers.lease("r1")
                rows = [] if mine is None else list(mine["nodes"].values())
                theirs = (term, lease["holder"])
                return len(rows) == 3 and all((r["term"], r["holder"]) == theirs for r in rows)

            await wait_for(r1_saw_r2, "r1 reads r2's rows on every node after the heal", 60)
            assert await routers.role("r1") == "standby"
            assert await holders(m.nodes) == {lease["holder"]}
            await load.finish()
            await load.check()
            assert await routers.role("r1") == "standby"
    finally:
        for proxy in proxies.values():
            proxy.close()


@pytest.mark.slow
async def test_a_router_frozen_past_its_lease_applies_nothing_when_it_wakes(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    m = await mesh(nodes=3, schema=SCHEMA)
    a, b, c = m.nodes
    async with Scenario(m, tmp_path) as s:
        routers = s.routers
        await s.start_both()
        load = s.load()
        await arrives(a, b, 1, 60)
        routers.signal("r1", signal.SIGSTOP)
        await wait_for(lambda: routers.is_("r2", "active"), "r2 active", TAKEOVER_LIMIT_S)
        await arrives(c, b, 2, TAKEOVER_LIMIT_S)
        routers.signal("r1", signal.SIGCONT)
        await wait_for(lambda: routers.is_("r1", "standby"), "r1, woken, a standby", 60)
        await arrives(b, a, 3, 60)
        await load.finish()
        await load.check()
        for node in m.nodes:
            assert await _none(node.dsn(), R1_SESSIONS), node.name


async def _none(dsn: str, query: str) -> bool:
    return (await fetch(dsn, query))[0][0] == 0


@pytest.mark.slow
async def test_a_router_that_took_the_lease_with_a_node_down_keeps_running_when_it_returns(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    """Found by the nemesis run (bench/nemesis.py, seed 1): the tombstone recorder's sweep on the node
    that came back opened a session before the lease had taken that node into its term; the fence refused
    it, and the refusal ended the router process. A lease of 10 s (renewed every 3.3 s, the sweep every
    second) made it happen every time."""
    m = await mesh(nodes=3, schema=SCHEMA)
    a, b, c = m.nodes
    routers = Routers(tmp_path, ha_section(10.0))
    try:
        b.stop("immediate")
        routers.start("r1", m.nodes)
        await wait_for(lambda: routers.is_("r1", "active"), "r1 active with a and c", 60)
        b.start()
        await arrives(a, b, 1, 60)
        await arrives(b, c, 2, 60)
        assert routers.procs["r1"].poll() is None, routers.output()
    finally:
        await routers.stop()


@pytest.mark.slow
async def test_a_takeover_while_a_node_is_down_stops_no_link(mesh: MeshFactory, tmp_path: Path) -> None:
    """Found by the nemesis run (bench/nemesis.py, seed 1): the active router had recorded its log's name
    on the nodes (router.service.logs `mark`: its log held a's transactions for b, down); the standby,
    taking over with a log of its own while b was still down, took that for a lost log and stopped the
    links into b (and those into a target behind a's slot) with "transactions may be missing ... then
    `pgmesh resume`", though with [ha] no slot is ever confirmed on a log's account."""
    m = await mesh(nodes=3, schema=SCHEMA)
    a, b, c = m.nodes
    async with Scenario(m, tmp_path) as s:
        await s.start_both()
        b.stop("immediate")
        async with await psycopg.AsyncConnection.connect(a.dsn(), autocommit=True) as conn:
            for key in range(10, 110):
                await conn.execute("INSERT INTO acct (id, v, who) VALUES (%s, 0, 'probe')", [key])
        mark = "SELECT count(*) FROM pgmesh.node_info WHERE key = 'router_log'"
        await wait_for(lambda: _some(a.dsn(), mark), "r1's log named on a", 60)
        await s.routers.kill("r1")
        await wait_for(lambda: s.routers.is_("r2", "active"), "r2 active", TAKEOVER_LIMIT_S)
        b.start()
        await arrives(a, b, 1, 60)
        await arrives(a, c, 2, 60)
        await arrives(c, b, 3, 60)
        await wait_converged(m.nodes, ["acct"], 60)


async def _some(dsn: str, query: str) -> bool:
    return (await fetch(dsn, query))[0][0] > 0
