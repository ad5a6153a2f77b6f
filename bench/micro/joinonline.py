"""A join under writes with the router running: how far the existing nodes fall behind each other meanwhile.

Three nodes (a, b, c) hold the same `bench_join` table of --rows rows (5,000,000: about 600 MB) before
pgmesh is installed, then run as one cluster with the real router in a process of its own (`python -m
router run`). On each, a writer commits --rate small transactions a second (one insert, and an update of
an earlier row every third), and a heartbeat inserts `(node, seq, clock_timestamp())` into `beat` every
100 ms. After --warm seconds, node d joins from a (`join_node`, as `pgmesh join d --from a` does), then the
load goes on for --after seconds, stops, and the four nodes must converge to identical rows.

The lag of one heartbeat on another existing node is the time its insert ran there (`got`, set by an
ENABLE ALWAYS trigger, which fires for the router's apply too) minus the time it was written on its source
(`at`): all nodes share one clock here. (The commit timestamp would not do: an applied transaction carries
its source's commit time.) Reported per run: the join's time and its copy's, then the lag of every
heartbeat written before the join (the baseline) and of those written during it (from the join's start
to its end): median, p99 and max. The router's holds during the join show as the short peaks. Target
(issue 22): max lag during the join under 5 s.

    .venv/bin/python -m bench.micro.joinonline                      # 5,000,000 rows, 2 runs
    .venv/bin/python -m bench.micro.joinonline --rows 300000 --runs 1 --warm 5 --after 5
    .venv/bin/python -m bench.micro.joinonline --write     # also bench/results/issue22/join-online.md

Owns: its nodes, the load and the report. Must not: change how join works (it calls join_node), or touch
anything but the nodes it creates and destroys.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from router.ops.join import join_node
from router.testing.localnodes import LocalNode, create_nodes
from router.testing.mesh import NODE_SETTINGS, fetch, free_port, prepare_mesh, wait_converged

RESULTS = Path(__file__).resolve().parents[1] / "results" / "issue22" / "join-online.md"
SCHEMA = """
CREATE TABLE bench_join (id bigint PRIMARY KEY, a int NOT NULL, b text, c numeric, d timestamptz);
CREATE TABLE acct (id bigint PRIMARY KEY, v int NOT NULL, who text);
CREATE TABLE beat (src text, seq bigint, at timestamptz NOT NULL, got timestamptz,
  PRIMARY KEY (src, seq));
CREATE FUNCTION beat_got() RETURNS trigger LANGUAGE plpgsql AS
  $$ BEGIN NEW.got := clock_timestamp(); RETURN NEW; END $$;
CREATE TRIGGER beat_got BEFORE INSERT ON beat FOR EACH ROW EXECUTE FUNCTION beat_got();
ALTER TABLE beat ENABLE ALWAYS TRIGGER beat_got;
"""
FILL = (
    "INSERT INTO bench_join SELECT g, g %% 1000, md5(g::text) || md5((g + 1)::text), g / 7.0,"
    " '2026-01-01'::timestamptz + g * interval '1 second' FROM generate_series(1, %s) g"
)
TABLES = ["bench_join", "acct"]  # (beat: `got` is each node's own arrival time)
LAG = (
    "SELECT extract(epoch FROM at), extract(epoch FROM got - at)"
    " FROM beat WHERE src <> %s"
)


@dataclass
class Run:
    join_s: float = 0.0
    copy_s: float = 0.0
    rows: int = 0
    before: list[float] = field(default_factory=list)
    during: list[float] = field(default_factory=list)
    holds: list[float] = field(default_factory=list)


async def writer(node: LocalNode, base: int, rate: float, stop: asyncio.Event) -> None:
    """`rate` transactions a second on keys only this node writes."""
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        n, start = 0, time.monotonic()
        while not stop.is_set():
            await conn.execute("INSERT INTO acct (id, v, who) VALUES (%s, 0, %s)", [base + n, node.name])
            if n % 3 == 2:
                await conn.execute("UPDATE acct SET v = v + 1 WHERE id = %s", [base + n // 2])
            n += 1
            await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))


async def heartbeat(node: LocalNode, stop: asyncio.Event) -> None:
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        seq = 0
        while not stop.is_set():
            await conn.execute("INSERT INTO beat VALUES (%s, %s, clock_timestamp())", [node.name, seq])
            seq += 1
            await asyncio.sleep(0.1)


def holds(log: Path, start: float, end: float) -> list[float]:
    """Seconds between each 'held' line of the router's log and the next start, within [start, end]."""
    out, held = [], None
    for line in log.read_text(errors="replace").splitlines():
        try:
            at = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000
        except ValueError:
            continue
        if "held (replication waits" in line:
            held = at
        elif "router running with" in line and held is not None:
            if start - 1 <= held <= end + 1:
                out.append(at - held)
            held = None
    return out


