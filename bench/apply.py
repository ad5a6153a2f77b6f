"""Apply throughput and steady-state lag A -> B: pgmesh beside native logical replication (a SUBSCRIPTION).

Both systems get the same workloads, on fresh node pairs with identical settings, in the same run:

  tpcb   A backlog of `20000 * scale` pgbench TPC-B transactions (`pgbench -n -c 4 -j 2 -t N/4`), generated
         on A while nothing replicates; then replication is started and timed until B has all of it.
         Metrics: applied transactions/s and rows/s (4 row changes per TPC-B transaction).
  bulk   One transaction inserting `200000 * scale` rows into bench_bulk (id int primary key, a int,
         b text), generated as a backlog the same way. Metric: rows/s.
  lag    TPC-B at 300 tx/s (`pgbench -n -R 300 -T T -c 2`, T = 10 s * scale, at least 3 s) with
         replication running, and a probe that inserts a row into bench_probe on A every 50 ms and polls B
         for it every 1 ms. Lag = first poll that sees it on B - commit acknowledged on A (so it includes
         up to ~1 ms of polling granularity, the same for both systems). Metrics: p50 and p99 in ms.

Setup, per system and per run (one fresh node pair each, destroyed at the end): `pgbench -i -s 1` on both
nodes (the same rows on both), `pgbench_history` gets a primary key (`hid bigserial`), then:
  native  A: CREATE PUBLICATION p FOR ALL TABLES; B: CREATE SUBSCRIPTION s ... WITH (copy_data = false,
          enabled = false), which creates the slot on A. Started by ALTER SUBSCRIPTION s ENABLE, stopped by
          DISABLE (and waiting for the worker to exit).
  pgmesh  `pgmesh init` (`setup_mesh`) on a two-node mesh a <-> b. Started by running `Router` in this
          process under uvloop (as `router.testing.mesh.running_router` does), stopped by its stop event.
A backlog is timed from the start command to the moment a marker row, committed on A right after the
backlog, is visible on B (both systems apply in commit order, so the marker being there means everything
before it is). All polling of B (markers every 5 ms, lag probes) is done by a helper process spawned per
node pair ("watcher"), so it never takes turns on the router's event loop or GIL; its timestamps are
`time.perf_counter()` (CLOCK_MONOTONIC, one clock for every process). Also reported per run (stderr,
--json): first_apply_s (start -> B's origin first moves), the bench process's CPU (for pgmesh: the
router) and each server's CPU during the window. A CHECKPOINT on both nodes precedes each timed backlog;
rows are compared between A and B after each backlog; the order of the systems alternates between runs.
When stopping pgmesh's router hangs (seen on Python 3.11: a source task swallows its cancellation), the
bench cancels the source tasks again after 3 s, says so on stderr and counts it (stuck_shutdowns_so_far).

The table gives min and median over the runs and, on pgmesh's rows, the ratio of the medians: pgmesh/native
for throughput and native/pgmesh for lag, so in both cases higher is better and 1.00x means "as good as
native". Note that pgmesh runs a full mesh: B's walsender also decodes what pgmesh applies there (to filter
echoes), on the same two cores.

Reproduce (nodes are created and destroyed by the script; nothing else is touched):

    .venv/bin/python -m bench.apply                                  # scale 1, 2 runs, all workloads
    .venv/bin/python -m bench.apply --scale 0.1 --runs 1            # quick
    .venv/bin/python -m bench.apply --only tpcb --only bulk --json /tmp/apply.json
    .venv/bin/python -m pyinstrument -m bench.apply --only tpcb --scale 0.2 --runs 1   # where time goes

It needs PostgreSQL 15+ binaries (see `router.testing.localnodes.find_pg_bindir`) including `pgbench`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import multiprocessing
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

import psycopg

from protocol.lsn import parse_lsn
from router.service.supervisor import Router
from router.testing.localnodes import LocalNode, create_nodes, find_pg_bindir
from router.testing.mesh import execute, fetch, setup_mesh

T = TypeVar("T")

SYSTEMS = ("native", "pgmesh")
WORKLOADS = ("tpcb", "bulk", "lag")
CLUSTER = "bench"
NODE_SETTINGS = {
    "shared_buffers": "256MB",
    "max_wal_size": "4GB",
    "checkpoint_timeout": "30min",
    "wal_writer_delay": "10ms",
    # The native launcher starts a subscription's worker at most once per this interval (default 5 s):
    # without it, re-enabling the subscription for the next backlog would add seconds of idle wait.
    "wal_retrieve_retry_interval": "50ms",
}
TPCB_TXNS_PER_SCALE = 20_000
TPCB_CLIENTS = 4
TPCB_ROWS_PER_TXN = 4  # 3 updates + 1 insert
BULK_ROWS_PER_SCALE = 200_000
LAG_RATE = 300
LAG_CLIENTS = 2
LAG_SECONDS_PER_SCALE = 10.0
LAG_MIN_SECONDS = 3
PROBE_INTERVAL_S = 0.050
PROBE_POLL_S = 0.001
PROBE_START_DELAY_S = 0.5
POLL_S = 0.005
CATCH_UP_TIMEOUT_S = 900.0
STOP_WAIT_S = 3.0
STOP_ATTEMPTS = 20
EXTRA_SCHEMA = """
CREATE TABLE bench_bulk (id int PRIMARY KEY, a int, b text);
CREATE TABLE bench_probe (id int PRIMARY KEY, sent timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE bench_marker (id int PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp());
"""
PROGRESS_AND_MARKER = (
    "SELECT pg_catalog.pg_replication_origin_progress(%s, false)::text,"
    " EXISTS (SELECT 1 FROM bench_marker WHERE id = %s)"
)


@dataclass(frozen=True, slots=True)
class Sizes:
    scale: float
    tpcb_per_client: int
    bulk_rows: int
    lag_seconds: int

    @classmethod
    def for_scale(cls, scale: float) -> Sizes:
        per_client = max(1, round(TPCB_TXNS_PER_SCALE * scale / TPCB_CLIENTS))
        lag = max(LAG_MIN_SECONDS, round(LAG_SECONDS_PER_SCALE * scale))
        return cls(scale, per_client, max(1, round(BULK_ROWS_PER_SCALE * scale)), lag)

    @property
    def tpcb_txns(self) -> int:
        return self.tpcb_per_client * TPCB_CLIENTS


# ---------------------------------------------------------------------------------------------------------
# Nodes and workloads


def _client_env() -> dict[str, str]:
    """Our environment without libpq variables that could send pgbench elsewhere."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.setdefault("LC_ALL", "C")
    return env


async def pgbench(*args: str) -> str:
    """Run pgbench (from the PostgreSQL bindir) and return its stdout; raise with its stderr on failure."""
    argv = [str(find_pg_bindir() / "pgbench"), *args]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=_client_env()
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"pgbench {args[0]} ... exited {proc.returncode}: {err.decode()[-2000:]}")
    return out.decode()


