"""The bench workloads, each defined once, and how each is timed: what the suite and `bench.micro.apply` run.

Workloads (sizes at scale S, `Sizes.for_scale`; the micro apply bench picks smaller bulk and lag sizes;
the backlogs' transaction counts by preset, `BACKLOGS`: `default` below, `long` 80,000*S TPC-B and
400,000*S inserts, so that even the in-server workers' catch-up lasts seconds and their start is a small
part of it):

  tpcb        a backlog of 20000*S pgbench TPC-B transactions made on a while replication is stopped,
              then timed from start until every target has a marker committed after it. tx/s.
  bulk        a backlog of ONE transaction inserting 1,000,000*S rows (bench_bulk). rows/s.
  inserts     a backlog of 100,000*S single-row INSERT transactions (pgbench, 4 clients). tx/s.
  visibility  replication running and idle; one transaction on a inserts 1,000,000*S rows and, last, a
              marker row; seconds from its commit being acknowledged until every target shows the
              marker (lower is better).
  lag         pgbench TPC-B at 300 tx/s for 15*S s (at least 3 s) with a probe row every 50 ms;
              lag = probe visible on the target - probe committed on a. p50 / p99 ms, and the series.
  multimaster pgbench on every node at once, 5000*S transactions per node, each an UPDATE of one key plus
              an INSERT into a log table; 10% of them update one of 100 keys shared by all nodes, the
              rest a key of the node's own. Timed from the start until every node holds the same rows
              (count + md5 of the sorted rows). tx/s over all nodes, and the conflicts the system reports.

With several targets (pgmesh3) each figure is also given per link (`tx/s a->b`). A backlog is timed from
the start command to the moment its marker is visible on every target (every system applies in commit
order, so the marker being there means everything before it is); first_apply_s (start -> a target's
origin first moves), each target's catch-up seconds (`catchup_s`), the bench process's CPU (for pgmesh:
the router) and each server's CPU during the window go into the details. Rows are compared between a
and every target after each workload.

Owns: `Sizes`, `Measurement`, the tables and pgbench scripts the workloads use (`prepare`,
`write_scripts`), the timed window (`Context.window`, which `bench.suite.profile` fills), and `RUNNERS`.
Must not: create or destroy nodes or systems (`runs`), decide what to run or report (`bench.suite`,
`bench.micro`), or poll a target from this process (the watcher does).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.nodes import (
    add_marker,
    checkpoint,
    pgbench,
    pgbench_init,
    pgbench_tps,
    pgbench_txns,
    server_cpu_seconds,
)
from bench.harness.system import System
from bench.harness.watcher import PROBE_INTERVAL_S, Watcher
from router.testing.mesh import execute, fetch

WORKLOADS = ("tpcb", "bulk", "inserts", "visibility", "lag", "multimaster")
TPCB_TXNS_PER_SCALE = 20_000
TPCB_CLIENTS = 4
TPCB_ROWS_PER_TXN = 4  # 3 updates + 1 insert
BULK_ROWS_PER_SCALE = 1_000_000
INSERT_TXNS_PER_SCALE = 100_000
INSERT_CLIENTS = 4
VISIBILITY_ROWS_PER_SCALE = 1_000_000
LAG_RATE = 300
LAG_CLIENTS = 2
LAG_SECONDS_PER_SCALE = 15.0
LAG_MIN_SECONDS = 3
PROBE_START_DELAY_S = 0.5
MM_TXNS_PER_SCALE = 5_000  # per node
MM_CLIENTS = 2  # per node
MM_SHARED_KEYS = 100
MM_PRIVATE_KEYS = 10_000
MM_SHARED_PERCENT = 10
MM_NODE_IDS = (1, 2, 3)  # private key ranges seeded on every node, whatever the system
MM_TABLES = ["bench_mm", "bench_mm_log"]
# Backlog presets, transactions at scale 1: (TPC-B, one-row inserts). `default` is what the suite has
# compared across issues (20,000 TPC-B last about 0.5 s for native's apply worker, so its start weighs);
# `long`: the fastest system's catch-up lasts several seconds (native about 3 s on TPC-B and inserts here).
BACKLOGS: dict[str, tuple[int, int]] = {
    "default": (TPCB_TXNS_PER_SCALE, INSERT_TXNS_PER_SCALE),
    "long": (80_000, 400_000),
}
CONVERGE_POLL_S = 0.1
WORKLOAD_TIMEOUT_S = 900.0

SCHEMA = """
CREATE TABLE bench_ins (id bigserial PRIMARY KEY, v int NOT NULL, at timestamptz NOT NULL DEFAULT now());
CREATE TABLE bench_vis (id int PRIMARY KEY, a int, b text);
CREATE TABLE bench_mm (id int PRIMARY KEY, v bigint NOT NULL, node int NOT NULL);
CREATE TABLE bench_mm_log (node int, id bigint, k int NOT NULL, PRIMARY KEY (node, id));
"""
MM_SEED = (
    f"INSERT INTO bench_mm SELECT g, 0, 0 FROM generate_series(1, {MM_SHARED_KEYS}) g;"
    f" INSERT INTO bench_mm SELECT n * 1000000 + g, 0, 0"
    f" FROM unnest(ARRAY{list(MM_NODE_IDS)}) n, generate_series(1, {MM_PRIVATE_KEYS}) g"
)
INSERT_SCRIPT = "INSERT INTO bench_ins (v) VALUES (:client_id);\n"
MM_SCRIPT = f"""\\set r random(1, 100)
\\if :r <= {MM_SHARED_PERCENT}
\\set k random(1, {MM_SHARED_KEYS})
\\else
\\set k :node * 1000000 + random(1, {MM_PRIVATE_KEYS})
\\endif
\\set id random(1, 9000000000000000000)
BEGIN;
UPDATE bench_mm SET v = v + 1, node = :node WHERE id = :k;
INSERT INTO bench_mm_log (node, id, k) VALUES (:node, :id, :k);
END;
"""
TPCB_CHECK = ("SELECT count(*), sum(abalance) FROM pgbench_accounts"
              " UNION ALL SELECT count(*), sum(delta) FROM pgbench_history")


@dataclass(frozen=True, slots=True)
class Sizes:
    scale: float
    tpcb_per_client: int
    bulk_rows: int
    insert_per_client: int
    visibility_rows: int
    lag_seconds: int
    mm_per_client: int
    backlog: str = "default"  # the preset (BACKLOGS) or "custom" when a count was given

    @classmethod
    def for_scale(cls, scale: float, *, bulk_rows_per_scale: int = BULK_ROWS_PER_SCALE,
                  lag_seconds_per_scale: float = LAG_SECONDS_PER_SCALE, backlog: str = "default",
                  tpcb_txns: int | None = None, insert_txns: int | None = None) -> Sizes:
        """Sizes at `scale`; the backlogs' transactions by preset `backlog` (times `scale`), or exactly
        `tpcb_txns` / `insert_txns` when given (not scaled; rounded to a multiple of the clients)."""
        def per(total: float, clients: int) -> int:
            return max(1, round(total * scale / clients))

        tpcb_total, insert_total = BACKLOGS[backlog]
        return cls(
            scale=scale,
            tpcb_per_client=(per(tpcb_total, TPCB_CLIENTS) if tpcb_txns is None
                             else max(1, round(tpcb_txns / TPCB_CLIENTS))),
            bulk_rows=max(1, round(bulk_rows_per_scale * scale)),
            insert_per_client=(per(insert_total, INSERT_CLIENTS) if insert_txns is None
                               else max(1, round(insert_txns / INSERT_CLIENTS))),
            visibility_rows=max(1, round(VISIBILITY_ROWS_PER_SCALE * scale)),
            lag_seconds=max(LAG_MIN_SECONDS, round(lag_seconds_per_scale * scale)),
            mm_per_client=per(MM_TXNS_PER_SCALE, MM_CLIENTS),
            backlog=backlog if tpcb_txns is None and insert_txns is None else "custom",
        )

    @property
    def tpcb_txns(self) -> int:
        return self.tpcb_per_client * TPCB_CLIENTS

    def describe(self) -> list[str]:
        return [
            f"tpcb: {self.tpcb_txns:,} TPC-B transactions as a backlog",
            f"bulk: {self.bulk_rows:,} rows in one transaction as a backlog",
            f"inserts: {self.insert_per_client * INSERT_CLIENTS:,} single-row INSERTs as a backlog",
            f"visibility: {self.visibility_rows:,} rows + a marker in one transaction, replication running",
            f"lag: TPC-B at {LAG_RATE} tx/s for {self.lag_seconds} s, a probe every"
            f" {PROBE_INTERVAL_S * 1000:.0f} ms",
            f"multimaster: {self.mm_per_client * MM_CLIENTS:,} transactions per node ({MM_CLIENTS} clients),"
            f" {MM_SHARED_PERCENT}% on {MM_SHARED_KEYS} shared keys",
        ]


@dataclass(slots=True)
class Measurement:
    system: str
    workload: str
    run: int
    values: dict[str, float]
    details: dict[str, Any] = field(default_factory=dict)


# A workload's timed window: a factory of async context managers, entered around the part that is timed
# (a backlog's start .. last marker, the big commit's visibility, the lag probes). bench.suite.profile
# measures in it; the default does nothing.
Window = Callable[[], contextlib.AbstractAsyncContextManager[Any]]
Windows = Callable[[System, str], Window]  # (system, workload) -> its window


@dataclass(slots=True)
class Context:
    system: System
    watcher: Watcher
    sizes: Sizes
    run: int
    scripts: Path
    timeout: float
    window: Window = contextlib.nullcontext


async def prepare(system: System) -> None:
    """Every data node: pgbench's tables (identical rows), the workloads' tables and the multimaster
    seed; then the system's own setup (which adds the marker, probe and bulk tables)."""
    for node in system.data_nodes:
        await pgbench_init(node)
        await execute(node.dsn(), SCHEMA, MM_SEED)
    await system.setup()


