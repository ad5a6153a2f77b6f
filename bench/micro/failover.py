"""Failover time of standby routers ([ha], docs/ha.md): the active router SIGKILLed, over and over, under
writes.

Three fresh nodes (a, b, c) with `t (id bigint PRIMARY KEY, v text)`, two routers (`python -m router run`
each, `[ha] lease_s` = --lease-s) and a writer on a (about 100 one-row commits per second). Each round
waits a random part of a renewal period, SIGKILLs the active router, commits a probe row on a at once and
times:

- `takeover`: kill -> the standby reports itself active (its /status, polled every 20 ms);
- `applied`: kill -> the probe row is on b (what a user sees: replication stopped for this long).

Then it starts the killed router again (a standby now) and waits until it says so. At the end every row
the writer committed is on every node exactly once. Reported: each round, and min / median / p90 / max
of both times, against the bound docs/ha.md states (lease_s + the standby's start-up).

    .venv/bin/python -m bench.micro.failover                    # 20 kills, lease_s = 3
    .venv/bin/python -m bench.micro.failover --lease-s 10       # the default lease
    .venv/bin/python -m bench.micro.failover --kills 2          # a quick check that it runs

Owns: its nodes, its routers, the load and the report. Must not: touch anything but what it creates.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import psycopg

from router.testing.localnodes import LocalNode, create_nodes
from router.testing.mesh import NODE_SETTINGS, execute, fetch, prepare_mesh, wait_converged, wait_for
from router.testing.routers import Routers, ha_section

SCHEMA = "CREATE TABLE t (id bigint PRIMARY KEY, v text NOT NULL)"
PROBES = 1_000_000_000  # probe ids start here; the writer's below


async def writer(node: LocalNode, stop: asyncio.Event) -> int:
    """One-row commits on `node` about every 10 ms until `stop`: how many."""
    done = 0
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        while not stop.is_set():
            await conn.execute("INSERT INTO t VALUES (%s, 'w')", [done])
            done += 1
            await asyncio.sleep(0.01)
    return done


async def active(routers: Routers) -> str | None:
    for name in routers.procs:
        if await routers.is_(name, "active"):
            return name
    return None


async def one_kill(routers: Routers, nodes: list[LocalNode], probe: int) -> tuple[float, float]:
    """Kill the active router; (seconds to the standby's takeover, seconds to the probe on b)."""
    victim = await active(routers)
    assert victim is not None, "no router is active"
    standby = next(n for n in routers.procs if n != victim)
    a, b = nodes[0], nodes[1]
    with psycopg.connect(b.dsn(), autocommit=True) as reader:
        t0 = time.monotonic()
        routers.signal(victim, signal.SIGKILL)
        await execute(a.dsn(), f"INSERT INTO t VALUES ({probe}, 'probe')")
        took = arrived = 0.0
        while not (took and arrived):
            if time.monotonic() - t0 > 120:
                raise AssertionError(f"no takeover within 120 s\n{routers.output()}")
            if not took and await routers.is_(standby, "active"):
                took = time.monotonic() - t0
            if not arrived and reader.execute("SELECT 1 FROM t WHERE id = %s", [probe]).fetchone():
                arrived = time.monotonic() - t0
            await asyncio.sleep(0.02)
    await asyncio.to_thread(routers.procs[victim].wait)
    routers.start(victim, nodes)
    await wait_for(lambda: routers.is_(victim, "standby"), f"{victim} a standby again", 120)
    return took, arrived


async def run(kills: int, lease_s: float, tmp: Path) -> list[tuple[float, float]]:
    nodes = create_nodes(["a", "b", "c"], settings=NODE_SETTINGS)
    routers = Routers(tmp, ha_section(lease_s), cluster="fo")
    stop = asyncio.Event()
    try:
        await prepare_mesh(nodes, SCHEMA, cluster="fo")
        routers.start("r1", nodes)
        await wait_for(lambda: routers.is_("r1", "active"), "r1 active", 120)
        routers.start("r2", nodes)
        await wait_for(lambda: routers.is_("r2", "standby"), "r2 a standby", 120)
        load = asyncio.create_task(writer(nodes[0], stop))
        out = []
        for i in range(kills):
            await asyncio.sleep(random.uniform(0, lease_s / 3))  # anywhere in a renewal period
            out.append(await one_kill(routers, nodes, PROBES + i))
            print(f"kill {i + 1}: takeover {out[-1][0]:.2f} s, applied on b {out[-1][1]:.2f} s", flush=True)
        stop.set()
        written = await load
        await wait_converged(nodes, ["t"], 300)
        for node in nodes:
            rows = await fetch(node.dsn(), f"SELECT count(*), count(DISTINCT id) FROM t WHERE id < {PROBES}")
            assert rows == [(written, written)], (node.name, rows, written)
        return out
    finally:
        stop.set()
        await routers.stop()
        for node in nodes:
            node.destroy()


def summary(values: Sequence[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return (f"{ordered[0]:.2f} | {statistics.median(ordered):.2f} | {p90:.2f} | {ordered[-1]:.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.failover",
                                     description="failover time of standby routers over SIGKILLs")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--lease-s", type=float, default=3.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pgmesh-failover-") as tmp:
        results = asyncio.run(run(args.kills, args.lease_s, Path(tmp)))
    print(f"\nFailover over {len(results)} SIGKILLs of the active router, lease_s = {args.lease_s:g}"
          f" (docs/ha.md: within lease_s = {args.lease_s:g} s plus the standby's start-up)\n")
    print("| measure | min s | median s | p90 s | max s |\n|---|--:|--:|--:|--:|")
    print(f"| kill -> standby active | {summary([t for t, _ in results])} |")
    print(f"| kill -> probe applied on b | {summary([a for _, a in results])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