def _pgbench_field(output: str, pattern: str) -> float:
    match = re.search(pattern, output)
    if match is None:
        raise RuntimeError(f"unexpected pgbench output (no {pattern!r}):\n{output[-2000:]}")
    return float(match.group(1))


async def prepare_node(node: LocalNode) -> None:
    """pgbench tables at scale 1 (identical rows on every node), history with a key, the bench tables."""
    await pgbench("-i", "-s", "1", "-q", node.dsn())
    await execute(node.dsn(), "ALTER TABLE pgbench_history ADD COLUMN hid bigserial PRIMARY KEY")


async def add_marker(dsn: str, marker: int) -> None:
    await execute(dsn, "INSERT INTO bench_marker (id) VALUES (%s)", params=[marker])


async def checkpoint(nodes: Sequence[LocalNode]) -> None:
    for node in nodes:
        await execute(node.dsn(), "CHECKPOINT")


async def fetch_one(dsn: str, query: str) -> tuple[Any, ...]:
    rows = await fetch(dsn, query)
    return rows[0]


# ---------------------------------------------------------------------------------------------------------
# The two systems: start / stop replication A -> B, and the origin on B that tracks it


class System:
    name = ""

    def __init__(self, a: LocalNode, b: LocalNode) -> None:
        self.a, self.b = a, b
        self.origin = ""
        self.running = False

    async def setup(self) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def check(self) -> None:
        """Raise when replication has failed (so a bench never waits out its timeout on a broken link)."""

    def applied(self) -> dict[str, int]:
        """The system's own counters, when it has any (for the JSON)."""
        return {}


