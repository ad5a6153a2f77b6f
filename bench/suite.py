"""Every system on every workload, same nodes and settings, one report: `python -m bench --all`.

Systems (bench/systems.py): native, pglogical, bucardo, pgmesh2 and pgmesh3 (a's changes measured on
a -> b and a -> c). Each gets fresh nodes per run with the same server settings (bench.systems.SETTINGS),
`pgbench -i -s 1` and the same bench tables on every node; the system order alternates between runs.
Workloads, in this order, sizes at --scale S:

  tpcb        a backlog of 20000*S pgbench TPC-B transactions made on a while replication is stopped,
              then timed from start until every target has a marker committed after it. tx/s.
  bulk        a backlog of ONE transaction inserting 1,000,000*S rows (bench_bulk). rows/s.
  inserts     a backlog of 100,000*S single-row INSERT transactions (pgbench, 4 clients). tx/s.
  visibility  replication running and idle; one transaction on a inserts 1,000,000*S rows and, last, a
              marker row; seconds from its commit being acknowledged until every target shows the
              marker (lower is better).
  lag         pgbench TPC-B at 300 tx/s for 15*S s (at least 3 s) with a probe row every 50 ms;
              lag = probe visible on the target - probe committed on a. p50 / p99 ms, and the series.
  multimaster pgbench on every node at once (a and b; pgmesh3 also c), 5000*S transactions per node,
              each an UPDATE of one key plus an INSERT into a log table; 10% of them update one of 100
              keys shared by all nodes, the rest a key of the node's own. Timed from the start until
              every node holds the same rows (count + md5 of the sorted rows). tx/s over all nodes, and
              the conflicts the system reports. Only pgmesh2, pgmesh3 and bucardo (the others are
              one-way: n/a); the ratio column compares to pgmesh2.

Bucardo skips bulk and visibility unless --include-slow (a 1M-row transaction takes it minutes).

Targets are polled by the watcher process (bench/systems.py). A failure in one (system, workload, run)
is recorded in the report and the suite goes on. Output: --out (default bench/RESULTS.md) and, beside
it, results/suite.json, results/lag.png and results/throughput.png (rendered by bench.suite_report).

    .venv/bin/python -m bench --all                                    # scale 1, 2 runs (~30 min)
    .venv/bin/python -m bench --all --scale 0.05 --runs 1 --out /tmp/suite/RESULTS.md   # quick
    .venv/bin/python -m bench.suite --only-system pgmesh3 --only-workload tpcb
    .venv/bin/python -m bench.profile          # where the CPU goes in each workload (bench/profile.py)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.apply import (
    TPCB_CLIENTS,
    Measurement,
    _pgbench_field,
    add_marker,
    checkpoint,
    fetch,
    percentile,
    pgbench,
    prepare_node,
    run_async,
    server_cpu_seconds,
)
from bench.suite_report import (
    INFO_ONLY,
    LOWER_IS_BETTER,
    base_metric,
    git_commit,
    render_markdown,
    results_table,
    system_status,
    write_plots,
)
from bench.systems import (
    SETTINGS,
    SYSTEMS,
    SuiteSystem,
    Watcher,
    describe_failure,
    machine_facts,
    origin_positions,
    plan_workloads,
)
from router.testing.localnodes import DEFAULT_SETTINGS, create_nodes, find_pg_bindir
from router.testing.mesh import execute

SYSTEM_ORDER = ("native", "pglogical", "bucardo", "pgmesh2", "pgmesh3")
WORKLOADS = ("tpcb", "bulk", "inserts", "visibility", "lag", "multimaster")
TPCB_TXNS_PER_SCALE = 20_000
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
CONVERGE_POLL_S = 0.1
WORKLOAD_TIMEOUT_S = 900.0

SUITE_SCHEMA = """
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
class SuiteSizes:
    scale: float
    tpcb_per_client: int
    bulk_rows: int
    insert_per_client: int
    visibility_rows: int
    lag_seconds: int
    mm_per_client: int

    @classmethod
    def for_scale(cls, scale: float) -> SuiteSizes:
        def per(total: float, clients: int) -> int:
            return max(1, round(total * scale / clients))

        return cls(
            scale=scale,
            tpcb_per_client=per(TPCB_TXNS_PER_SCALE, TPCB_CLIENTS),
            bulk_rows=max(1, round(BULK_ROWS_PER_SCALE * scale)),
            insert_per_client=per(INSERT_TXNS_PER_SCALE, INSERT_CLIENTS),
            visibility_rows=max(1, round(VISIBILITY_ROWS_PER_SCALE * scale)),
            lag_seconds=max(LAG_MIN_SECONDS, round(LAG_SECONDS_PER_SCALE * scale)),
            mm_per_client=per(MM_TXNS_PER_SCALE, MM_CLIENTS),
        )

    def describe(self) -> list[str]:
        return [
            f"tpcb: {self.tpcb_per_client * TPCB_CLIENTS:,} TPC-B transactions as a backlog",
            f"bulk: {self.bulk_rows:,} rows in one transaction as a backlog",
            f"inserts: {self.insert_per_client * INSERT_CLIENTS:,} single-row INSERTs as a backlog",
            f"visibility: {self.visibility_rows:,} rows + a marker in one transaction, replication running",
            f"lag: TPC-B at {LAG_RATE} tx/s for {self.lag_seconds} s, a probe every 50 ms",
            f"multimaster: {self.mm_per_client * MM_CLIENTS:,} transactions per node ({MM_CLIENTS} clients),"
            f" {MM_SHARED_PERCENT}% on {MM_SHARED_KEYS} shared keys",
        ]


