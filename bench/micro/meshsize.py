"""Router CPU per source transaction against the mesh size: TPC-B at N = 2, 3, 5, 8 nodes (issue 39).

One node (a) writes a backlog of pgbench TPC-B transactions while replication is stopped; every other
node is a target. For each N: fresh nodes, the bench's pgmesh on all of them (`bench.harness.pgmesh`,
`pgmesh2` .. `pgmesh8`), the backlog timed as the suite times it (`bench.harness.workloads`, from the
router's start until every target has the marker) through `bench.harness.runs.run_once`. The router runs
in this process, so its CPU is this process's (`time.process_time()`, user + system of every thread, as
`bench.suite.profile` counts the bench process; the watcher that polls the targets is another process):

  window      from the start command until every target has the marker (the router's start included;
              its CPU until a target first applied is also given, read every SAMPLE_S, and the CPU per
              transaction without it: `after first apply`, what `+ µs per extra link` compares)
  drained     the window plus until every logical slot on every node is confirmed up to that node's WAL
              position at the window's end: on 15 the router also reads what it applied on each target
              back from that target (the echoes, skipped by origin), N-1 per source transaction

With --script, also pgmesh applying by SQL text at each size (`pgmesh{N}script`,
`replication.apply_transport = "script"`: the transport before issue 39) in the same run. Beside them,
native logical replication to one subscriber (`native`) and to two (`native3`): native3's
per-link rate over native's is the control for pgmesh3 / pgmesh2 (what a second target costs PostgreSQL's
own apply on the same cores). Medians over `--runs`; the order of the systems alternates between runs.

    .venv/bin/python -m bench.micro.meshsize                # 80,000 TPC-B, 3 runs (~15 min here)
    .venv/bin/python -m bench.micro.meshsize --quick        # 2,000 TPC-B, 1 run: a size check (~1 min)
    .venv/bin/python -m bench.micro.meshsize --sizes 2,3 --runs 1 --tpcb-txns 20000
    .venv/bin/python -m bench.micro.meshsize --script       # also the SQL-text transport (before)

Output: the table on stdout and, unless --quick, bench/results/issue39/meshsize.md and meshsize.json (or
--out DIR).

Owns: the router CPU readings around the suite's timed window, the drain after it, and this table. Must
not: time the backlog differently from the suite (`workloads.time_backlog` does), or touch a node it did
not create.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from bench.harness.nodes import pgbench_ready
from bench.harness.runs import SYSTEMS, Failure, run_once
from bench.harness.system import System
from bench.harness.workloads import WORKLOAD_TIMEOUT_S, Measurement, Sizes
from bench.harness.workloads import Window as WindowFactory
from bench.suite.report import git_commit
from bench.suite.runner import machine_facts

MESH_SIZES = (2, 3, 5, 8)
NATIVE = ("native", "native3")
SCRIPT = "script"  # pgmesh{N}script: `replication.apply_transport = "script"`, the transport before issue 39
TPCB_TXNS = 80_000  # the suite's --backlog long: native's catch-up lasts seconds
QUICK_TXNS = 2_000
RUNS = 3
DRAIN_POLL_S = 0.1
SAMPLE_S = 0.02  # how often the window reads the CPU (to split the router's start from its apply)
DRAIN_LIMIT_S = 300.0
OUT = Path(__file__).resolve().parents[1] / "results" / "issue39"
SLOTS_BEHIND = ("SELECT count(*) FROM pg_catalog.pg_replication_slots WHERE slot_type = 'logical'"
                " AND (confirmed_flush_lsn IS NULL OR confirmed_flush_lsn < %s::pg_lsn)")


@dataclass(slots=True)
class Reading:
    """What one window measured: the router's (this process's) CPU and the wall time, to the end of the
    window and to the end of the drain (pgmesh only; NaN when the drain timed out), and the CPU read
    every SAMPLE_S in the window (seconds since its start, CPU seconds since its start)."""

    system: str
    run: int
    window_cpu_s: float = float("nan")
    window_wall_s: float = float("nan")
    drained_cpu_s: float = float("nan")
    drained_wall_s: float = float("nan")
    samples: list[tuple[float, float]] = field(default_factory=list)

    def cpu_at(self, seconds: float) -> float:
        """The CPU used in the window up to `seconds` into it (the last sample at or before it)."""
        return max((cpu for at, cpu in self.samples if at <= seconds), default=0.0)

    def public(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "samples"}


async def drain(system: System) -> bool:
    """Wait until every logical slot on every data node is confirmed up to the node's WAL position of
    now (the router has read every echo); False when DRAIN_LIMIT_S passed first."""
    async with contextlib.AsyncExitStack() as stack:
        conns = [await stack.enter_async_context(await psycopg.AsyncConnection.connect(node.dsn(),
                                                                                       autocommit=True))
                 for node in system.data_nodes]
        wanted = []
        for conn in conns:
            row = await (await conn.execute("SELECT pg_catalog.pg_current_wal_lsn()::text")).fetchone()
            wanted.append(row[0] if row else "0/0")
        deadline = time.monotonic() + DRAIN_LIMIT_S
        while time.monotonic() < deadline:
            behind = 0
            for conn, lsn in zip(conns, wanted, strict=True):
                row = await (await conn.execute(SLOTS_BEHIND, [lsn])).fetchone()
                behind += row[0] if row else 1
            if not behind:
                return True
            await asyncio.sleep(DRAIN_POLL_S)
    return False


async def sample(reading: Reading, cpu: float, began: float) -> None:
    while True:
        reading.samples.append((time.perf_counter() - began, time.process_time() - cpu))
        await asyncio.sleep(SAMPLE_S)


class Meter:
    """Makes each backlog's window (a `bench.harness.workloads.Windows`) and keeps its `Reading`."""

    __slots__ = ("readings", "run")

    def __init__(self) -> None:
        self.readings: dict[tuple[str, int], Reading] = {}
        self.run = 0

    def windows(self, system: System, workload: str) -> WindowFactory:
        return lambda: self._window(system)

    @contextlib.asynccontextmanager
    async def _window(self, system: System) -> AsyncIterator[None]:
        reading = self.readings[(system.name, self.run)] = Reading(system.name, self.run)
        cpu, began = time.process_time(), time.perf_counter()
        sampler = asyncio.create_task(sample(reading, cpu, began))
        try:
            yield
        finally:
            reading.window_cpu_s = time.process_time() - cpu
            reading.window_wall_s = time.perf_counter() - began
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        if system.name.startswith("pgmesh") and await drain(system):
            reading.drained_cpu_s = time.process_time() - cpu
            reading.drained_wall_s = time.perf_counter() - began


