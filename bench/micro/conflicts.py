"""The cost of conflicts: A -> B apply throughput with 10% and 100% conflicting transactions vs none.

Two throw-away nodes a and b hold the same `kv` table (seeded through pgmesh itself, so every row on b
was last written by a). With the router stopped, a commits N single-row update transactions, one key
each; in the conflicting variant b first updates 10% of those keys itself, so when the router starts,
those of a's updates meet a row last written by b (`update_origin_differs`): the statement calls its
decision function on b, which decides and records the conflict in the same round trip
(router.apply.decide).
The timed window runs from router start until b's origin for a has reached a's last commit.

    .venv/bin/python -m bench.micro.conflicts                 # N = 10000, 2 runs
    .venv/bin/python -m bench.micro.conflicts --rows 2000 --runs 1 --shares 0,0.1,1

Owns: this workload (the `kv` table, the conflicting share) and its table. Must not: judge a conflict
itself (the router decides and records them; the count is read from b's conflict history), or touch a
node it did not create.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence

import psycopg

from protocol.lsn import parse_lsn
from router.config.model import Config
from router.service.supervisor import Router
from router.testing.localnodes import LocalNode, create_nodes
from router.testing.mesh import setup_mesh

SCHEMA = "CREATE TABLE kv (id int PRIMARY KEY, v int NOT NULL);"


async def _scalar(dsn: str, query: str) -> str:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(query)
        row = await cur.fetchone()
        assert row is not None
        return str(row[0])


async def _updates(dsn: str, keys: Sequence[int], value: int) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn, conn.pipeline():
        for key in keys:
            await conn.execute("UPDATE kv SET v = %s WHERE id = %s", [value, key])


async def one_run(rows: int, conflict_share: float) -> tuple[float, int]:
    """Transactions/s applied a -> b, and conflicts recorded on b."""
    nodes: list[LocalNode] = await asyncio.to_thread(create_nodes, ["a", "b"])
    try:
        a, b = nodes
        config = await setup_mesh(nodes, SCHEMA)
        await _seed(config, a, b, rows)
        conflicting = list(range(1, rows + 1, max(1, round(1 / conflict_share)))) if conflict_share else []
        await _updates(b.dsn(), conflicting, -1)  # b's own concurrent versions of 10% of the keys
        await _updates(a.dsn(), range(1, rows + 1), 1)
        end = parse_lsn(await _scalar(a.dsn(), "SELECT pg_current_wal_lsn()::text"))
        origin = config.origin_name("a")
        stop = asyncio.Event()
        router = Router(config, admin=False)
        started = time.perf_counter()
        task = asyncio.create_task(router.run(stop))
        query = f"SELECT coalesce(pg_replication_origin_progress('{origin}', false), '0/0')::text"
        async with await psycopg.AsyncConnection.connect(b.dsn(), autocommit=True) as conn:
            while True:
                row = await (await conn.execute(query)).fetchone()
                if row is not None and parse_lsn(row[0]) >= end - 200:  # the last commit ends just before
                    break
                await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - started
        stop.set()
        await task
        conflicts = int(await _scalar(b.dsn(), "SELECT count(*) FROM pgmesh.conflict_history"))
        return rows / elapsed, conflicts
    finally:
        for node in nodes:
            await asyncio.to_thread(node.destroy)


async def _seed(config: Config, a: LocalNode, b: LocalNode, rows: int) -> None:
    """Seed through pgmesh, so b's rows carry a's origin."""
    async with await psycopg.AsyncConnection.connect(a.dsn(), autocommit=True) as conn:
        await conn.execute(f"INSERT INTO kv SELECT i, 0 FROM generate_series(1, {rows}) i")
    stop = asyncio.Event()
    router = Router(config, admin=False)
    task = asyncio.create_task(router.run(stop))
    while int(await _scalar(b.dsn(), "SELECT count(*) FROM kv")) < rows:  # noqa: ASYNC110 - polls a node
        await asyncio.sleep(0.05)
    stop.set()
    await task


def main(argv: Sequence[str] | None = None) -> int:
    about = (__doc__ or "").splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m bench.micro.conflicts", description=about)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--shares", default="0,0.1,1", help="conflicting shares, comma-separated")
    args = parser.parse_args(argv)
    shares = [(f"{float(s):.0%}" if float(s) else "none", float(s)) for s in args.shares.split(",")]
    results: dict[str, list[float]] = {label: [] for label, _ in shares}
    counts: dict[str, int] = {}
    for _ in range(args.runs):
        for label, share in shares:
            rate, conflicts = asyncio.run(one_run(args.rows, share))
            results[label].append(rate)
            counts[label] = conflicts
    base = statistics.median(results.get("none") or next(iter(results.values())))
    print(f"pgmesh conflict bench a -> b: {args.rows} single-row update transactions, {args.runs} run(s)")
    print(f"{'conflicting':<12} {'min tx/s':>10} {'median tx/s':>12} {'conflicts on b':>15} {'vs none':>8}")
    for label, rates in results.items():
        median = statistics.median(rates)
        print(f"{label:<12} {min(rates):>10,.0f} {median:>12,.0f} {counts[label]:>15} {median / base:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