@dataclass(slots=True)
class Failure:
    system: str
    workload: str
    run: int
    error: str


# A workload's timed window: a factory of async context managers, entered around the part that is timed
# (a backlog's start .. last marker, the big commit's visibility, the lag probes). bench.profile measures in
# it; the suite's default does nothing.
Window = Callable[[], contextlib.AbstractAsyncContextManager[Any]]
Windows = Callable[[SuiteSystem, str], Window]  # (system, workload) -> its window


@dataclass(slots=True)
class Context:
    system: SuiteSystem
    watcher: Watcher
    sizes: SuiteSizes
    run: int
    scripts: Path
    timeout: float
    window: Window = contextlib.nullcontext


# ---------------------------------------------------------------------------------------------------------
# Shared steps


async def start_caught_up(ctx: Context, marker: int) -> None:
    """Start replication and wait until every target has a fresh marker (nothing left in flight)."""
    await add_marker(ctx.system.a.dsn(), marker)
    await ctx.system.start()
    await ctx.watcher.wait(marker, ctx.timeout)


def link_values(system: SuiteSystem, metric: str, overall: float, per_link: Sequence[float]
                ) -> dict[str, float]:
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
    baselines = await origin_positions(s)
    cpu = {n.name: server_cpu_seconds(n) for n in s.nodes}
    bench_cpu = time.process_time()
    async with ctx.window():
        start = time.perf_counter()
        await s.start()
        links = await ctx.watcher.wait(marker, ctx.timeout, baselines)
    return {
        "seconds": max(done for _, done in links) - start,
        "link_seconds": [done - start for _, done in links],
        "first_apply_s": min(first for first, _ in links) - start,
        "bench_cpu_s": time.process_time() - bench_cpu,
        **{f"{n.name}_server_cpu_s": server_cpu_seconds(n) - cpu[n.name] for n in s.nodes},
    }


def rates(system: SuiteSystem, metric: str, amount: float, timing: dict[str, Any]) -> dict[str, float]:
    per_link = [amount / seconds for seconds in timing["link_seconds"]]
    return link_values(system, metric, amount / timing["seconds"], per_link)


