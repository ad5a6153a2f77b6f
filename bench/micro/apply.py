"""Apply throughput and steady-state lag A -> B: pgmesh beside native logical replication (a SUBSCRIPTION).

A slice of the suite (`python -m bench --all`): the same systems (bench.harness: `native`, and pgmesh's
two-node mesh `pgmesh2`, reported here as `pgmesh`), the same workloads and the same way of timing them
(bench.harness.workloads), on fresh node pairs with identical settings, in the same run; only the sizes
are this bench's own:

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
nodes, `pgbench_history` with a primary key, the bench tables; native: a FOR ALL TABLES publication and a
disabled subscription (ENABLE / DISABLE start and stop it); pgmesh: `pgmesh init` and the router run in
this process under uvloop. Before each workload every node gets VACUUM ANALYZE and a CHECKPOINT, and
pgmesh's router first reads the echoes the last workload left in the WAL (as in the suite). Per run
(stderr, --json): first_apply_s, the bench process's CPU (for pgmesh: the router), each server's CPU in
the window, and pgmesh's counters (stuck_shutdowns_so_far: router shutdowns that hung and had their
source tasks cancelled again). Rows are compared between A and B after each workload; the order of the
systems alternates between runs.

The table gives min and median over the runs and, on pgmesh's rows, the ratio of the medians: pgmesh/native
for throughput and native/pgmesh for lag, so in both cases higher is better and 1.00x means "as good as
native". Note that pgmesh runs a full mesh: B's walsender also decodes what pgmesh applies there (to filter
echoes), on the same two cores.

Reproduce (nodes are created and destroyed by the script; nothing else is touched):

    .venv/bin/python -m bench.micro.apply                            # scale 1, 2 runs, all workloads
    .venv/bin/python -m bench.micro.apply --scale 0.1 --runs 1      # quick
    .venv/bin/python -m bench.micro.apply --only tpcb --only bulk --json /tmp/apply.json
    .venv/bin/python -m pyinstrument -m bench.micro.apply --only tpcb --scale 0.2 --runs 1   # where time goes

Owns: this bench's sizes, its text table and JSON. Must not: define a system, a workload or its timing
(bench.harness); the summary's ratios are the suite's (bench.suite.runner.summary).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from bench.harness.nodes import SETTINGS, pgbench_ready
from bench.harness.runs import Failure, run_once
from bench.harness.watcher import PROBE_INTERVAL_S
from bench.harness.workloads import LAG_RATE, TPCB_ROWS_PER_TXN, WORKLOAD_TIMEOUT_S, Measurement, Sizes
from bench.suite.report import LOWER_IS_BETTER
from bench.suite.runner import summary

# This bench's name for a system -> its class in bench.harness.runs.SYSTEMS.
SYSTEMS = {"native": "native", "pgmesh": "pgmesh2"}
WORKLOADS = ("tpcb", "bulk", "lag")
BULK_ROWS_PER_SCALE = 200_000
LAG_SECONDS_PER_SCALE = 10.0


def sizes_for(scale: float) -> Sizes:
    return Sizes.for_scale(scale, bulk_rows_per_scale=BULK_ROWS_PER_SCALE,
                           lag_seconds_per_scale=LAG_SECONDS_PER_SCALE)


def as_reported(m: Measurement, system: str) -> Measurement:
    """The harness's measurement as this bench reports it: under this bench's system name, TPC-B also in
    rows/s, lag also with its max and mean (ms, over the probes)."""
    values, details = dict(m.values), dict(m.details)
    if m.workload == "tpcb":
        values["rows/s"] = values["tx/s"] * TPCB_ROWS_PER_TXN
    if m.workload == "lag" and details.get("series"):
        lags = [max(lags) for _, lags in details["series"]]
        details.update(max_ms=max(lags), mean_ms=statistics.fmean(lags))
    return Measurement(system, m.workload, m.run, values, details)


def format_table(sizes: Sizes, runs: int, results: Sequence[Measurement]) -> str:
    lines = [
        f"pgmesh apply bench A -> B: scale {sizes.scale:g} (TPC-B backlog {sizes.tpcb_txns} txns,"
        f" bulk insert {sizes.bulk_rows} rows in 1 txn, lag: TPC-B at {LAG_RATE} tx/s for"
        f" {sizes.lag_seconds} s + a probe every {PROBE_INTERVAL_S * 1000:.0f} ms), {runs} run(s),"
        f" {os.cpu_count()} CPUs, router on uvloop",
        f"{'system':<8}{'workload':<10}{'metric':<9}{'min':>12}{'median':>12}{'ratio':>9}",
    ]
    for row in summary(results, tuple(SYSTEMS)):
        digits = 2 if row["metric"] in LOWER_IS_BETTER else 0
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None and row["system"] != "native" else ""
        lines.append(
            f"{row['system']:<8}{row['workload']:<10}{row['metric']:<9}"
            f"{row['min']:>12,.{digits}f}{row['median']:>12,.{digits}f}{ratio:>9}"
        )
    lines.append(
        "ratio (pgmesh rows, of the medians): pgmesh/native for throughput, native/pgmesh for lag;"
        " higher is better, 1.00x = as good as native"
    )
    return "\n".join(lines)


def write_json(path: Path, sizes: Sizes, runs: int, results: Sequence[Measurement],
               failures: Sequence[Failure]) -> None:
    doc = {
        "bench": "apply",
        "sizes": {**asdict(sizes), "tpcb_txns": sizes.tpcb_txns},
        "runs": runs,
        "node_settings": SETTINGS,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loop": "uvloop",
        "measurements": [asdict(m) for m in results],
        "failures": [asdict(f) for f in failures],
        "summary": summary(results, tuple(SYSTEMS)),
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    about = (__doc__ or "").splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m bench.micro.apply", description=about)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="workload size factor: 20000*S TPC-B txns, 200000*S bulk rows (default 1)")
    parser.add_argument("--runs", type=int, default=2, help="runs; min and median are reported (default 2)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results here")
    parser.add_argument("--only", action="append", choices=WORKLOADS, metavar="WORKLOAD",
                        help=f"run only this workload ({', '.join(WORKLOADS)}); repeatable")
    parser.add_argument("--system", action="append", choices=tuple(SYSTEMS),
                        help="run only this system (default both); repeatable")
    args = parser.parse_args(argv)
    if args.scale <= 0 or args.runs < 1:
        parser.error("--scale must be > 0 and --runs at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = sizes_for(args.scale)
    workloads = [w for w in WORKLOADS if args.only is None or w in args.only]
    systems = [s for s in SYSTEMS if args.system is None or s in args.system]
    if (missing := pgbench_ready()) is not None:
        print(missing, file=sys.stderr)
        return 2
    timeout = WORKLOAD_TIMEOUT_S * max(1.0, args.scale)
    results: list[Measurement] = []
    failures: list[Failure] = []
    for run in range(args.runs):
        order = systems if run % 2 == 0 else systems[::-1]
        for system in order:
            done, failed = run_once(SYSTEMS[system], sizes, run, workloads, timeout)
            results.extend(as_reported(m, system) for m in done)
            failures.extend(failed)
    if results:
        print(format_table(sizes, args.runs, results))
    for f in failures:
        print(f"FAILED: {f.system} {f.workload} (run {f.run}): {f.error}", file=sys.stderr)
    if args.json is not None:
        write_json(args.json, sizes, args.runs, results, failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