class Native(System):
    """CREATE SUBSCRIPTION on B for a FOR ALL TABLES publication on A."""

    name = "native"

    async def setup(self) -> None:
        await execute(self.a.dsn(), EXTRA_SCHEMA)
        await execute(self.b.dsn(), EXTRA_SCHEMA)
        await execute(self.a.dsn(), "CREATE PUBLICATION p FOR ALL TABLES")
        connection = self.a.dsn().replace("'", "''")
        await execute(
            self.b.dsn(),
            f"CREATE SUBSCRIPTION s CONNECTION '{connection}' PUBLICATION p"
            " WITH (copy_data = false, enabled = false)",
        )
        rows = await fetch(self.b.dsn(), "SELECT 'pg_' || oid FROM pg_subscription WHERE subname = 's'")
        self.origin = rows[0][0]

    async def start(self) -> None:
        await execute(self.b.dsn(), "ALTER SUBSCRIPTION s ENABLE")
        self.running = True

    async def stop(self) -> None:
        if not self.running:
            return
        self.running = False
        await execute(self.b.dsn(), "ALTER SUBSCRIPTION s DISABLE")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            workers = await fetch(
                self.b.dsn(),
                "SELECT count(*) FROM pg_stat_subscription WHERE subname = 's' AND pid IS NOT NULL",
            )
            active = await fetch(self.a.dsn(), "SELECT count(*) FROM pg_replication_slots WHERE active")
            if workers[0][0] == 0 and active[0][0] == 0:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError("native: the subscription's worker did not stop within 60 s")

    async def check(self) -> None:
        rows = await fetch(
            self.b.dsn(), "SELECT apply_error_count FROM pg_stat_subscription_stats WHERE subname = 's'"
        )
        if rows and rows[0][0]:
            raise RuntimeError(f"native: the apply worker failed; see {self.b.logfile}")


class Pgmesh(System):
    """A two-node pgmesh cluster, its router run in this process (on this event loop)."""

    name = "pgmesh"

    def __init__(self, a: LocalNode, b: LocalNode) -> None:
        super().__init__(a, b)
        self.router: Router | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._last: dict[str, int] = {}
        self.stuck_shutdowns = 0

    async def setup(self) -> None:
        self.config = await setup_mesh([self.a, self.b], EXTRA_SCHEMA, cluster=CLUSTER)
        self.origin = self.config.origin_name(self.a.name)

    async def start(self) -> None:
        """What `router.testing.mesh.running_router` does, keeping the task to watch its shutdown."""
        self.router = Router(self.config, admin=False)
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self.router.run(self._stop), name="bench router")
        started = asyncio.create_task(self.router.started.wait())
        done, _ = await asyncio.wait({self._task, started}, return_when=asyncio.FIRST_COMPLETED)
        if self._task in done:
            started.cancel()
            self._task.result()  # raises the start-up error
        self.running = True

    async def stop(self) -> None:
        """Stop the router; if its shutdown hangs, cancel its source tasks again (and count it)."""
        task, self._task = self._task, None
        if task is None or self.router is None:
            return
        self._last = self.applied()
        self.running = False
        self._stop.set()
        for _ in range(STOP_ATTEMPTS):
            done, _ = await asyncio.wait({task}, timeout=STOP_WAIT_S)
            if done:
                break
            # Seen on Python 3.11: `asyncio.wait_for` in ReplicationSource._wait_readable returns normally
            # when the socket became readable in the same loop iteration as the cancel, swallowing the
            # cancellation; the router's shutdown then waits for that source task forever.
            self.stuck_shutdowns += 1
            stuck = [t for t in asyncio.all_tasks() if t.get_name().startswith("source ") and not t.done()]
            print(f"pgmesh: router shutdown stuck for {STOP_WAIT_S:.0f} s (source tasks not ending:"
                  f" {', '.join(t.get_name() for t in stuck) or 'none'}); cancelling them again",
                  file=sys.stderr)
            for t in stuck:
                t.cancel()
        else:
            task.cancel()
            raise RuntimeError("pgmesh: the router did not stop")
        task.result()
        self.router = None

    async def check(self) -> None:
        if self.router is not None:
            ok, why = self.router.health()
            if not ok:
                raise RuntimeError(f"pgmesh: {why}")

    def applied(self) -> dict[str, int]:
        if self.router is None:
            return {**self._last, "stuck_shutdowns_so_far": self.stuck_shutdowns}
        applier = self.router.appliers[(self.a.name, self.b.name)]
        return {"applied_transactions": applier.applied_transactions, "applied_rows": applier.applied_rows,
                "stuck_shutdowns_so_far": self.stuck_shutdowns}


