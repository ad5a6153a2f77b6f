"""Every system on every workload, same nodes and settings, one report: `python -m bench --all`.

Systems (bench/harness/): native, pglogical, bucardo, pgmesh2 and pgmesh3 (a's changes measured on
a -> b and a -> c); only with --only-system: native3 (native to two subscribers, the control for
pgmesh3's links), pgmesh2lanes (two apply lanes a link), pgmesh5 and pgmesh8, pgmesh2script and
pgmesh3script (applying by SQL text, the transport before issue 39). Each gets fresh nodes
per run with the same server settings (bench.harness.nodes.SETTINGS), `pgbench -i -s 1` and the same
bench tables on every node; the system order alternates between runs. Workloads, in this order
(bench/harness/workloads.py, sizes at --scale S):
tpcb, bulk, inserts, visibility, lag, multimaster. Multimaster runs only on pgmesh2, pgmesh3 and bucardo
(the others are one-way: n/a); its ratio column compares to pgmesh2. Bucardo skips bulk and visibility
unless --include-slow (a 1M-row transaction takes it minutes).

Targets are polled by the watcher process (bench/harness/watcher.py). A failure in one (system, workload,
run) is recorded in the report and the suite goes on. Output: --out (default bench/RESULTS.md) and,
beside it, results/suite.json, results/lag.png and results/throughput.png (rendered by
bench.suite.report).

    .venv/bin/python -m bench --all                                    # scale 1, 2 runs (~30 min)
    .venv/bin/python -m bench --all --scale 0.05 --runs 1 --out /tmp/suite/RESULTS.md   # quick
    .venv/bin/python -m bench.suite --only-system pgmesh3 --only-workload tpcb
    .venv/bin/python -m bench.suite --backlog long --runs 3 --only-workload tpcb --only-workload inserts
    .venv/bin/python -m bench --all --rtt-ms 0.65 --only-system native --only-system pgmesh2   # ~1 ms RTT
    .venv/bin/python -m bench.suite.profile    # where the CPU goes in each workload

`--backlog long` makes the backlogs 80,000 TPC-B and 400,000 one-row inserts (times --scale; default:
20,000 and 100,000), so that the in-server workers' catch-up lasts seconds and worker or router start is a
small part; `--tpcb-txns N` / `--insert-txns N` set a count exactly. Each backlog's catch-up seconds and
first-apply seconds are reported beside its rate.

`--rtt-ms` puts a delaying proxy (bench.harness.delay) on every system's replication connections; its
threads add about 0.35 ms to what is asked, so the round trip is measured before the runs and reported.

Owns: the command line, the runs across systems, the summary (min, median, ratio to the anchor), the
three-node link check (pgmesh3 against pgmesh2, native3 against native), and suite.json. Must not:
define a system or a workload (bench.harness) or format the markdown and plots (bench.suite.report).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Final

from bench.harness.nodes import SETTINGS, pgbench_ready
from bench.harness.runs import Failure, measure_rtt, plan_workloads, run_once
from bench.harness.workloads import BACKLOGS, WORKLOAD_TIMEOUT_S, WORKLOADS, Measurement, Sizes
from bench.suite.report import (
    INFO_ONLY,
    LOWER_IS_BETTER,
    base_metric,
    git_commit,
    render_markdown,
    results_table,
    system_status,
    write_plots,
)
from router.testing.localnodes import DEFAULT_SETTINGS, find_pg_bindir

SYSTEM_ORDER = ("native", "pglogical", "bucardo", "pgmesh2", "pgmesh3", "native3", "pgmesh2lanes",
                "pgmesh2nolog", "pgmesh5", "pgmesh8", "pgmesh2nologb", "pgmesh2b", "pgmesh2script",
                "pgmesh3script")
# without --only-system: native3 (the control for pgmesh3's links: PostgreSQL's own apply to two
# subscribers), pgmesh2 with two apply lanes and the larger meshes (per-link throughput against N, issue
# 20) only when asked
DEFAULT_SYSTEMS = SYSTEM_ORDER[:5]
BENCH_DIR = Path(__file__).resolve().parents[1]

__all__ = ["SYSTEM_ORDER", "WORKLOADS", "Failure", "Sizes", "build_doc", "link_check", "main", "parse_args",
           "render_markdown", "summary", "write_plots"]


# ---------------------------------------------------------------------------------------------------------
# Summary


def _seconds(m: Measurement, metric: str) -> float | None:
    """How long the timed window of a rate lasted (a backlog's catch-up, multimaster's convergence): for
    `tx/s a->x` target x's catch-up; None for other metrics."""
    if base_metric(metric) not in ("tx/s", "rows/s"):
        return None
    _, arrow, target = metric.partition(" a->")
    value = m.details.get("catchup_s", {}).get(target) if arrow else m.details.get("seconds")
    return float(value) if isinstance(value, (int, float)) else None


