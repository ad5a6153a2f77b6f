"""The fault suite: real three-node clusters, the real router in a process of its own, one fault each.

`python -m bench.faults [--small] [--only NAME] [--report PATH]` runs every scenario and writes the
report (a Markdown table: fault, workload, convergence time, rows lost, duplicated, peak router RSS, peak
retained WAL of the live nodes); tests/integration/test_faults.py runs the same scenarios at `--small` size.

Each scenario starts three fresh nodes (a, b, c; the router reaches c through a proxy where the fault is
on the network), `pgmesh init`, the router (`python -m router run`), and a ledger workload on a and b: every
transaction inserts a transfer as two entries (a debit and a credit of one amount) and an ack row; the ids
of the transactions whose commit returned are kept. During the load the fault hits node c (or the router);
then the load stops, the fault ends and the clock runs until the three nodes hold identical rows. Then:
- every node: the entries sum to 0 and each transfer has exactly its two entries (no partial transaction);
- every acknowledged transaction is present on every node, exactly once (lost / duplicated);
- the router's peak RSS and the live nodes' peak retained WAL (pgmesh's slot: WAL end - restart_lsn,
  sampled every second) within the scenario's bounds.

Faults: `cut` (the router's connections to c blackholed: bytes accepted, nothing delivered), `router-kill`
(SIGKILL mid-load, restarted), `node-immediate` (c stopped with -m immediate, started again), `node-sigstop`
(every process of c stopped with SIGSTOP, then SIGCONT), `log-cap` (c stopped while a and b write more than
the router log's cap: the stated policy holds the WAL in the slots; c comes back), `big-txn` (one
transaction of many rows, the router SIGKILLed while it is being applied), `far-target` (c 50 ms away
through a delaying proxy).

`python -m bench.faults --nemesis --minutes M [--seed S]` is the randomized fault run instead
(bench/nemesis.py: every kind of fault at random on one cluster with a standby router, then the same
invariants).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from bench import nemesis
from bench.harness.delay import DelayLinks
from router.cluster.install import init_cluster
from router.config.model import parse_config
from router.testing.localnodes import LocalNode, LocalNodeSet
from router.testing.mesh import converged, execute, fetch, wait_for
from router.testing.proxy import TcpProxy

SCHEMA = """
CREATE TABLE entries (id bigint PRIMARY KEY, transfer bigint NOT NULL, acct int NOT NULL,
                      amount bigint NOT NULL);