# ---------------------------------------------------------------------------------------------------------
# Measurements


@dataclass(slots=True)
class Measurement:
    system: str
    workload: str
    run: int
    values: dict[str, float]
    details: dict[str, Any] = field(default_factory=dict)


# The watcher: a helper process that polls B (catch-up markers, lag probes). It runs outside this process
# so that its polling never takes turns on the router's event loop or GIL; timestamps are
# time.perf_counter(), i.e. CLOCK_MONOTONIC, which is the same clock in every process on Linux.


def watcher_main(pipe: Connection, dsn_a: str, dsn_b: str) -> None:
    """The watcher process: answer requests from the pipe until "quit" (or the pipe closes)."""
    with psycopg.connect(dsn_a, autocommit=True) as a, psycopg.connect(dsn_b, autocommit=True) as b:
        while True:
            try:
                request = pipe.recv()
            except EOFError:
                return
            kind, args = request[0], request[1:]
            try:
                if kind == "quit":
                    return
                if kind == "ready":
                    answer: Any = True
                elif kind == "wait":
                    answer = _watch_marker(b, *args)
                elif kind == "probe":
                    answer = _probe_lag(a, b, *args)
                else:
                    raise ValueError(f"unknown request {kind!r}")
                pipe.send(("ok", answer))
            except Exception as exc:
                pipe.send(("error", f"{type(exc).__name__}: {exc}"))


def _watch_marker(b: psycopg.Connection[Any], origin: str, marker: int, baseline: int) -> tuple[float, float]:
    """Poll B every POLL_S until the marker row is there: (first time the origin moved, that time)."""
    first: float | None = None
    deadline = time.perf_counter() + CATCH_UP_TIMEOUT_S
    while True:
        row = b.execute(PROGRESS_AND_MARKER, [origin, marker]).fetchone()
        now = time.perf_counter()
        assert row is not None
        if first is None and row[0] and parse_lsn(row[0]) > baseline:
            first = now
        if row[1]:
            return (first if first is not None else now), now
        if now > deadline:
            raise TimeoutError(f"B did not catch up within {CATCH_UP_TIMEOUT_S:.0f} s")
        time.sleep(POLL_S)


def _probe_lag(
    a: psycopg.Connection[Any], b: psycopg.Connection[Any], start_delay: float, duration: float
) -> list[float]:
    """Insert a probe row on A every PROBE_INTERVAL_S; seconds from its commit until B has it."""
    lags: list[float] = []
    time.sleep(start_delay)
    next_at = time.perf_counter()
    end = next_at + duration
    probe = 0
    while next_at < end:
        pause = next_at - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        probe += 1
        a.execute("INSERT INTO bench_probe (id) VALUES (%s)", [probe])
        committed = time.perf_counter()
        while b.execute("SELECT 1 FROM bench_probe WHERE id = %s", [probe]).fetchone() is None:
            if time.perf_counter() - committed > 60:
                raise TimeoutError(f"probe {probe} did not reach B within 60 s")
            time.sleep(PROBE_POLL_S)
        lags.append(time.perf_counter() - committed)
        next_at = max(next_at + PROBE_INTERVAL_S, time.perf_counter())
    return lags