def write_scripts(directory: Path) -> Path:
    """The pgbench scripts the workloads run (`-f`), written into `directory`."""
    (directory / "insert.sql").write_text(INSERT_SCRIPT)
    (directory / "multimaster.sql").write_text(MM_SCRIPT)
    return directory


# ---------------------------------------------------------------------------------------------------------
# Shared steps


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


async def start_caught_up(ctx: Context, marker: int) -> None:
    """Start replication and wait until every target has a fresh marker (nothing left in flight)."""
    await add_marker(ctx.system.a.dsn(), marker)
    await ctx.system.start()
    await ctx.watcher.wait(marker, ctx.timeout)


def link_values(system: System, metric: str, overall: float, per_link: Sequence[float]) -> dict[str, float]:
    """The metric over all targets (`metric`) and, with several targets, per link (`metric a->x`)."""
    values = {metric: overall}
    if len(per_link) > 1:
        for target, value in zip(system.targets, per_link, strict=True):
            values[f"{metric} a->{target.name}"] = value
    return values


async def time_backlog(ctx: Context, marker: int) -> dict[str, Any]:
    """Start replication over a backlog that ends with `marker`; time it until every target has it."""
    s = ctx.system
    await add_marker(s.a.dsn(), marker)
    await checkpoint(s.data_nodes)
    baselines = await s.positions()
    cpu = {n.name: server_cpu_seconds(n) for n in s.nodes}
    bench_cpu = time.process_time()
    async with ctx.window():
        start = time.perf_counter()
        await s.start()
        links = await ctx.watcher.wait(marker, ctx.timeout, baselines)
    return {
        "seconds": max(done for _, done in links) - start,
        "link_seconds": [done - start for _, done in links],
        "catchup_s": {t.name: done - start for t, (_, done) in zip(s.targets, links, strict=True)},
        "first_apply_s": min(first for first, _ in links) - start,
        "bench_cpu_s": time.process_time() - bench_cpu,
        **{f"{n.name}_server_cpu_s": server_cpu_seconds(n) - cpu[n.name] for n in s.nodes},
    }