def _median_or_none(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summary(results: Sequence[Measurement], systems: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (workload, metric, system): min, median, and the ratio of the medians to the anchor
    (native; pgmesh2 for multimaster), oriented so that higher is better; for a rate also the median
    seconds its window lasted (`seconds`: a backlog's catch-up) and until a target first applied
    (`first_apply_s`: worker or router start, or a big transaction's decoding)."""
    keys: list[tuple[str, str]] = []
    for m in results:
        keys.extend((m.workload, metric) for metric in m.values if (m.workload, metric) not in keys)
    keys.sort(key=lambda k: (WORKLOADS.index(k[0]), base_metric(k[1]), k[1]))
    medians: dict[tuple[str, str, str], float] = {}
    rows: list[dict[str, Any]] = []
    for workload, metric in keys:
        for system in systems:
            runs = [m for m in results
                    if m.system == system and m.workload == workload and metric in m.values]
            if not runs:
                continue
            values = [m.values[metric] for m in runs]
            medians[(workload, metric, system)] = statistics.median(values)
            seconds = _median_or_none([_seconds(m, metric) for m in runs])
            first = _median_or_none([m.details.get("first_apply_s") for m in runs]) if seconds else None
            rows.append({"system": system, "workload": workload, "metric": metric, "min": min(values),
                         "max": max(values), "median": statistics.median(values), "runs": len(values),
                         "ratio": None, "seconds": seconds, "first_apply_s": first})
    for row in rows:
        anchor = "pgmesh2" if row["workload"] == "multimaster" else "native"
        base = medians.get((row["workload"], base_metric(row["metric"]), anchor))
        if base_metric(row["metric"]) in INFO_ONLY or not base or not row["median"]:
            continue
        lower = base_metric(row["metric"]) in LOWER_IS_BETTER
        row["ratio"] = base / row["median"] if lower else row["median"] / base
    return rows


# Three-node systems, each against its two-node self: pgmesh3's links (the target: each within 20% of the
# 2-node rate), and native3's as the control (what a second subscriber costs PostgreSQL's own apply here).
THREE_NODES: Final = {"pgmesh3": "pgmesh2", "native3": "native", "pgmesh3script": "pgmesh2script"}


def link_check(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each three-node system's per-link medians against its two-node system's (`THREE_NODES`)."""
    medians = {(r["system"], r["workload"], r["metric"]): r["median"] for r in rows}
    out = []
    for r in rows:
        two_nodes = THREE_NODES.get(r["system"])
        if two_nodes is None or " a->" not in r["metric"] or r["workload"] == "multimaster":
            continue
        base = medians.get((two_nodes, r["workload"], base_metric(r["metric"])))
        if not base or not r["median"]:
            continue
        lower = base_metric(r["metric"]) in LOWER_IS_BETTER
        ratio = base / r["median"] if lower else r["median"] / base
        out.append({**r, "two_nodes": two_nodes, "two_nodes_median": base, "vs_two_nodes": ratio,
                    "within_20pct": ratio >= 0.8})
    return out


# ---------------------------------------------------------------------------------------------------------
# Report: suite.json (RESULTS.md and the plots are bench.suite.report's)


def _command_output(*argv: str) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_facts() -> dict[str, Any]:
    """The machine and the versions of the systems under test, for the report."""
    model = memory = "unknown"
    with contextlib.suppress(OSError, IndexError):
        model = Path("/proc/cpuinfo").read_text().split("model name")[1].split(":", 1)[1].splitlines()[0]
        model = model.strip()
    with contextlib.suppress(OSError, IndexError, ValueError):
        kb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        memory = f"{kb / 1024 / 1024:.1f} GiB"
    dpkg = ("dpkg-query", "-W", "-f", "${Version}")
    return {
        "cpus": os.cpu_count(), "cpu_model": model, "memory": memory, "platform": platform.platform(),
        "python": platform.python_version(),
        "postgres": _command_output(str(find_pg_bindir() / "postgres"), "--version"),
        "pglogical": _command_output(*dpkg, "postgresql-15-pglogical"),
        "bucardo": _command_output(*dpkg, "bucardo"),
        "loop": "uvloop (pgmesh's router runs in the bench process)",
    }


def build_doc(args: argparse.Namespace, command: str, sizes: Sizes, systems: Sequence[str],
              workloads: Sequence[str], results: Sequence[Measurement], failures: Sequence[Failure],
              wall_s: float, **extra: Any) -> dict[str, Any]:
    rows = summary(results, systems)
    return {**extra,
        "bench": "suite", "command": command, "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wall_s": wall_s, "runs": args.runs, "rtt_ms": getattr(args, "rtt_ms", 0.0),
        "rtt_measured_ms": getattr(args, "rtt_measured_ms", None), "sizes": asdict(sizes),
        "workload_sizes": sizes.describe(),
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
    parser.add_argument("--backlog", choices=tuple(BACKLOGS), default="default",
                        help="backlog sizes at scale 1: default = 20,000 TPC-B and 100,000 one-row inserts;"
                             " long = 80,000 and 400,000 (the in-server workers' catch-up lasts seconds)")
    parser.add_argument("--tpcb-txns", type=int, default=None, metavar="N",
                        help="exactly N TPC-B transactions in the tpcb backlog (not scaled)")
    parser.add_argument("--insert-txns", type=int, default=None, metavar="N",
                        help="exactly N one-row inserts in the inserts backlog (not scaled)")
    parser.add_argument("--runs", type=int, default=2, help="runs per system; min and median are reported")
    parser.add_argument("--only-system", action="append", choices=SYSTEM_ORDER, metavar="SYSTEM",
                        help=f"run only this system ({', '.join(SYSTEM_ORDER)}); repeatable")
    parser.add_argument("--only-workload", action="append", choices=WORKLOADS, metavar="WORKLOAD",
                        help=f"run only this workload ({', '.join(WORKLOADS)}); repeatable")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "RESULTS.md",
                        help="the report; suite.json and the plots go to results/ beside it")
    parser.add_argument("--include-slow", action="store_true",
                        help="also run what a system skips by default for cost (bucardo: bulk, visibility)")
    parser.add_argument("--rtt-ms", type=float, default=0.0,
                        help="round-trip time added to every system's replication connections (a delaying"
                             " proxy on loopback, bench.harness.delay): a subscriber's to its publisher,"
                             " pgmesh's router's to every node; the workloads' clients stay direct")
    parser.add_argument("--all", action="store_true", help=argparse.SUPPRESS)  # from `python -m bench --all`
    args = parser.parse_args(argv)
    if args.scale <= 0 or args.runs < 1 or args.rtt_ms < 0:
        parser.error("--scale must be > 0, --runs at least 1 and --rtt-ms at least 0")
    if (args.tpcb_txns is not None and args.tpcb_txns < 1) or (args.insert_txns is not None
                                                              and args.insert_txns < 1):
        parser.error("--tpcb-txns and --insert-txns must be at least 1")
    return args


def sizes_from(args: argparse.Namespace) -> Sizes:
    return Sizes.for_scale(args.scale, backlog=args.backlog, tpcb_txns=args.tpcb_txns,
                           insert_txns=args.insert_txns)


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    command = shlex.join([".venv/bin/python", "-m", "bench", "--all", *[a for a in raw if a != "--all"]])
    sizes = sizes_from(args)
    chosen = args.only_system if args.only_system is not None else DEFAULT_SYSTEMS
    systems = [s for s in SYSTEM_ORDER if s in chosen]
    workloads = [w for w in WORKLOADS if args.only_workload is None or w in args.only_workload]
    if (missing := pgbench_ready()) is not None:
        print(missing, file=sys.stderr)
        return 2
    planned, not_run = plan_workloads(systems, workloads, args.include_slow)
    if args.rtt_ms > 0:
        direct, delayed = measure_rtt(args.rtt_ms)
        args.rtt_measured_ms = [round(direct, 3), round(delayed, 3)]
        print(f"round trip of SELECT 1: {direct:.3f} ms direct, {delayed:.3f} ms through the proxy",
              file=sys.stderr)
    timeout = WORKLOAD_TIMEOUT_S * max(1.0, args.scale)
    began = time.perf_counter()
    commit = git_commit()  # what is measured: the code as the run starts
    results: list[Measurement] = []
    failures: list[Failure] = []
    spent: list[dict[str, Any]] = []
    for run in range(args.runs):
        for name in systems if run % 2 == 0 else systems[::-1]:
            print(f"run {run}: {name} ({time.perf_counter() - began:.0f} s so far)", file=sys.stderr)
            took = time.perf_counter()
            done, failed = run_once(name, sizes, run, planned[name], timeout, rtt_ms=args.rtt_ms)
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