async def run_once(rows: int, rate: float, warm: float, after: float, tmp: Path) -> Run:
    nodes = create_nodes(["a", "b", "c", "d"], settings=NODE_SETTINGS)
    router: subprocess.Popen[bytes] | None = None
    try:
        for node in nodes[:3]:
            print(f"loading {rows:,} rows into {node.name} ...", file=sys.stderr)
            with psycopg.connect(node.dsn(), autocommit=True) as conn:
                conn.execute(SCHEMA)
                conn.execute(FILL, [rows])
                conn.execute("VACUUM ANALYZE bench_join")
        mesh = await prepare_mesh(nodes[:3], "", spares=[nodes[3]], admin_port=free_port())
        four = mesh.config_for(nodes)
        config_path = mesh.write_config(tmp / "config.toml", nodes)
        log = tmp / "router.log"
        router = subprocess.Popen(  # noqa: ASYNC220 (once, before the load starts)
            [sys.executable, "-m", "router", "--log-level", "INFO", "run", "--config", str(config_path)],
            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        stop = asyncio.Event()
        load = [asyncio.create_task(writer(n, (i + 1) * 10**9, rate, stop)) for i, n in enumerate(nodes[:3])]
        load += [asyncio.create_task(heartbeat(n, stop)) for n in nodes[:3]]
        await asyncio.sleep(warm)  # (a bench: the load runs for a stated time)
        start = time.time()
        report = await join_node(four, "d", donor="a")
        end = time.time()
        await asyncio.sleep(after)
        stop.set()
        await asyncio.gather(*load)
        await wait_converged(nodes, TABLES, 900)
        run = Run(join_s=end - start, copy_s=report.copy_seconds, rows=report.rows,
                  holds=holds(log, start, end))
        for node in nodes[:3]:
            for at, lag in await fetch(node.dsn(), LAG, params=[node.name]):
                if float(at) < start:
                    run.before.append(float(lag))
                elif float(at) <= end:
                    run.during.append(float(lag))
        return run
    finally:
        if router is not None and router.poll() is None:
            os.killpg(router.pid, signal.SIGTERM)
            router.wait(60)
        for node in nodes:
            node.destroy()


def quantiles(values: Sequence[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return f"{statistics.median(ordered):.3f} / {p99:.3f} / {ordered[-1]:.3f}"


def table(runs: Sequence[Run]) -> list[str]:
    lines = [
        "| run | join s | copy s | rows copied | lag before join: median / p99 / max s (n) |"
        " lag during join: median / p99 / max s (n) | router holds s |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, run in enumerate(runs, 1):
        lines.append(
            f"| {i} | {run.join_s:.1f} | {run.copy_s:.1f} | {run.rows:,} | {quantiles(run.before)}"
            f" ({len(run.before)}) | {quantiles(run.during)} ({len(run.during)}) |"
            f" {', '.join(f'{h:.2f}' for h in run.holds) or '-'} |"
        )
    return lines


async def main_async(args: argparse.Namespace) -> list[Run]:
    runs = []
    for number in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="pgmesh-joinonline-") as tmp:
            run = await run_once(args.rows, args.rate, args.warm, args.after, Path(tmp))
        runs.append(run)
        print(f"run {number + 1}: join {run.join_s:.1f} s, max lag during"
              f" {max(run.during, default=0):.2f} s, holds {run.holds}", file=sys.stderr)
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.joinonline",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--rate", type=float, default=100.0, help="transactions a second per node")
    parser.add_argument("--warm", type=float, default=15.0)
    parser.add_argument("--after", type=float, default=15.0)
    parser.add_argument("--write", action="store_true", help=f"also write the table to {RESULTS}")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    runs = asyncio.run(main_async(args))
    lines = [
        f"# Join under writes, router running: {args.rows:,} rows, {args.rate:g} transactions/s per node"
        f" on a, b, c, heartbeats every 100 ms",
        "",
        f"{platform.node()}, {os.cpu_count()} cores, load average before {load_before[0]:.2f},"
        f" after {os.getloadavg()[0]:.2f}; `python -m bench.micro.joinonline"
        f" {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        *table(runs),
        "",
        "Lag: a heartbeat's insert time on another existing node minus its write time on its source.",
        "Router holds: from 'held' to running again in the router's log (the snapshot's, then the one that"
        " takes d in).",
    ]
    print("\n".join(lines))
    if args.write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