# ---------------------------------------------------------------------------------------------------------
# Runs and the table


def systems_for(sizes: Sequence[int], native: bool, script: bool) -> list[str]:
    """pgmesh at each size (and applying by SQL text at each size, `script`), then native and native3."""
    suffixes = ("", SCRIPT) if script else ("",)
    return [f"pgmesh{n}{x}" for x in suffixes for n in sizes] + (list(NATIVE) if native else [])


def nodes_of(system: str) -> int:
    return len(SYSTEMS[system].node_names)


def per_link_rate(m: Measurement) -> float:
    """The median of the per-link rates (`tx/s a->x`; with one target its `tx/s`)."""
    links = [v for k, v in m.values.items() if k.startswith("tx/s a->")]
    return statistics.median(links) if links else m.values["tx/s"]


def median(values: Sequence[float]) -> float:
    present = [v for v in values if v == v]  # not NaN
    return statistics.median(present) if present else float("nan")


def one_run(m: Measurement, r: Reading | None) -> dict[str, float]:
    """One run's figures; the router's CPU ones NaN without a reading."""
    nan = float("nan")
    txns, first = float(m.details["transactions"]), float(m.details["first_apply_s"])
    start_cpu = r.cpu_at(first) if r else nan
    return {
        "transactions": txns, "catchup_s": float(m.details["seconds"]), "first_apply_s": first,
        "tps_per_link": per_link_rate(m),
        "cpu_s": r.window_cpu_s if r else nan,
        "start_cpu_s": start_cpu,
        "cpu_us_per_txn": r.window_cpu_s / txns * 1e6 if r else nan,
        "steady_us_per_txn": (r.window_cpu_s - start_cpu) / txns * 1e6 if r else nan,
        "drained_cpu_us_per_txn": r.drained_cpu_s / txns * 1e6 if r else nan,
        "drained_s": r.drained_wall_s if r else nan,
    }