def rates(system: System, metric: str, amount: float, timing: dict[str, Any]) -> dict[str, float]:
    per_link = [amount / seconds for seconds in timing["link_seconds"]]
    return link_values(system, metric, amount / timing["seconds"], per_link)


async def same_as_a(system: System, query: str, what: str) -> None:
    want = await fetch(system.a.dsn(), query)
    for target in system.targets:
        got = await fetch(target.dsn(), query)
        if got != want:
            raise RuntimeError(f"{system.name}: after {what} a has {want} but {target.name} has {got}")


# ---------------------------------------------------------------------------------------------------------
# Workloads


async def pgbench_backlog(ctx: Context, workload: str, args: Sequence[str], marker: int, check: str
                          ) -> Measurement:
    """Transactions made by `pgbench args` on a while stopped, then timed as a backlog; tx/s."""
    s = ctx.system
    out = await pgbench("-n", *args, s.a.dsn())
    txns = pgbench_txns(out)
    timing = await time_backlog(ctx, marker)
    details = {**timing, "transactions": txns, "generate_tps": pgbench_tps(out), **s.applied()}
    await s.stop()
    await same_as_a(s, check, f"the {workload} backlog")
    return Measurement(s.name, workload, ctx.run, rates(s, "tx/s", txns, timing), details)


async def run_tpcb(ctx: Context) -> Measurement:
    args = ["-c", str(TPCB_CLIENTS), "-j", "2", "-t", str(ctx.sizes.tpcb_per_client)]
    return await pgbench_backlog(ctx, "tpcb", args, 1, TPCB_CHECK)


async def run_inserts(ctx: Context) -> Measurement:
    args = ["-c", str(INSERT_CLIENTS), "-j", "2", "-t", str(ctx.sizes.insert_per_client),
            "-f", str(ctx.scripts / "insert.sql")]
    return await pgbench_backlog(ctx, "inserts", args, 5, "SELECT count(*), sum(v) FROM bench_ins")


