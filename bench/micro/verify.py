"""Continuous verification's two promises (issue 38 item 2), on three nodes a, b, c with the router in a
process of its own:

(a) detection: a 1M-row table (`big`, pgbench_accounts' shape) and pgbench's tables at `--scale`, loaded
    alike on every node before `pgmesh init`. With `[verify] interval = --detect-interval`, once the first
    full pass has ended, at a random moment within the next interval one row of `big` is changed on b in
    a session under a replication origin of its own (pgmesh does not carry it); reported: the seconds from
    that commit until /metrics shows pgmesh_divergent_rows{node="b",table="public.big"} 1 and `pgmesh
    status` names it, against the bound interval + 60 s, with the time a full pass takes.
(b) cost: `big` dropped, TPC-B (pgbench's default script, `--clients` clients, `--seconds` s) on a while
    the router replicates to b and c, with verification off, on at its default interval (10 min), and on
    at `--short-interval` (passes back to back), in alternating runs of one invocation (the router started
    afresh for each, the links caught up before the window and after it). The default interval's first
    pass starts 5 s after the router does (router.service.verify.verifier FIRST_PASS_S), so the window
    holds one full pass over pgbench's tables (at `--scale` 10: 1M accounts): each run checks it (the
    status's pass count and end time) and says so. An unmeasured window of `--warm` s comes first. A
    window of 2 minutes holds one pass where the default interval holds one per 10 minutes: the cost it
    shows is about 5 times the steady one. Two clients: with four, replication on this 2-core machine fell
    behind for good (its lag past 50 s after 90 s, verification on), and a barrier is then never reached.
    Medians, and each "on"'s ratio to "off".

    .venv/bin/python -m bench.micro.verify                         # about 30 min
    .venv/bin/python -m bench.micro.verify --rows 100000 --scale 1 --detect-interval 10s --seconds 15 \\
        --runs 1                                                   # a check that it runs (about 2 min)

Writes its report to bench/results/issue38/verify.md (appended) unless --out says otherwise.
Owns: its nodes, the loads and the report. Must not: touch anything but the nodes it creates and destroys.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg

from bench.harness.nodes import checkpoint, pgbench, pgbench_tps
from bench.micro import emit
from router.config.sections import duration_seconds
from router.testing.localnodes import LocalNode, LocalNodeSet
from router.testing.mesh import NODE_SETTINGS, Mesh, execute, free_port, prepare_mesh, wait_for

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "bench" / "results" / "issue38" / "verify.md"
BIG = "CREATE TABLE big (aid bigint PRIMARY KEY, bid int NOT NULL, abalance int NOT NULL, filler char(84))"
LOAD = "INSERT INTO big SELECT g, (g - 1) / 100000 + 1, 0, '' FROM generate_series(1, %s) g"
DIVERGENT = re.compile(r'pgmesh_divergent_rows\{node="(\w+)",table="([\w.]+)"\} (\S+)')


class Router:
    """`pgmesh run` in a process of its own, over one config file; its admin API read over HTTP."""

    def __init__(self, config: Path, port: int, log: Path) -> None:
        self.port = port
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router", "--log-level", os.environ.get("BENCH_LOG_LEVEL", "INFO"), "run",
             "--config", str(config)],
            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO,
        )

    def get(self, path: str) -> bytes | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as reply:
                body: bytes = reply.read()
                return body
        except OSError:
            return None

    def status(self) -> dict[str, Any] | None:
        body = self.get("/status")
        return None if body is None else dict(json.loads(body))

    def divergent(self) -> dict[tuple[str, str], float]:
        body = self.get("/metrics") or b""
        return {(m[1], m[2]): float(m[3]) for m in DIVERGENT.finditer(body.decode())}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def caught_up(status: dict[str, Any] | None) -> bool:
    """Every link streaming, nothing queued, no lag."""
    if status is None or not status.get("running") or not status["links"]:
        return False
    return all(lk["state"] == "streaming" and lk["queued"] == 0 and not lk["lag_bytes"]
               for lk in status["links"])


async def started(router: Router) -> None:
    await wait_for(lambda: caught_up(router.status()), "the router streaming, every link caught up", 300)


def verify_of(router: Router) -> dict[str, Any]:
    status = router.status() or {}
    return dict(status.get("verify") or {})


async def load(nodes: list[LocalNode], rows: int, scale: int) -> float:
    """`big` and pgbench's tables alike on every node (pgbench_history with a key, as the suite's)."""
    began = time.monotonic()

    async def one(node: LocalNode) -> None:
        await execute(node.dsn(), BIG)
        await execute(node.dsn(), LOAD, params=[rows])
        await pgbench("-i", "-s", str(scale), "-q", node.dsn())
        await execute(node.dsn(), "ALTER TABLE pgbench_history ADD COLUMN hid bigserial PRIMARY KEY",
                      "VACUUM ANALYZE")

    for node in nodes:  # one at a time: 2 cores
        await one(node)
    return time.monotonic() - began


async def hidden_change(node: LocalNode, key: int) -> float:
    """Change `big`'s row `key` on `node` under a foreign replication origin; the commit's time."""
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        await conn.execute("SELECT pg_replication_origin_create('bench_hidden') WHERE NOT EXISTS"
                           " (SELECT 1 FROM pg_replication_origin WHERE roname = 'bench_hidden')")
        await conn.execute("SELECT pg_replication_origin_session_setup('bench_hidden')")
        await conn.execute("UPDATE big SET abalance = abalance + 1 WHERE aid = %s", [key])
        return time.monotonic()


async def detect(mesh: Mesh, work: Path, rows: int, interval: str) -> list[str]:
    """(a): the seconds from the hidden change to the metric and the status line."""
    port = mesh.admin_port
    config = mesh.write_config(work / "detect.toml", extra=f'\n[verify]\ninterval = "{interval}"\n')
    router = Router(config, port, work / "router.log")
    try:
        await started(router)
        await wait_for(lambda: verify_of(router).get("passes", 0) >= 1, "the first full pass", 900)
        first = verify_of(router)
        every = duration_seconds(interval)
        await asyncio.sleep(random.uniform(0, every))  # the change lands anywhere in the pass cycle
        key = random.randint(1, rows)
        changed = await hidden_change(mesh.nodes[1], key)
        await wait_for(lambda: router.divergent().get(("b", "public.big")) == 1.0, "the metric", every + 600)
        metric_s = time.monotonic() - changed
        await wait_for(lambda: "public.big" in verify_of(router).get("divergent", {}), "the status", 60)
        status_s = time.monotonic() - changed
        line = verify_of(router)
        ok = metric_s <= every + 60 and status_s <= every + 60
        return [
            f"(a) detection: `[verify] interval = \"{interval}\"`; a full pass over every table ({rows:,}"
            f" rows of big, pgbench's at the scale) took {first.get('last_pass_seconds')} s; row {key} of big"
            " changed on b under a foreign replication origin at a random moment of the cycle:\n",
            "| from the change to | seconds | bound (interval + 60 s) | within |",
            "|---|--:|--:|---|",
            f"| /metrics pgmesh_divergent_rows{{node=\"b\",table=\"public.big\"}} 1 | {metric_s:.1f} |"
            f" {every + 60:.0f} | {'yes' if metric_s <= every + 60 else 'NO'} |",
            f"| `pgmesh status` names it | {status_s:.1f} | {every + 60:.0f} |"
            f" {'yes' if status_s <= every + 60 else 'NO'} |",
            f"\nstatus then: divergent {line.get('divergent')}, first keys {line.get('first_keys')};"
            f" {'PASS' if ok else 'FAIL'}\n",
        ]
    finally:
        router.stop()


async def tpcb_run(mesh: Mesh, work: Path, name: str, extra: str, seconds: int, clients: int
                   ) -> tuple[float, str]:
    """One window of TPC-B on a with the router running `extra`'s [verify] (or none): tps, and for a
    run with verification, whether a full pass began and ended inside the window."""
    config = mesh.write_config(work / f"{name}.toml", extra=extra)
    await checkpoint(mesh.nodes)
    router = Router(config, mesh.admin_port, work / "router.log")
    try:
        await started(router)
        began = time.time()
        before = verify_of(router).get("passes", 0)
        out = await pgbench("-n", "-T", str(seconds), "-c", str(clients), "-j", "2", mesh.nodes[0].dsn())
        ended = time.time()
        after = verify_of(router)
        await wait_for(lambda: caught_up(router.status()), "the links caught up after the window", 600)
    finally:
        router.stop()
    if not extra:
        return pgbench_tps(out), ""
    passes = after.get("passes", 0) - before
    end = after.get("last_pass_end")
    inside = passes >= 1 and end is not None and began <= _unix(end) <= ended
    return pgbench_tps(out), f"{passes} full pass(es) in the window ({'yes' if inside else 'NO'})" + (
        f", the last {after.get('last_pass_seconds')} s" if passes else "")


def _unix(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


async def cost(mesh: Mesh, work: Path, args: argparse.Namespace) -> list[str]:
    """(b): alternating runs, medians and ratios."""
    await execute(mesh.nodes[0].dsn(), "DROP TABLE big")  # replicated to b and c
    kinds = {
        "off": "",
        "on, default interval (10 min)": "\n[verify]\n",
        f"on, interval {args.short_interval}": f'\n[verify]\ninterval = "{args.short_interval}"\n',
    }
    if args.warm:  # unmeasured: the first window after loading runs slower (autovacuum, cold caches)
        value, _ = await tpcb_run(mesh, work, "warm", "", args.warm, args.clients)
        print(f"warm-up: {value:.0f} tps (not counted)", file=sys.stderr)
    tps: dict[str, list[float]] = {k: [] for k in kinds}
    notes: dict[str, list[str]] = {k: [] for k in kinds}
    for run in range(args.runs):
        order = list(kinds) if run % 2 == 0 else list(reversed(kinds))
        for i, kind in enumerate(order):
            value, note = await tpcb_run(mesh, work, f"run{run}_{i}", kinds[kind], args.seconds, args.clients)
            tps[kind].append(value)
            notes[kind].append(note)
            print(f"run {run + 1} {kind}: {value:.0f} tps {note}", file=sys.stderr)
    off = statistics.median(tps["off"])
    lines = [
        f"(b) TPC-B on a (pgbench default script, scale {args.scale}, {args.clients} clients,"
        f" {args.seconds} s per window), the router replicating to b and c; {args.runs} run(s) of each,"
        " alternating:\n",
        "| verification | tps per run | median | / off | a full pass inside each window |",
        "|---|---|--:|--:|---|",
    ]
    for kind, values in tps.items():
        median = statistics.median(values)
        lines.append(f"| {kind} | {', '.join(f'{v:.0f}' for v in values)} | {median:.0f} |"
                     f" {median / off:.3f}x | {'; '.join(n for n in notes[kind] if n) or '-'} |")
    default = statistics.median(tps["on, default interval (10 min)"]) / off
    verdict = "PASS" if default >= 0.95 else "FAIL"
    lines.append(f"\non at the default interval: {default:.3f}x of off ({verdict} against >= 0.95x)\n")
    return lines


async def run(args: argparse.Namespace) -> str:
    work = Path(tempfile.mkdtemp(prefix="pgmesh-verify-"))
    os.chmod(work, 0o755)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, work, True)
        nodes = stack.enter_context(LocalNodeSet(["a", "b", "c"], base_dir=work, settings=NODE_SETTINGS))
        load_s = await load(nodes, args.rows, args.scale)
        mesh = await prepare_mesh(nodes, cluster="bench", admin_port=free_port())
        began = time.monotonic()
        command = " ".join(["python -m bench.micro.verify", *args.argv])
        lines = [f"continuous verification, 3 nodes (`{command}`); loading took {load_s:.0f} s\n"]
        lines += await detect(mesh, work, args.rows, args.detect_interval)
        lines += await cost(mesh, work, args)
        lines.append(f"(the measured part took {time.monotonic() - began:.0f} s)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.verify", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of big (detection)")
    parser.add_argument("--scale", type=int, default=10, help="pgbench scale (10: 1M accounts)")
    parser.add_argument("--detect-interval", default="60s", help="[verify] interval for the detection")
    parser.add_argument("--short-interval", default="20s", help="the shorter interval of the cost runs")
    parser.add_argument("--seconds", type=int, default=120, help="TPC-B window per run")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--warm", type=int, default=30, help="seconds of unmeasured TPC-B first (0: none)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each kind")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    emit(asyncio.run(run(args)), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