def summarize(results: Sequence[Measurement], readings: dict[tuple[str, int], Reading]
              ) -> list[dict[str, Any]]:
    """One row per system: the median of each figure over its runs."""
    rows = []
    for system in dict.fromkeys(m.system for m in results):
        runs = [one_run(m, readings.get((system, m.run))) for m in results if m.system == system]
        rows.append({"system": system, "nodes": nodes_of(system), "links": nodes_of(system) - 1,
                     "runs": len(runs), **{key: median([run[key] for run in runs]) for key in runs[0]}})
    return rows


def _f(value: float, spec: str) -> str:
    return "n/a" if value != value else format(value, spec)


def transport(system: str) -> str:
    return SCRIPT if system.endswith(SCRIPT) else "pipeline"


def render(rows: Sequence[dict[str, Any]]) -> list[str]:
    by = {r["system"]: r for r in rows}
    lines = ["| transport | N | links from a | source tx | router CPU s (start) | µs / source tx"
             " | after first apply | + µs per extra link | µs / source tx, echoes read"
             " | catch-up s (first apply) | tx/s per link | vs N=2 |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    meshes = [r for r in rows if r["system"].startswith("pgmesh")]
    for r in sorted(meshes, key=lambda r: (transport(r["system"]) != "pipeline", r["nodes"])):
        base = by.get("pgmesh2" + ("" if transport(r["system"]) == "pipeline" else SCRIPT))
        growth = vs = float("nan")
        if base is not None and r["nodes"] > 2:
            growth = (r["steady_us_per_txn"] - base["steady_us_per_txn"]) / (r["nodes"] - 2)
        if base is not None:
            vs = r["tps_per_link"] / base["tps_per_link"]
        lines.append(
            f"| {transport(r['system'])} | {r['nodes']} | {r['links']} | {r['transactions']:,.0f}"
            f" | {_f(r['cpu_s'], '.2f')} ({_f(r['start_cpu_s'], '.2f')})"
            f" | {_f(r['cpu_us_per_txn'], '.1f')} | {_f(r['steady_us_per_txn'], '.1f')}"
            f" | {'' if r['nodes'] == 2 else _f(growth, '+.1f')}"
            f" | {_f(r['drained_cpu_us_per_txn'], '.1f')}"
            f" | {r['catchup_s']:.2f} ({r['first_apply_s']:.2f}) | {r['tps_per_link']:,.0f}"
            f" | {_f(vs, '.2f')}x |")
    if "native" in by and "native3" in by:
        n2, n3 = by["native"], by["native3"]
        lines += ["", "| native | subscribers | source tx | catch-up s (first apply) | tx/s per link |",
                  "|---|--:|--:|--:|--:|"]
        lines += [f"| {r['system']} | {r['links']} | {r['transactions']:,.0f}"
                  f" | {r['catchup_s']:.2f} ({r['first_apply_s']:.2f}) | {r['tps_per_link']:,.0f} |"
                  for r in (n2, n3)]
        ratio = n3["tps_per_link"] / n2["tps_per_link"]
        lines += ["", f"Per link, 3 nodes against 2: native3 / native = **{ratio:.2f}x**"]
        for x in ("", SCRIPT):
            if f"pgmesh2{x}" in by and f"pgmesh3{x}" in by:
                mine = by[f"pgmesh3{x}"]["tps_per_link"] / by[f"pgmesh2{x}"]["tps_per_link"]
                lines[-1] += f"; pgmesh3{x} / pgmesh2{x} = **{mine:.2f}x**"
        lines[-1] += " (the issue's aim: pgmesh3 / pgmesh2 >= native3 / native)."
    return lines


NOTES = [
    "",
    "Router CPU: this process's user + system CPU (`time.process_time()`) from the router's start command"
    " until every target had the backlog's marker (in brackets: until a target first applied, the"
    " router's start), over the source transactions; `after first apply`: without the start's CPU;"
    " `+ µs per extra link` = (after first apply at N - at 2) / (N - 2), the issue's aim <= 5 µs on TPC-B."
    " `echoes read`: the same CPU up to"
    " every logical slot on every node confirmed to the node's WAL position at the window's end (on 15 the"
    " router reads back what it applied on each target). Catch-up: start until every target had the"
    " marker (first apply: until a target's origin first moved). tx/s per link: the median over a's"
    " links. Medians over the runs.",
]


def write(out: Path, doc: dict[str, Any], lines: Sequence[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "meshsize.json").write_text(json.dumps(doc, indent=1) + "\n")
    header = [f"# Router CPU per source transaction against the mesh size (TPC-B, {doc['finished']})", "",
              f"`{doc['command']}` at commit {doc['commit']}; {doc['runs']} run(s), took"
              f" {doc['wall_s'] / 60:.1f} min; {doc['postgres']}.", ""]
    failures = [f"- {f['system']} run {f['run']}: {f['error']}" for f in doc["failures"]]
    (out / "meshsize.md").write_text("\n".join([*header, *lines, *NOTES, "", "Failures:", "",
                                                *(failures or ["None."]), ""]))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    about = (__doc__ or "").splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m bench.micro.meshsize", description=about)
    parser.add_argument("--sizes", default=",".join(map(str, MESH_SIZES)),
                        help=f"mesh sizes, comma-separated, from {MESH_SIZES} (default all)")
    parser.add_argument("--runs", type=int, default=None, help=f"runs per system (default {RUNS}; --quick 1)")
    parser.add_argument("--tpcb-txns", type=int, default=None, metavar="N",
                        help=f"TPC-B transactions in the backlog (default {TPCB_TXNS:,};"
                             f" --quick {QUICK_TXNS:,})")
    parser.add_argument("--no-native", action="store_true", help="without native and native3")
    parser.add_argument("--script", action="store_true",
                        help="also pgmesh applying by SQL text at each size (apply_transport = script, the"
                             " before of issue 39), in the same run")
    parser.add_argument("--quick", action="store_true",
                        help="a size check: 2,000 transactions, 1 run, written to a temporary directory")
    parser.add_argument("--out", type=Path, default=None, help=f"output directory (default {OUT})")
    args = parser.parse_args(argv)
    try:
        args.mesh_sizes = [int(n) for n in args.sizes.split(",")]
    except ValueError:
        parser.error("--sizes: comma-separated numbers")
    if any(f"pgmesh{n}" not in SYSTEMS for n in args.mesh_sizes):
        parser.error(f"--sizes: each of {MESH_SIZES}")
    args.runs = args.runs or (1 if args.quick else RUNS)
    args.tpcb_txns = args.tpcb_txns or (QUICK_TXNS if args.quick else TPCB_TXNS)
    if args.runs < 1 or args.tpcb_txns < 1:
        parser.error("--runs and --tpcb-txns must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    if (missing := pgbench_ready()) is not None:
        print(missing, file=sys.stderr)
        return 2
    out: Path = args.out or (Path(tempfile.mkdtemp(prefix="pgmesh-meshsize-")) if args.quick else OUT)
    systems = systems_for(args.mesh_sizes, not args.no_native, args.script)
    sizes = Sizes.for_scale(1.0, tpcb_txns=args.tpcb_txns)
    timeout = WORKLOAD_TIMEOUT_S * max(1.0, args.tpcb_txns / 20_000)
    commit, began = git_commit(), time.perf_counter()
    meter = Meter()
    results: list[Measurement] = []
    failures: list[Failure] = []
    for run in range(args.runs):
        meter.run = run
        for name in systems if run % 2 == 0 else systems[::-1]:
            print(f"run {run}: {name} ({time.perf_counter() - began:.0f} s so far)", file=sys.stderr)
            done, failed = run_once(name, sizes, run, ["tpcb"], timeout, meter.windows)
            results += done
            failures += failed
    rows = summarize(results, meter.readings)
    lines = render(rows)
    command = shlex.join([".venv/bin/python", "-m", "bench.micro.meshsize", *raw])
    doc = {"bench": "meshsize", "command": command,
           "commit": commit, "finished": time.strftime("%Y-%m-%d %H:%M %Z"), "runs": args.runs,
           "wall_s": time.perf_counter() - began, "postgres": machine_facts()["postgres"],
           "systems": systems, "rows": rows, "readings": [r.public() for r in meter.readings.values()],
           "measurements": [asdict(m) for m in results], "failures": [asdict(f) for f in failures]}
    write(out, doc, lines)
    print("\n".join(lines))
    for f in failures:
        print(f"FAILED {f.system} run {f.run}: {f.error}", file=sys.stderr)
    print(f"took {doc['wall_s']:.0f} s; wrote {out / 'meshsize.md'} and meshsize.json", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