async def run_bulk(ctx: Context) -> Measurement:
    s, rows = ctx.system, ctx.sizes.bulk_rows
    await execute(
        s.a.dsn(),
        "INSERT INTO bench_bulk (id, a, b) SELECT g, g %% 1000, md5(g::text) FROM generate_series(1, %s) g",
        params=[rows],
    )
    timing = await time_backlog(ctx, marker=2)
    details = {**timing, "rows": rows, **s.applied()}
    await s.stop()
    await same_as_a(s, "SELECT count(*) FROM bench_bulk", "the bulk insert")
    return Measurement(s.name, "bulk", ctx.run, rates(s, "rows/s", rows, timing), details)


async def run_visibility(ctx: Context) -> Measurement:
    s = ctx.system
    await start_caught_up(ctx, marker=6)
    await asyncio.sleep(0.5)  # idle
    async with ctx.window():
        commit_s, committed, links = await ctx.watcher.visibility(ctx.sizes.visibility_rows, 7, ctx.timeout)
    visible = [done - committed for _, done in links]
    details = {"rows": ctx.sizes.visibility_rows, "commit_on_a_s": commit_s,
               "first_apply_s": min(first for first, _ in links) - committed, **s.applied()}
    await s.stop()
    await same_as_a(s, "SELECT count(*) FROM bench_vis", "the big transaction")
    values = link_values(s, "visible s", max(visible), visible)
    return Measurement(s.name, "visibility", ctx.run, values, details)


async def run_lag(ctx: Context) -> Measurement:
    s = ctx.system
    await start_caught_up(ctx, marker=3)
    bench = asyncio.create_task(
        pgbench("-n", "-R", str(LAG_RATE), "-T", str(ctx.sizes.lag_seconds), "-c", str(LAG_CLIENTS),
                s.a.dsn())
    )
    window = ctx.sizes.lag_seconds - 2 * PROBE_START_DELAY_S
    try:
        async with ctx.window():
            series = await ctx.watcher.probe(PROBE_START_DELAY_S, window)
    finally:
        out = await bench
    await s.check()
    await add_marker(s.a.dsn(), 4)
    await ctx.watcher.wait(4, ctx.timeout)
    details: dict[str, Any] = {
        "probes": len(series),
        "pgbench_tps": pgbench_tps(out),
        "targets": [t.name for t in s.targets],
        "series": [[round(at, 4), [round(lag * 1000, 3) for lag in lags]] for at, lags in series],
        **s.applied(),
    }
    await s.stop()
    values: dict[str, float] = {}
    for q in (50, 99):
        per_link = [percentile([lags[i] for _, lags in series], q) * 1000 for i in range(len(s.targets))]
        overall = percentile([max(lags) for _, lags in series], q) * 1000
        values.update(link_values(s, f"p{q} ms", overall, per_link))
    return Measurement(s.name, "lag", ctx.run, values, details)


async def run_multimaster(ctx: Context) -> Measurement:
    s = ctx.system
    await start_caught_up(ctx, marker=8)
    conflicts_before = s.conflicts() or 0
    script = ctx.scripts / "multimaster.sql"
    async with ctx.window():
        start = time.perf_counter()
        outs = await asyncio.gather(*(
            pgbench("-n", "-c", str(MM_CLIENTS), "-j", str(MM_CLIENTS), "-t", str(ctx.sizes.mm_per_client),
                    "-f", str(script), "-D", f"node={MM_NODE_IDS[i]}", node.dsn())
            for i, node in enumerate(s.data_nodes)
        ))
        generated = time.perf_counter()
        converged, polls = await ctx.watcher.converge(MM_TABLES, ctx.timeout, CONVERGE_POLL_S)
    conflicts = s.conflicts()
    txns = [pgbench_txns(out) for out in outs]
    details: dict[str, Any] = {
        "transactions": sum(txns), "writers": [n.name for n in s.data_nodes],
        "generate_s": generated - start, "converge_after_generate_s": converged - generated,
        "generate_tps": [pgbench_tps(out) for out in outs], "polls": polls,
        "seconds": converged - start, **s.applied(),
    }
    await s.stop()
    values = {"tx/s": sum(txns) / (converged - start)}
    if conflicts is not None:
        values["conflicts"] = float(conflicts - conflicts_before)
    return Measurement(s.name, "multimaster", ctx.run, values, details)


RUNNERS: dict[str, Callable[[Context], Coroutine[Any, Any, Measurement]]] = {
    "tpcb": run_tpcb,
    "bulk": run_bulk,
    "inserts": run_inserts,
    "visibility": run_visibility,
    "lag": run_lag,
    "multimaster": run_multimaster,
}