async def same_as_a(system: SuiteSystem, query: str, what: str) -> None:
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
    txns = int(_pgbench_field(out, r"number of transactions actually processed: (\d+)"))
    timing = await time_backlog(ctx, marker)
    details = {**timing, "transactions": txns, "generate_tps": _pgbench_field(out, r"tps = ([\d.]+)"),
               **s.applied()}
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
        "pgbench_tps": _pgbench_field(out, r"tps = ([\d.]+)"),
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
    start = time.perf_counter()
    outs = await asyncio.gather(*(
        pgbench("-n", "-c", str(MM_CLIENTS), "-j", str(MM_CLIENTS), "-t", str(ctx.sizes.mm_per_client),
                "-f", str(script), "-D", f"node={MM_NODE_IDS[i]}", node.dsn())
        for i, node in enumerate(s.data_nodes)
    ))
    generated = time.perf_counter()
    converged, polls = await ctx.watcher.converge(MM_TABLES, ctx.timeout, CONVERGE_POLL_S)
    conflicts = s.conflicts()
    txns = [int(_pgbench_field(out, r"number of transactions actually processed: (\d+)")) for out in outs]
    details: dict[str, Any] = {
        "transactions": sum(txns), "writers": [n.name for n in s.data_nodes],
        "generate_s": generated - start, "converge_after_generate_s": converged - generated,
        "generate_tps": [_pgbench_field(out, r"tps = ([\d.]+)") for out in outs], "polls": polls,
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


# ---------------------------------------------------------------------------------------------------------
# Running


def _show(m: Measurement) -> str:
    shown = ", ".join(f"{k} {v:,.2f}" for k, v in m.values.items())
    return f"run {m.run}: {m.system:<9} {m.workload:<11} {shown}"


async def _prepare(system: SuiteSystem) -> None:
    for node in system.data_nodes:
        await prepare_node(node)
        await execute(node.dsn(), SUITE_SCHEMA, MM_SEED)
    await system.setup()


async def _recover(system: SuiteSystem, watcher: Watcher) -> tuple[Watcher, str | None]:
    """After a failed workload: a fresh watcher (the old one may be mid-request) and replication stopped.
    Returns the watcher and why the system could not be stopped (None when it was)."""
    watcher.close()
    watcher = Watcher(system)
    await watcher.call("ready")
    try:
        await system.stop()
    except Exception as exc:
        return watcher, f"skipped: {system.name} could not be stopped after the failure ({exc})"
    return watcher, None


async def run_system(name: str, nodes: list[Any], sizes: SuiteSizes, run: int, workloads: Sequence[str],
                     scripts: Path, limit: float, windows: Windows | None = None
                     ) -> tuple[list[Measurement], list[Failure]]:
    system = SYSTEMS[name](nodes)
    try:
        await _prepare(system)
    except Exception as exc:
        error = f"setup: {describe_failure(exc, system)}"
        print(f"run {run}: {name}: {error}", file=sys.stderr)
        with contextlib.suppress(Exception):
            await system.close()
        return [], [Failure(name, w, run, error) for w in workloads]
    results: list[Measurement] = []
    failures: list[Failure] = []
    watcher = Watcher(system)
    try:
        await watcher.call("ready")
        for i, workload in enumerate(workloads):
            try:
                ctx = Context(system, watcher, sizes, run, scripts, limit)
                if windows is not None:
                    ctx.window = windows(system, workload)
                began = time.perf_counter()
                await system.settle()
                measurement = await asyncio.wait_for(RUNNERS[workload](ctx), limit + 60)
                measurement.details["wall_s"] = time.perf_counter() - began  # generating included
            except Exception as exc:
                failures.append(Failure(name, workload, run, describe_failure(exc, system)))
                print(f"run {run}: {name} {workload} FAILED: {failures[-1].error}", file=sys.stderr)
                watcher, stuck = await _recover(system, watcher)
                if stuck:
                    failures.extend(Failure(name, w, run, stuck) for w in workloads[i + 1:])
                    break
                continue
            results.append(measurement)
            print(_show(measurement), file=sys.stderr)
    finally:
        try:
            await system.close()
        except Exception as exc:
            print(f"run {run}: {name}: closing failed: {exc}", file=sys.stderr)
        finally:
            watcher.close()
    return results, failures


def run_once(name: str, sizes: SuiteSizes, run: int, workloads: Sequence[str], scripts: Path,
             timeout: float, windows: Windows | None = None) -> tuple[list[Measurement], list[Failure]]:
    """One system, one run: fresh nodes, every workload in order, then the nodes are destroyed.
    `windows(system, workload)`, when given, makes each workload's timed window (Context.window)."""
    try:
        nodes = create_nodes(list(SYSTEMS[name].node_names), settings=SETTINGS)
    except Exception as exc:
        error = f"creating nodes: {type(exc).__name__}: {exc}"[:1500]
        return [], [Failure(name, w, run, error) for w in workloads]
    try:
        return run_async(lambda: run_system(name, nodes, sizes, run, workloads, scripts, timeout, windows))
    except Exception as exc:  # a bug in the runner itself: keep the other systems going
        traceback.print_exc()
        return [], [Failure(name, w, run, f"runner: {type(exc).__name__}: {exc}"[:1500]) for w in workloads]
    finally:
        for node in nodes:
            node.destroy()


# ---------------------------------------------------------------------------------------------------------
# Summary


def summary(results: Sequence[Measurement], systems: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (workload, metric, system): min, median, and the ratio of the medians to the anchor
    (native; pgmesh2 for multimaster), oriented so that higher is better."""
    keys: list[tuple[str, str]] = []
    for m in results:
        keys.extend((m.workload, metric) for metric in m.values if (m.workload, metric) not in keys)
    keys.sort(key=lambda k: (WORKLOADS.index(k[0]), base_metric(k[1]), k[1]))
    medians: dict[tuple[str, str, str], float] = {}
    rows: list[dict[str, Any]] = []
    for workload, metric in keys:
        for system in systems:
            values = [m.values[metric] for m in results
                      if m.system == system and m.workload == workload and metric in m.values]
            if not values:
                continue
            medians[(workload, metric, system)] = statistics.median(values)
            rows.append({"system": system, "workload": workload, "metric": metric, "min": min(values),
                         "max": max(values), "median": statistics.median(values), "runs": len(values),
                         "ratio": None})
    for row in rows:
        anchor = "pgmesh2" if row["workload"] == "multimaster" else "native"
        base = medians.get((row["workload"], base_metric(row["metric"]), anchor))
        if base_metric(row["metric"]) in INFO_ONLY or not base or not row["median"]:
            continue
        lower = base_metric(row["metric"]) in LOWER_IS_BETTER
        row["ratio"] = base / row["median"] if lower else row["median"] / base
    return rows


def link_check(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """pgmesh3's per-link medians against pgmesh2's (the target: each link within 20% of the 2-node rate)."""
    two = {(r["workload"], r["metric"]): r["median"] for r in rows if r["system"] == "pgmesh2"}
    out = []
    for r in rows:
        if r["system"] != "pgmesh3" or " a->" not in r["metric"] or r["workload"] == "multimaster":
            continue
        base = two.get((r["workload"], base_metric(r["metric"])))
        if not base or not r["median"]:
            continue
        lower = base_metric(r["metric"]) in LOWER_IS_BETTER
        ratio = base / r["median"] if lower else r["median"] / base
        out.append({**r, "pgmesh2": base, "vs_pgmesh2": ratio, "within_20pct": ratio >= 0.8})
    return out


# ---------------------------------------------------------------------------------------------------------
# Report: suite.json (RESULTS.md and the plots are bench.suite_report's)


def build_doc(args: argparse.Namespace, command: str, sizes: SuiteSizes, systems: Sequence[str],
              workloads: Sequence[str], results: Sequence[Measurement], failures: Sequence[Failure],
              wall_s: float, **extra: Any) -> dict[str, Any]:
    rows = summary(results, systems)
    return {**extra,
        "bench": "suite", "command": command, "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wall_s": wall_s, "runs": args.runs, "sizes": asdict(sizes), "workload_sizes": sizes.describe(),
        "systems": list(systems), "workloads": list(workloads), "machine": machine_facts(),
        "server_settings": {**DEFAULT_SETTINGS, **SETTINGS},
        "measurements": [asdict(m) for m in results], "failures": [asdict(f) for f in failures],
        "summary": rows, "links": link_check(rows),
    }


# ---------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    about = (__doc__ or "").splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m bench --all", description=about)
    parser.add_argument("--scale", type=float, default=1.0, help="workload size factor (default 1)")
    parser.add_argument("--runs", type=int, default=2, help="runs per system; min and median are reported")
    parser.add_argument("--only-system", action="append", choices=SYSTEM_ORDER, metavar="SYSTEM",
                        help=f"run only this system ({', '.join(SYSTEM_ORDER)}); repeatable")
    parser.add_argument("--only-workload", action="append", choices=WORKLOADS, metavar="WORKLOAD",
                        help=f"run only this workload ({', '.join(WORKLOADS)}); repeatable")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "RESULTS.md",
                        help="the report; suite.json and the plots go to results/ beside it")
    parser.add_argument("--include-slow", action="store_true",
                        help="also run what a system skips by default for cost (bucardo: bulk, visibility)")
    parser.add_argument("--all", action="store_true", help=argparse.SUPPRESS)  # from `python -m bench --all`
    args = parser.parse_args(argv)
    if args.scale <= 0 or args.runs < 1:
        parser.error("--scale must be > 0 and --runs at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    command = shlex.join([".venv/bin/python", "-m", "bench", "--all", *[a for a in raw if a != "--all"]])
    sizes = SuiteSizes.for_scale(args.scale)
    systems = [s for s in SYSTEM_ORDER if args.only_system is None or s in args.only_system]
    workloads = [w for w in WORKLOADS if args.only_workload is None or w in args.only_workload]
    if not os.access(find_pg_bindir() / "pgbench", os.X_OK):
        print(f"pgbench not found in {find_pg_bindir()}", file=sys.stderr)
        return 2
    planned, not_run = plan_workloads(systems, workloads, args.include_slow)
    timeout = WORKLOAD_TIMEOUT_S * max(1.0, args.scale)
    began = time.perf_counter()
    commit = git_commit()  # what is measured: the code as the run starts
    results: list[Measurement] = []
    failures: list[Failure] = []
    spent: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pgmesh-bench-suite-") as tmp:
        scripts = Path(tmp)
        (scripts / "insert.sql").write_text(INSERT_SCRIPT)
        (scripts / "multimaster.sql").write_text(MM_SCRIPT)
        for run in range(args.runs):
            for name in systems if run % 2 == 0 else systems[::-1]:
                print(f"run {run}: {name} ({time.perf_counter() - began:.0f} s so far)", file=sys.stderr)
                took = time.perf_counter()
                done, failed = run_once(name, sizes, run, planned[name], scripts, timeout)
                spent.append({"system": name, "run": run, "seconds": round(time.perf_counter() - took, 1)})
                results.extend(done)
                failures.extend(failed)
    wall = time.perf_counter() - began
    doc = build_doc(args, command, sizes, systems, workloads, results, failures, wall, commit=commit,
                    not_run=not_run, system_seconds=spent)
    out: Path = args.out
    outdir = out.parent / "results"
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "suite.json").write_text(json.dumps(doc, indent=1) + "\n")
    for problem in write_plots(doc, outdir):
        print(problem, file=sys.stderr)
    out.write_text(render_markdown(doc, "results"))
    print("\n".join(results_table(doc)))
    for system, text in system_status(doc).items():
        print(f"{system}: {text}")
    print(f"total wall time {wall:.0f} s ({wall / 60:.1f} min); report {out}, raw {outdir / 'suite.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