CREATE TABLE acks (id bigint PRIMARY KEY, node text NOT NULL, rows int NOT NULL DEFAULT 1);
"""
TABLES = ["entries", "acks"]
SETTINGS = {"wal_sender_timeout": "10s", "deadlock_timeout": "100ms"}
RSS_BOUND_MB = 1024
RETAINED_BOUND_MB = 256
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    fault: str
    workload: str
    converge_s: float
    lost: int
    duplicated: int
    peak_rss_mb: float
    peak_retained_mb: float
    ledger_ok: bool
    bounds: str
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.lost == 0 and self.duplicated == 0 and self.ledger_ok and self.converge_s >= 0
                and self.peak_rss_mb <= RSS_BOUND_MB and self.within)

    within: bool = True

    def row(self) -> str:
        mark = "ok" if self.ok else "FAILED"
        converge = f"{self.converge_s:.1f}" if self.converge_s >= 0 else "never"
        return (f"| {self.fault} | {self.workload} | {converge} | {self.lost} | {self.duplicated} |"
                f" {self.peak_rss_mb:.0f} | {self.peak_retained_mb:.1f} | {self.bounds} | {mark} |")


HEADER = ("| fault | workload | converged after (s) | rows lost | duplicated | peak router RSS (MB) |"
          " peak retained WAL, live nodes (MB) | bound | |\n|---|---|--:|--:|--:|--:|--:|---|---|")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Cluster:
    """Three nodes, pgmesh installed, the router in a process of its own; the workload and the probes."""

    def __init__(self, nodes: list[LocalNode], workdir: Path, *, c_dsn: str | None = None,
                 log: str = "") -> None:
        self.nodes = nodes
        self.workdir = workdir
        self.admin_port = _free_port()
        lines = ['[cluster]\nname = "f"\n']
        for node in nodes:
            dsn = c_dsn if node.name == "c" and c_dsn else node.dsn()
            lines.append(f'[[nodes]]\nname = "{node.name}"\ndsn = "{dsn}"\n')
        lines.append("[replication]\nstatus_interval_ms = 200\nnode_timeout_ms = 3000\n"
                     "queue_max_transactions = 500\n")
        lines.append(f'[admin]\nlisten = "127.0.0.1:{self.admin_port}"\n')
        lines.append(f'[log]\ndirectory = "{workdir / "log"}"\nhold_s = 3\n{log}\n')
        self.config_path = workdir / "config.toml"
        self.config_path.write_text("\n".join(lines))
        self.router: subprocess.Popen[bytes] | None = None
        self.acked: dict[int, int] = {}  # transfer id -> rows it inserted (its entries), commit returned
        self.maybe: set[int] = set()  # commit sent, no answer: may or may not be there
        self.peak_rss_kb = 0
        self.peak_retained = 0
        self.down: set[str] = set()  # nodes the probes leave alone (stopped)
        self._probes: list[asyncio.Task[None]] = []

    async def setup(self) -> None:
        for node in self.nodes:
            await execute(node.dsn(), SCHEMA)
        config = parse_config(self.config_path.read_text())
        report, _ = await init_cluster(config)
        if not report.ok:
            raise RuntimeError(report.render())

    def start_router(self) -> None:
        log = (self.workdir / "router.log").open("ab")
        self.router = subprocess.Popen(
            [sys.executable, "-m", "router", "--log-level", "INFO", "run", "--config", str(self.config_path)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO,
        )

    def kill_router(self) -> None:
        if self.router is not None and self.router.poll() is None:
            os.killpg(self.router.pid, signal.SIGKILL)
            self.router.wait()

    def stop_router(self) -> None:
        if self.router is not None and self.router.poll() is None:
            os.killpg(self.router.pid, signal.SIGTERM)
            try:
                self.router.wait(60)
            except subprocess.TimeoutExpired:
                self.kill_router()

    def status_text(self) -> str:
        """The router's /status, in short (for a report on a scenario that did not converge)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/status", timeout=5) as reply:
                status = json.loads(reply.read())
        except (OSError, ValueError) as exc:
            return f"unavailable ({exc})"
        links = [f"{lk['source']}->{lk['target']} {lk['state']} applied {lk['applied_lsn']}"
                 f" queued {lk['queued']} {lk['last_error'] or ''}" for lk in status["links"]]
        sources = [f"{s['node']} {s['state']} confirmed {s['confirmed_lsn']} log {s.get('log')}"
                   for s in status["sources"]]
        return "; ".join(links + sources)

    # ------------------------------------------------------------ probes

    def start_probes(self) -> None:
        self._probes = [asyncio.create_task(self._sample_rss()), asyncio.create_task(self._sample_retained())]

    async def stop_probes(self) -> None:
        for task in self._probes:
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)

    async def _sample_rss(self) -> None:
        while True:
            if self.router is not None and self.router.poll() is None:
                self.peak_rss_kb = max(self.peak_rss_kb, _rss_kb(self.router.pid))
            await asyncio.sleep(0.5)

    async def _sample_retained(self) -> None:
        query = ("SELECT coalesce(max(pg_current_wal_lsn() - restart_lsn), 0)::bigint"
                 " FROM pg_replication_slots WHERE slot_name = 'pgmesh_f'")
        while True:
            for node in self.nodes:
                if node.name in self.down or node.name == "c":
                    continue
                with contextlib.suppress(psycopg.Error, OSError, TimeoutError):
                    async with asyncio.timeout(3):
                        (row,) = await fetch(node.dsn(), query)
                    self.peak_retained = max(self.peak_retained, int(row[0]))
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------ workload

    async def write(self, node: LocalNode, index: int, stop: asyncio.Event, first: int = 0) -> int:
        """Transfers on `node` until `stop`; returns how many were acknowledged."""
        rng = random.Random(index)
        serial = first
        done = 0
        while not stop.is_set():
            try:
                async with asyncio.timeout(10):
                    conn = await psycopg.AsyncConnection.connect(node.dsn(), connect_timeout=5)
            except (psycopg.Error, OSError, TimeoutError):
                await asyncio.sleep(0.5)
                continue
            try:
                while not stop.is_set():
                    serial += 1
                    transfer = index * 10**12 + serial
                    amount = rng.randrange(1, 1000)
                    await conn.execute(
                        "INSERT INTO entries VALUES (%s, %s, %s, %s), (%s, %s, %s, %s)",
                        [transfer * 2, transfer, rng.randrange(100), -amount,
                         transfer * 2 + 1, transfer, rng.randrange(100), amount],
                    )
                    await conn.execute("INSERT INTO acks VALUES (%s, %s, 2)", [transfer, node.name])
                    self.maybe.add(transfer)
                    async with asyncio.timeout(10):
                        await conn.commit()
                    self.maybe.discard(transfer)
                    self.acked[transfer] = 2
                    done += 1
            except (psycopg.Error, OSError, TimeoutError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    await conn.close()
        return done

    async def big_transaction(self, node: LocalNode, rows: int, transfer: int) -> None:
        """One transaction inserting `rows` entries (transfers of two entries each) and its ack."""
        half = rows // 2
        async with await psycopg.AsyncConnection.connect(node.dsn()) as conn:
            await conn.execute(
                "INSERT INTO entries SELECT %s + g, %s + g / 2, g %% 100, CASE WHEN g %% 2 = 0"
                " THEN -(g / 2 + 1) ELSE g / 2 + 1 END FROM generate_series(0, %s) g",
                [transfer * 10**7, transfer * 10**7, half * 2 - 1],
            )
            await conn.execute("INSERT INTO acks VALUES (%s, %s, %s)", [transfer, node.name, half * 2])
            await conn.commit()
        self.acked[transfer] = half * 2

    # ------------------------------------------------------------ the end

    async def wait_converged(self, limit: float) -> float:
        began = time.monotonic()
        while time.monotonic() - began < limit:
            with contextlib.suppress(psycopg.Error, OSError):
                if await converged(self.nodes, TABLES):
                    return time.monotonic() - began
            await asyncio.sleep(0.5)
        return -1.0

    async def check(self) -> tuple[int, int, bool, list[str]]:
        """Rows lost, duplicated, whether every ledger balances, notes."""
        lost = duplicated = 0
        ok = True
        notes = []
        acked = list(self.acked)
        for node in self.nodes:
            (present,) = await fetch(node.dsn(), "SELECT count(*) FROM acks WHERE id = ANY(%s)",
                                     params=[acked])
            lost += len(acked) - int(present[0])
            (total,) = await fetch(node.dsn(), "SELECT count(*) FROM acks")
            extra = int(total[0]) - len(acked) - len(self.maybe)
            duplicated += max(0, extra)
            (ledger,) = await fetch(node.dsn(), "SELECT coalesce(sum(amount), 0), count(*) FROM entries")
            (partial,) = await fetch(
                node.dsn(), "SELECT count(*) FROM (SELECT transfer FROM entries GROUP BY transfer"
                " HAVING count(*) <> 2 OR sum(amount) <> 0) x")
            (rows,) = await fetch(node.dsn(), "SELECT coalesce(sum(rows), 0) FROM acks")
            if int(ledger[0]) != 0 or int(partial[0]) != 0 or int(ledger[1]) != int(rows[0]):
                ok = False
                notes.append(f"node {node.name}: ledger sum {ledger[0]}, {partial[0]} partial transfers,"
                             f" {ledger[1]} entries for {rows[0]} acknowledged")
        return lost, duplicated, ok, notes


# ------------------------------------------------------------ scenarios


@dataclass
class Size:
    load_s: float  # how long the workload runs around the fault
    fault_s: float  # how long the fault lasts
    big_rows: int
    converge_s: float = 600.0


FULL = Size(load_s=20, fault_s=60, big_rows=1_000_000)
SMALL = Size(load_s=3, fault_s=6, big_rows=40_000, converge_s=240.0)


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
    except OSError:
        return 0


def _pids(postmaster: int) -> list[int]:
    """The postmaster and its children."""
    out = [postmaster]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == postmaster:
                    out.append(int(entry.name))
    return out


async def _load_around(cluster: Cluster, size: Size, fault: Callable[[], Awaitable[None]]) -> None:
    """Writers on a and b; the fault in the middle of the load; writers stop once it is over."""
    stop = asyncio.Event()
    a, b, _ = cluster.nodes
    writers = [asyncio.create_task(cluster.write(a, 1, stop)), asyncio.create_task(cluster.write(b, 2, stop))]
    await asyncio.sleep(size.load_s / 2)
    await fault()
    await asyncio.sleep(size.load_s / 2)
    stop.set()
    await asyncio.gather(*writers)


async def _cut(cluster: Cluster, size: Size, proxy: TcpProxy) -> str:
    async def fault() -> None:
        proxy.blackhole()
        await asyncio.sleep(size.fault_s)
        proxy.restore()
    await _load_around(cluster, size, fault)
    return f"router <-> c blackholed {size.fault_s:.0f} s"


async def _router_kill(cluster: Cluster, size: Size, _: Any) -> str:
    async def fault() -> None:
        cluster.kill_router()
        cluster.start_router()
    await _load_around(cluster, size, fault)
    return "SIGKILL mid-load, restarted"


async def _node_immediate(cluster: Cluster, size: Size, _: Any) -> str:
    c = cluster.nodes[2]

    async def fault() -> None:
        cluster.down.add("c")
        c.stop("immediate")
        await asyncio.sleep(size.fault_s / 3)
        c.start()
        cluster.down.discard("c")
    await _load_around(cluster, size, fault)
    return f"c: pg_ctl stop -m immediate, {size.fault_s / 3:.0f} s, start"


async def _node_sigstop(cluster: Cluster, size: Size, _: Any) -> str:
    c = cluster.nodes[2]
    duration = size.fault_s * 2

    async def fault() -> None:
        postmaster = int((c.datadir / "postmaster.pid").read_text().split()[0])
        pids = _pids(postmaster)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(duration)
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
    await _load_around(cluster, size, fault)
    return f"c: SIGSTOP {duration:.0f} s, SIGCONT"


async def _log_cap(cluster: Cluster, size: Size, _: Any) -> str:
    c = cluster.nodes[2]

    async def fault() -> None:
        cluster.down.add("c")
        c.stop("fast")
        await asyncio.sleep(size.fault_s)
        c.start()
        cluster.down.discard("c")
    await _load_around(cluster, size, fault)
    return f"c stopped {size.fault_s:.0f} s; log cap 2 MB"


async def _big_txn(cluster: Cluster, size: Size, _: Any) -> str:
    a, _, c = cluster.nodes
    await cluster.big_transaction(a, size.big_rows, 7)

    async def applying() -> bool:  # a transaction running on c for a while: the big one being applied
        (row,) = await fetch(c.dsn(), "SELECT count(*) FROM pg_stat_activity WHERE state = 'active'"
                             " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
                             " AND now() - xact_start > interval '500 ms'")
        return int(row[0]) > 0

    when = "while c applied it"
    try:
        await wait_for(applying, "the big transaction to be applied on c", 120)
    except AssertionError:
        when = "after it was applied (too quick to catch)"
    cluster.kill_router()
    cluster.start_router()
    return f"{size.big_rows:,} rows in one transaction; router SIGKILLed {when}"


async def _far(cluster: Cluster, size: Size, delay: DelayLinks) -> str:
    async def fault() -> None:
        await asyncio.sleep(size.fault_s)
    await _load_around(cluster, size, fault)
    rtt = delay.round_trip_ms(cluster.nodes[2], 20)[1]
    return f"c 50 ms away each way (round trip measured {rtt:.0f} ms)"


SCENARIOS: dict[str, tuple[Callable[[Cluster, Size, Any], Awaitable[str]], str]] = {
    "cut": (_cut, "proxy"),
    "router-kill": (_router_kill, ""),
    "node-immediate": (_node_immediate, ""),
    "node-sigstop": (_node_sigstop, ""),
    "log-cap": (_log_cap, "cap"),
    "big-txn": (_big_txn, ""),
    "far-target": (_far, "delay"),
}


async def run_scenario(name: str, size: Size, base: Path | None = None) -> Result:
    """One scenario on fresh nodes; always tears them down, and its directory (the router's output and
    log) unless it failed."""
    workdir = Path(tempfile.mkdtemp(prefix=f"pgmesh-fault-{name}-", dir=base))
    result = await _run_in(name, size, workdir)
    if result.ok:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        result.notes.append(f"the router's output and log are in {workdir}")
    return result


async def _run_in(name: str, size: Size, workdir: Path) -> Result:
    scenario, needs = SCENARIOS[name]
    os.chmod(workdir, 0o755)  # the nodes' directories are in it, and their servers run as postgres
    with LocalNodeSet(["a", "b", "c"], settings=SETTINGS, base_dir=workdir) as nodes:
        extra: Any = None
        c_dsn = None
        if needs == "proxy":
            extra = TcpProxy("127.0.0.1", nodes[2].port).start()
            c_dsn = nodes[2].dsn().replace(f"port={nodes[2].port}", f"port={extra.port}")
        elif needs == "delay":
            extra = DelayLinks([nodes[2]], rtt_ms=100)  # 50 ms each way
            c_dsn = extra.dsn(nodes[2])
        log = "cap_mb = 2\nsegment_mb = 1\n" if needs == "cap" else ""
        cluster = Cluster(nodes, workdir, c_dsn=c_dsn, log=log)
        try:
            await cluster.setup()
            cluster.start_router()
            cluster.start_probes()
            workload = await scenario(cluster, size, extra)
            converge = await cluster.wait_converged(size.converge_s)
            await cluster.stop_probes()
            lost, duplicated, ledger_ok, notes = await cluster.check()
            if converge < 0:
                notes.append(f"not converged; the router's status: {cluster.status_text()}")
            retained_mb = cluster.peak_retained / 2**20
            bound = RETAINED_BOUND_MB if needs != "cap" else 10_000
            result = Result(
                name, workload + f"; {len(cluster.acked):,} transactions acknowledged", converge, lost,
                duplicated, cluster.peak_rss_kb / 1024, retained_mb, ledger_ok,
                f"RSS <= {RSS_BOUND_MB} MB, retained <= {bound} MB" if needs != "cap"
                else f"RSS <= {RSS_BOUND_MB} MB; WAL held by the policy", notes,
            )
            result.within = retained_mb <= bound
            return result
        finally:
            await cluster.stop_probes()
            cluster.stop_router()
            if extra is not None:
                extra.close()


def render(results: list[Result], size: Size) -> str:
    lines = [f"Fault suite ({'small' if size is SMALL else 'full'} size; `python -m bench.faults`)\n", HEADER]
    lines += [r.row() for r in results]
    for r in results:
        lines += [f"- {r.fault}: {note}" for note in r.notes]
    return "\n".join(lines) + "\n"


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="the sizes the tests use")
    parser.add_argument("--only", action="append", choices=sorted(SCENARIOS))
    parser.add_argument("--report", type=Path)
    nemesis.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.nemesis:
        return await nemesis.main(args.minutes, args.seed, args.report, args.pace_ms / 1000, args.lease_s)
    size = SMALL if args.small else FULL
    results = []
    for name in args.only or list(SCENARIOS):
        result = await run_scenario(name, size)
        print(result.row(), flush=True)
        results.append(result)
    text = render(results, size)
    print(text)
    if args.report is not None:
        args.report.write_text(text)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
