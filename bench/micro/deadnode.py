"""A node stopped while the others write: how much WAL do the live nodes keep? (issue 21's must-show)

Three nodes a, b, c with pgmesh and the router (`python -m router run`, a process of its own). c is stopped
(`pg_ctl stop -m fast`); a and b then write `--gb` GB of WAL between them (transactions of 20 rows of 2 kB,
uncompressed, half on each). Every second the bench reads what pgmesh's slot keeps on a and on b (WAL end -
restart_lsn) and the router's log of each (its /status). Then c starts again and the clock runs until the
three nodes hold the same rows; every row is checked to be on every node once.

    .venv/bin/python -m bench.micro.deadnode [--gb 2] [--out bench/results/issue21/deadnode.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psycopg

from bench.faults import Cluster
from bench.micro import emit
from router.cluster.install import init_cluster
from router.config.model import parse_config
from router.testing.localnodes import LocalNode, LocalNodeSet
from router.testing.mesh import converged, execute, fetch, wait_for

SCHEMA = """CREATE TABLE doc (id bigint PRIMARY KEY, src text NOT NULL, body text NOT NULL);
ALTER TABLE doc ALTER body SET STORAGE EXTERNAL;"""
INSERT = "INSERT INTO doc SELECT g, %s, %s || g FROM generate_series(%s::bigint, %s::bigint) g"
ROWS = 20
FILLER = "x" * 2000
SETTINGS = {"max_wal_size": "4GB", "wal_sender_timeout": "30s"}


async def same_rows(nodes: list[LocalNode]) -> bool:
    """The same ids on every node (a fingerprint of every row would not fit in 1 GB here)."""
    query = "SELECT count(*), coalesce(sum(id), 0), coalesce(sum(length(body)), 0) FROM doc"
    found = [await fetch(n.dsn(), query) for n in nodes]
    return all(f == found[0] for f in found[1:])


async def wal_lsn(node: LocalNode) -> int:
    (row,) = await fetch(node.dsn(), "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
    return int(row[0])


async def write_until(node: LocalNode, first: int, stop_at: int, rate: float) -> int:
    """Transactions of ROWS rows until the node's WAL reaches `stop_at`, at about `rate` bytes of WAL a
    second (a steady load the router decodes as it comes); returns the rows written."""
    rows = 0
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        cur = await conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
        row = await cur.fetchone()
        assert row is not None
        began, start = time.monotonic(), int(row[0])
        while True:
            for _ in range(25):
                base = first + rows
                await conn.execute(INSERT, [node.name, FILLER, base, base + ROWS - 1])
                rows += ROWS
            cur = await conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
            row = await cur.fetchone()
            assert row is not None
            if int(row[0]) >= stop_at:
                return rows
            ahead = (int(row[0]) - start) / rate - (time.monotonic() - began)
            if ahead > 0:
                await asyncio.sleep(ahead)  # (the pace of the load, not a wait for a condition)


def router_logs(port: int) -> dict[str, int]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as reply:
            status = json.loads(reply.read())
    except (OSError, ValueError):
        return {}
    return {s["node"]: s["log"]["bytes"] for s in status["sources"] if s.get("log")}


async def sample(nodes: list[LocalNode], port: int, peaks: dict[str, int], logs: dict[str, int]) -> None:
    query = ("SELECT coalesce(max(pg_current_wal_lsn() - restart_lsn), 0)::bigint FROM pg_replication_slots"
             " WHERE slot_name = 'pgmesh_f'")
    while True:
        for node in nodes:
            with contextlib.suppress(psycopg.Error, OSError):
                (row,) = await fetch(node.dsn(), query)
                peaks[node.name] = max(peaks.get(node.name, 0), int(row[0]))
        for name, size in (await asyncio.to_thread(router_logs, port)).items():
            logs[name] = max(logs.get(name, 0), size)
        await asyncio.sleep(1.0)


async def run(gb: float, rate_mb: float, log: bool) -> str:
    workdir = Path(tempfile.mkdtemp(prefix="pgmesh-deadnode-"))
    os.chmod(workdir, 0o755)
    with LocalNodeSet(["a", "b", "c"], settings=SETTINGS, base_dir=workdir) as nodes:
        a, b, c = nodes
        cluster = Cluster(nodes, workdir, log="" if log else "enabled = false\n")
        for node in nodes:
            await execute(node.dsn(), SCHEMA)
        report, _ = await init_cluster(parse_config(cluster.config_path.read_text()))
        assert report.ok, report.render()
        cluster.start_router()
        try:
            await execute(a.dsn(), INSERT, params=["a", FILLER, 1, ROWS])
            await wait_for(lambda: converged(nodes, ["doc"]), "the first rows everywhere", 120)
            c.stop("fast")
            start = {n.name: await wal_lsn(n) for n in (a, b)}
            peaks: dict[str, int] = {}
            logs: dict[str, int] = {}
            sampler = asyncio.create_task(sample([a, b], cluster.admin_port, peaks, logs))
            half = int(gb * 2**30 / 2)
            began = time.monotonic()
            rate = rate_mb * 2**20
            written_rows = await asyncio.gather(
                write_until(a, 10**9, start["a"] + half, rate),
                write_until(b, 2 * 10**9, start["b"] + half, rate),
            )
            write_s = time.monotonic() - began
            written = {n.name: await wal_lsn(n) - start[n.name] for n in (a, b)}
            await asyncio.sleep(3)  # (the sampler's last look at what stays retained once the writes stop)
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            c.start()
            began = time.monotonic()
            await wait_for(lambda: same_rows(nodes), "the three nodes to converge", 3600)
            converge_s = time.monotonic() - began
            counts = [await fetch(n.dsn(), "SELECT count(*), count(DISTINCT id) FROM doc") for n in nodes]
        finally:
            cluster.stop_router()
    total = sum(written.values())
    expected = ROWS + sum(written_rows)
    lines = [
        f"A node stopped while the two others write {total / 2**30:.2f} GB of WAL, {rate_mb:g} MB/s each,"
        f" router log {'on' if log else 'OFF'} (`python -m bench.micro.deadnode --gb {gb:g}"
        f" --mb-per-s {rate_mb:g}{'' if log else ' --no-log'}`)\n",
        "| node | WAL written (MB) | peak retained by pgmesh's slot (MB) | of all WAL written | of its own |"
        " router log peak (MB) |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for name in ("a", "b"):
        lines.append(
            f"| {name} | {written[name] / 2**20:,.0f} | {peaks.get(name, 0) / 2**20:,.1f} |"
            f" {peaks.get(name, 0) / total:.1%} | {peaks.get(name, 0) / written[name]:.1%} |"
            f" {logs.get(name, 0) / 2**20:,.0f} |"
        )
    rows_ok = all(c[0] == (expected, expected) for c in counts)
    lines += [
        "",
        f"- writing took {write_s:.0f} s; c started again and the three nodes held the same rows"
        f" {converge_s:.0f} s later;",
        f"- rows on a, b, c: {[c[0][0] for c in counts]} (expected {expected} each, every id once:"
        f" {'yes' if rows_ok else 'NO'}).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.deadnode",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="GB of WAL written by a and b together")
    parser.add_argument("--mb-per-s", type=float, default=8.0, help="WAL each writing node writes a second")
    parser.add_argument("--no-log", action="store_true", help="the control: [log] enabled = false")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    text = asyncio.run(run(args.gb, args.mb_per_s, not args.no_log))
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