class Watcher:
    """The parent's end: start the process, send a request, await its answer without blocking the loop."""

    def __init__(self, a: LocalNode, b: LocalNode) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        me = importlib.import_module("bench.apply")  # picklable by module name even when run as __main__
        self._proc = ctx.Process(target=me.watcher_main, args=(child, a.dsn(), b.dsn()), daemon=True)
        self._proc.start()
        child.close()

    async def call(self, *request: Any) -> Any:
        self._pipe.send(request)
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        fd = self._pipe.fileno()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(fd, wake)
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        status, answer = self._pipe.recv()
        if status != "ok":
            raise RuntimeError(f"watcher: {answer}")
        return answer

    async def call_checked(self, system: System, *request: Any) -> Any:
        """`call`, checking every second that replication has not failed meanwhile."""
        answer = asyncio.ensure_future(self.call(*request))
        try:
            while True:
                done, _ = await asyncio.wait({answer}, timeout=1.0)
                if done:
                    return answer.result()
                await system.check()
        finally:
            answer.cancel()

    def close(self) -> None:
        if self._proc.is_alive():
            with contextlib.suppress(OSError):
                self._pipe.send(("quit",))
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)
        self._pipe.close()


def server_cpu_seconds(node: LocalNode) -> float:
    """CPU seconds used so far by the node's postmaster, its live children and the children it reaped."""
    try:
        postmaster = int((node.datadir / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        if pid == postmaster:
            ticks += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
        elif int(fields[1]) == postmaster:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


async def origin_position(system: System) -> int:
    rows = await fetch(
        system.b.dsn(), "SELECT pg_catalog.pg_replication_origin_progress(%s, false)::text", [system.origin]
    )
    return parse_lsn(rows[0][0]) if rows and rows[0][0] else 0


async def wait_caught_up(
    system: System, watcher: Watcher, marker: int, baseline: int = 0
) -> tuple[float, float]:
    """(first time B's origin moved past `baseline`, time B had the marker), on the perf_counter clock."""
    first, done = await watcher.call_checked(system, "wait", system.origin, marker, baseline)
    return float(first), float(done)


async def time_backlog(system: System, watcher: Watcher, marker: int) -> dict[str, float]:
    """Start replication over a backlog that ends with `marker`; time it until B has the marker."""
    await add_marker(system.a.dsn(), marker)
    await checkpoint([system.a, system.b])
    baseline = await origin_position(system)
    a_cpu, b_cpu = server_cpu_seconds(system.a), server_cpu_seconds(system.b)
    cpu = time.process_time()
    start = time.perf_counter()
    await system.start()
    first, done = await wait_caught_up(system, watcher, marker, baseline)
    return {
        "seconds": done - start,
        "first_apply_s": first - start,
        "bench_cpu_s": time.process_time() - cpu,
        "a_server_cpu_s": server_cpu_seconds(system.a) - a_cpu,
        "b_server_cpu_s": server_cpu_seconds(system.b) - b_cpu,
    }


async def run_tpcb(system: System, watcher: Watcher, sizes: Sizes, run: int) -> Measurement:
    out = await pgbench(
        "-n", "-c", str(TPCB_CLIENTS), "-j", "2", "-t", str(sizes.tpcb_per_client), system.a.dsn()
    )
    txns = int(_pgbench_field(out, r"number of transactions actually processed: (\d+)"))
    timing = await time_backlog(system, watcher, marker=1)
    details = {**timing, "transactions": txns, "generate_tps": _pgbench_field(out, r"tps = ([\d.]+)")}
    details.update(system.applied())
    await system.stop()
    query = (
        "SELECT count(*), sum(abalance) FROM pgbench_accounts"
        " UNION ALL SELECT count(*), sum(delta) FROM pgbench_history"
    )
    a, b = await fetch(system.a.dsn(), query), await fetch(system.b.dsn(), query)
    if a != b:
        raise RuntimeError(f"{system.name}: after the TPC-B backlog A has {a} but B has {b}")
    seconds = timing["seconds"]
    values = {"tx/s": txns / seconds, "rows/s": txns * TPCB_ROWS_PER_TXN / seconds}
    return Measurement(system.name, "tpcb", run, values, details)


async def run_bulk(system: System, watcher: Watcher, sizes: Sizes, run: int) -> Measurement:
    await execute(
        system.a.dsn(),
        "INSERT INTO bench_bulk (id, a, b) SELECT g, g %% 1000, md5(g::text) FROM generate_series(1, %s) g",
        params=[sizes.bulk_rows],
    )
    timing = await time_backlog(system, watcher, marker=2)
    details: dict[str, Any] = {**timing, "rows": sizes.bulk_rows, **system.applied()}
    await system.stop()
    got = (await fetch_one(system.b.dsn(), "SELECT count(*) FROM bench_bulk"))[0]
    if got != sizes.bulk_rows:
        raise RuntimeError(f"{system.name}: after the bulk insert B has {got} rows, not {sizes.bulk_rows}")
    return Measurement(system.name, "bulk", run, {"rows/s": sizes.bulk_rows / timing["seconds"]}, details)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


async def run_lag(system: System, watcher: Watcher, sizes: Sizes, run: int) -> Measurement:
    await add_marker(system.a.dsn(), 3)
    await system.start()
    await wait_caught_up(system, watcher, 3)
    bench = asyncio.create_task(
        pgbench("-n", "-R", str(LAG_RATE), "-T", str(sizes.lag_seconds), "-c", str(LAG_CLIENTS),
                system.a.dsn())
    )
    window = sizes.lag_seconds - 2 * PROBE_START_DELAY_S
    try:
        lags = await watcher.call_checked(system, "probe", PROBE_START_DELAY_S, window)
    finally:
        out = await bench
    await system.check()
    await add_marker(system.a.dsn(), 4)
    await wait_caught_up(system, watcher, 4)
    details: dict[str, Any] = {
        "probes": len(lags),
        "max_ms": max(lags) * 1000,
        "mean_ms": statistics.fmean(lags) * 1000,
        "pgbench_tps": _pgbench_field(out, r"tps = ([\d.]+)"),
        **system.applied(),
    }
    await system.stop()
    values = {"p50 ms": percentile(lags, 50) * 1000, "p99 ms": percentile(lags, 99) * 1000}
    return Measurement(system.name, "lag", run, values, details)


RUNNERS: dict[str, Callable[[System, Watcher, Sizes, int], Coroutine[Any, Any, Measurement]]] = {
    "tpcb": run_tpcb,
    "bulk": run_bulk,
    "lag": run_lag,
}


async def run_system(kind: type[System], nodes: list[LocalNode], sizes: Sizes, run: int,
                     workloads: Sequence[str]) -> list[Measurement]:
    for node in nodes:
        await prepare_node(node)
    system = kind(nodes[0], nodes[1])
    await system.setup()
    watcher = Watcher(nodes[0], nodes[1])
    out: list[Measurement] = []
    try:
        await watcher.call("ready")  # the process is up and connected before anything is timed
        for workload in workloads:
            measurement = await RUNNERS[workload](system, watcher, sizes, run)
            out.append(measurement)
            shown = ", ".join(f"{k} {v:,.1f}" for k, v in measurement.values.items())
            extra = ", ".join(
                f"{k} {measurement.details[k]:.3f}"
                for k in ("seconds", "first_apply_s", "bench_cpu_s", "a_server_cpu_s", "b_server_cpu_s")
                if k in measurement.details
            )
            print(f"run {run}: {system.name:<6} {workload:<4} {shown}" + (f" ({extra})" if extra else ""),
                  file=sys.stderr)
    finally:
        try:
            await system.stop()
        finally:
            watcher.close()
    return out


def run_async(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run one coroutine on a fresh uvloop event loop (the router runs on it, as in production)."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(factory())


def run_once(system: str, sizes: Sizes, run: int, workloads: Sequence[str]) -> list[Measurement]:
    """One system, one run: a fresh node pair, every workload in order, then the nodes are destroyed."""
    kind: type[System] = Native if system == "native" else Pgmesh
    nodes = create_nodes(["a", "b"], settings=NODE_SETTINGS)
    try:
        return run_async(lambda: run_system(kind, nodes, sizes, run, workloads))
    finally:
        for node in nodes:
            node.destroy()


# ---------------------------------------------------------------------------------------------------------
# Report


LOWER_IS_BETTER = ("p50 ms", "p99 ms")


def summary(results: Sequence[Measurement]) -> list[dict[str, Any]]:
    """One row per (workload, metric, system): min, median and, for pgmesh, the ratio to native."""
    rows: list[dict[str, Any]] = []
    keys: list[tuple[str, str]] = []
    for m in results:
        for metric in m.values:
            if (m.workload, metric) not in keys:
                keys.append((m.workload, metric))
    for workload, metric in sorted(keys, key=lambda k: WORKLOADS.index(k[0])):
        medians: dict[str, float] = {}
        for system in SYSTEMS:
            values = [m.values[metric] for m in results
                      if m.system == system and m.workload == workload and metric in m.values]
            if not values:
                continue
            lower = metric in LOWER_IS_BETTER
            medians[system] = statistics.median(values)
            row: dict[str, Any] = {
                "system": system, "workload": workload, "metric": metric,
                "min": min(values), "best": min(values) if lower else max(values),
                "median": medians[system], "runs": len(values), "ratio": None,
            }
            if system == "pgmesh" and "native" in medians and medians["native"] > 0 and medians["pgmesh"] > 0:
                row["ratio"] = (medians["native"] / medians["pgmesh"] if lower
                                else medians["pgmesh"] / medians["native"])
            rows.append(row)
    return rows


def format_table(sizes: Sizes, runs: int, results: Sequence[Measurement]) -> str:
    lines = [
        f"pgmesh apply bench A -> B: scale {sizes.scale:g} (TPC-B backlog {sizes.tpcb_txns} txns,"
        f" bulk insert {sizes.bulk_rows} rows in 1 txn, lag: TPC-B at {LAG_RATE} tx/s for"
        f" {sizes.lag_seconds} s + a probe every {PROBE_INTERVAL_S * 1000:.0f} ms), {runs} run(s),"
        f" {os.cpu_count()} CPUs, router on uvloop",
        f"{'system':<8}{'workload':<10}{'metric':<9}{'min':>12}{'median':>12}{'ratio':>9}",
    ]
    for row in summary(results):
        digits = 2 if row["metric"] in LOWER_IS_BETTER else 0
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else ""
        lines.append(
            f"{row['system']:<8}{row['workload']:<10}{row['metric']:<9}"
            f"{row['min']:>12,.{digits}f}{row['median']:>12,.{digits}f}{ratio:>9}"
        )
    lines.append(
        "ratio (pgmesh rows, of the medians): pgmesh/native for throughput, native/pgmesh for lag;"
        " higher is better, 1.00x = as good as native"
    )
    return "\n".join(lines)


def write_json(path: Path, sizes: Sizes, runs: int, results: Sequence[Measurement]) -> None:
    doc = {
        "bench": "apply",
        "sizes": {**asdict(sizes), "tpcb_txns": sizes.tpcb_txns},
        "runs": runs,
        "node_settings": NODE_SETTINGS,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loop": "uvloop",
        "measurements": [asdict(m) for m in results],
        "summary": summary(results),
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.apply", description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0,
                        help="workload size factor: 20000*S TPC-B txns, 200000*S bulk rows (default 1)")
    parser.add_argument("--runs", type=int, default=2, help="runs; min and median are reported (default 2)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results here")
    parser.add_argument("--only", action="append", choices=WORKLOADS, metavar="WORKLOAD",
                        help=f"run only this workload ({', '.join(WORKLOADS)}); repeatable")
    parser.add_argument("--system", action="append", choices=SYSTEMS,
                        help="run only this system (default both); repeatable")
    args = parser.parse_args(argv)
    if args.scale <= 0 or args.runs < 1:
        parser.error("--scale must be > 0 and --runs at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = Sizes.for_scale(args.scale)
    workloads = [w for w in WORKLOADS if args.only is None or w in args.only]
    systems = [s for s in SYSTEMS if args.system is None or s in args.system]
    if not os.access(find_pg_bindir() / "pgbench", os.X_OK):
        print(f"pgbench not found in {find_pg_bindir()}", file=sys.stderr)
        return 2
    results: list[Measurement] = []
    for run in range(args.runs):
        order = systems if run % 2 == 0 else systems[::-1]
        for system in order:
            results.extend(run_once(system, sizes, run, workloads))
    print(format_table(sizes, args.runs, results))
    if args.json is not None:
        write_json(args.json, sizes, args.runs, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
