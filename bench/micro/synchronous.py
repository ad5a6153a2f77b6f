"""Commit latency with synchronous replication: pgmesh `synchronous = 1` against asynchronous pgmesh and
against PostgreSQL's own synchronous logical replication, in the same run.

Each system gets two fresh nodes (a, b) with the table `t (id bigint PRIMARY KEY, v text)`; one client on
a commits --commits one-row inserts one after another (after --warm unmeasured ones) and times each
commit as the client sees it:

- `pgmesh async`: pgmesh with `synchronous = 0` (the router in a process of its own, `python -m router
  run`): the commit does not wait for b;
- `pgmesh k=1`: `synchronous = 1`: the commit returns once b has durably applied it (docs/synchronous.md);
- `native remote_apply`: a publication on a, a subscription on b, a's `synchronous_standby_names` naming
  the subscription and `synchronous_commit = remote_apply` on a: the commit returns once b has applied it.

Reported per system: commits, p50, p99 and max in ms, and p50 / p99 as ratios to native's.

    .venv/bin/python -m bench.micro.synchronous                  # 5,000 commits each
    .venv/bin/python -m bench.micro.synchronous --commits 50 --warm 5     # a quick check that it runs
    .venv/bin/python -m bench.micro.synchronous --fsync          # the nodes with fsync on

Owns: its nodes, the load and the report. Must not: touch anything but the nodes it creates and destroys.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import psycopg

from router.testing.localnodes import LocalNode, create_nodes
from router.testing.mesh import NODE_SETTINGS, Mesh, execute, fetch, prepare_mesh, wait_for

SCHEMA = "CREATE TABLE t (id bigint PRIMARY KEY, v text NOT NULL)"
INSERT = "INSERT INTO t VALUES (%s, 'x')"
SUBSCRIPTION = "bench_sub"


async def commits(node: LocalNode, count: int, warm: int) -> list[float]:
    """Seconds each of `count` one-row commits took on `node` (after `warm` unmeasured ones)."""
    out = []
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        for i in range(warm + count):
            start = time.perf_counter()
            await conn.execute(INSERT, [i])
            if i >= warm:
                out.append(time.perf_counter() - start)
    return out


async def on_b(b: LocalNode, rows: int) -> None:
    async def arrived() -> bool:
        return int((await fetch(b.dsn(), "SELECT count(*) FROM t"))[0][0]) >= rows

    await wait_for(arrived, f"{rows} rows on b", 300)


async def pgmesh_run(nodes: list[LocalNode], k: int, count: int, warm: int, tmp: Path) -> list[float]:
    mesh: Mesh = await prepare_mesh(nodes, SCHEMA, cluster="bench", replication=f"synchronous = {k}")
    config_path = mesh.write_config(tmp / "config.toml", nodes)
    log = tmp / "router.log"
    router = subprocess.Popen(  # noqa: ASYNC220 (once, before the load starts)
        [sys.executable, "-m", "router", "--log-level", "WARNING", "run", "--config", str(config_path)],
        stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        standby = "SELECT count(*) FROM pg_stat_replication WHERE application_name = %s"

        async def streaming() -> bool:
            found = [(await fetch(n.dsn(), standby, [mesh.config.standby_name]))[0][0] for n in nodes]
            return all(found)

        await wait_for(streaming, "the router to stream from every node", 60)
        out = await commits(nodes[0], count, warm)
        await on_b(nodes[1], count + warm)
        return out
    finally:
        if router.poll() is None:
            os.killpg(router.pid, signal.SIGTERM)
            router.wait(60)


async def native_run(nodes: list[LocalNode], count: int, warm: int) -> list[float]:
    a, b = nodes
    for node in nodes:
        await execute(node.dsn(), SCHEMA)
    await execute(a.dsn(), "CREATE PUBLICATION bench_pub FOR TABLE t")
    link = a.dsn().replace("'", "''")
    await execute(b.dsn(), f"CREATE SUBSCRIPTION {SUBSCRIPTION} CONNECTION '{link}' PUBLICATION bench_pub"
                           " WITH (copy_data = false)")
    sync = "SELECT count(*) FROM pg_stat_replication WHERE application_name = %s AND state = 'streaming'"

    async def streaming() -> bool:
        return bool((await fetch(a.dsn(), sync, [SUBSCRIPTION]))[0][0])

    await wait_for(streaming, "the subscription to stream", 60)
    await execute(a.dsn(), f"ALTER SYSTEM SET synchronous_standby_names = '{SUBSCRIPTION}'",
                  "ALTER SYSTEM SET synchronous_commit = 'remote_apply'", "SELECT pg_reload_conf()")
    out = await commits(a, count, warm)
    await on_b(b, count + warm)
    return out


Runner = Callable[[list[LocalNode], Path], Awaitable[list[float]]]


async def measure(settings: dict[str, str], count: int, warm: int) -> dict[str, list[float]]:
    systems: dict[str, Runner] = {
        "pgmesh async": lambda nodes, tmp: pgmesh_run(nodes, 0, count, warm, tmp),
        "pgmesh k=1": lambda nodes, tmp: pgmesh_run(nodes, 1, count, warm, tmp),
        "native remote_apply": lambda nodes, tmp: native_run(nodes, count, warm),
    }
    out = {}
    for name, run in systems.items():
        nodes = create_nodes(["a", "b"], settings=settings)
        try:
            with tempfile.TemporaryDirectory(prefix="pgmesh-synchronous-") as tmp:
                out[name] = await run(nodes, Path(tmp))
        finally:
            for node in nodes:
                node.destroy()
        print(f"{name}: p50 {statistics.median(out[name]) * 1000:.3f} ms", file=sys.stderr)
    return out


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def table(results: dict[str, list[float]]) -> list[str]:
    native = results.get("native remote_apply")
    lines = ["| system | commits | p50 ms | p99 ms | max ms | p50 / native | p99 / native |",
             "|---|---|---|---|---|---|---|"]
    for name, values in results.items():
        p50, p99 = statistics.median(values), quantile(values, 0.99)
        ratios = (f"{p50 / statistics.median(native):.2f} | {p99 / quantile(native, 0.99):.2f}"
                  if native else "- | -")
        lines.append(f"| {name} | {len(values)} | {p50 * 1000:.3f} | {p99 * 1000:.3f} |"
                     f" {max(values) * 1000:.3f} | {ratios} |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.synchronous",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=5000, help="measured commits per system")
    parser.add_argument("--warm", type=int, default=200, help="unmeasured commits first")
    parser.add_argument("--fsync", action="store_true", help="the nodes with fsync on (default: off)")
    args = parser.parse_args(argv)
    settings = {**NODE_SETTINGS, **({"fsync": "on"} if args.fsync else {})}
    results = asyncio.run(measure(settings, args.commits, args.warm))
    print("\n".join(table(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
