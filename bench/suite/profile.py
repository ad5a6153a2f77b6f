"""Where the CPU goes during each bench workload: every PostgreSQL process, the router, py-spy's stacks.

`python -m bench.suite.profile [--system S ...] [--workload W ...] [--scale S] [--backlog long] [--out
DIR]`: one run per system on fresh nodes (bench.harness.runs.run_once), its workloads in order. Inside each
workload's timed window (bench.harness.workloads.Context.window) it measures the CPU of every PostgreSQL
process of every node (utime + stime of the postmaster's children, read at the window's start, every
TRACK_S and at its end, by process title: walsender, apply worker, pglogical, backend, background; what the
postmaster's cutime + cstime gained beyond the last readings of children that exited is `exited`), the
bench process's (for pgmesh: the router, on uvloop), the wall time and the CPU per unit of the workload;
for pgmesh also `py-spy record` on this process: top functions by self and inclusive samples, and the
collapsed stacks for a flame graph. Files: DIR/<system>-<workload>.txt,
DIR/<system>-<workload>.collapsed.txt[.gz], DIR/README.md.

Owns: the window's measurements, the parsing of py-spy's collapsed stacks and these files. Must not: change
how the suite runs or times a workload (the window only observes), or touch processes it did not start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.runs import SYSTEMS, plan_workloads, run_once
from bench.harness.system import System
from bench.harness.workloads import BACKLOGS, WORKLOAD_TIMEOUT_S, Measurement, Sizes
from bench.harness.workloads import Window as WindowFactory
from bench.suite.report import PRIMARY, git_commit

WORKLOADS = ("tpcb", "bulk", "inserts", "visibility", "lag", "multimaster")
DEFAULT_SYSTEMS = ("pgmesh2", "native")
DEFAULT_WORKLOADS = ("tpcb", "bulk", "inserts", "visibility")
OUT = Path(__file__).resolve().parents[1] / "results" / "profiles"
SPY_RATE = 250
TOP = 30
GZIP_OVER = 1 << 20
CLK = os.sysconf("SC_CLK_TCK")
TRACK_S = 0.25  # how often the window reads the nodes' processes (to place those that exit in it)
LOOP = "Runner.run (asyncio/runners.py)"  # where uvloop runs (bench.harness.nodes.run_async)
# `send (router/apply/applier.py:120)` -> `send (router/apply/applier.py)`: by function
LINE = re.compile(r":\d+\)$")
# What a workload measures per unit: (unit, the Measurement detail that counts them).
UNITS = {"tpcb": ("transaction", "transactions"), "inserts": ("transaction", "transactions"),
         "bulk": ("row", "rows"), "visibility": ("row", "rows"), "lag": ("transaction", "pgbench_tps"),
         "multimaster": ("transaction", "transactions")}
# A process title (without "postgres: ") -> category: the first entry it starts with wins; else backend.
BACKGROUND = ("logical replication launcher", "checkpointer", "background writer", "walwriter", "autovacuum",
              "archiver", "startup", "logger")
CATEGORIES = (("walsender", "walsender"), *((title, "background") for title in BACKGROUND),
              ("logical replication", "apply worker"), ("pglogical apply", "apply worker"),
              ("pglogical", "pglogical"))
CATEGORY_ORDER = ("backend", "walsender", "apply worker", "pglogical", "background", "exited")


# ---------------------------------------------------------------------------------------------------------
# Per-process CPU from /proc


Key = tuple[int, int]  # (pid, start time in ticks after boot): tells a reused pid apart


@dataclass(frozen=True, slots=True)
class Proc:
    ticks: int  # utime + stime
    category: str


@dataclass(slots=True)
class NodeSnapshot:
    own: int = 0  # the postmaster's utime + stime
    reaped: int = 0  # its cutime + cstime: children that exited
    procs: dict[Key, Proc] = field(default_factory=dict)


def stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name: [0] is field 3 (state); [] when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return []


def category(pid: int) -> str:
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "exited"
    title = title.strip().removeprefix("postgres: ")
    return next((cat for prefix, cat in CATEGORIES if title.startswith(prefix)), "backend")


def snapshot(postmaster: int, titles: dict[Key, str]) -> NodeSnapshot:
    """The postmaster and its children (`titles` caches each child's category)."""
    snap = NodeSnapshot()
    if fields := stat_fields(postmaster):
        snap.own, snap.reaped = int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])
    with contextlib.suppress(OSError):
        for pid in map(int, Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split()):
            if fields := stat_fields(pid):
                key = (pid, int(fields[19]))
                if key not in titles:
                    titles[key] = category(pid)
                snap.procs[key] = Proc(int(fields[11]) + int(fields[12]), titles[key])
    return snap


def node_cpu(before: NodeSnapshot, after: NodeSnapshot, seen: dict[Key, Proc]) -> dict[str, float]:
    """CPU seconds by category in the window of one node (the postmaster itself is background). `seen`:
    each child's last reading (the tracker's, then `after`'s), so that a child that exited in the window
    counts in its category up to its last reading; the rest of the postmaster's cutime + cstime growth
    (children that lived between two readings, the last ticks of the others) is `exited`."""
    ticks: dict[str, int] = defaultdict(int)
    ticks["background"] += after.own - before.own
    for key, proc in seen.items():
        ticks[proc.category] += proc.ticks - (before.procs[key].ticks if key in before.procs else 0)
    gone = sum(proc.ticks for key, proc in seen.items() if key not in after.procs)
    ticks["exited"] += max(0, after.reaped - before.reaped - gone)
    return {cat: ticks[cat] / CLK for cat in CATEGORY_ORDER if ticks.get(cat)}


def machine_busy_seconds() -> float:
    """CPU seconds every core spent busy since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / CLK


def proc_seconds(pid: int) -> float:
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / CLK if fields else 0.0


async def track(postmasters: dict[str, int], titles: dict[Key, str], seen: dict[str, dict[Key, Proc]]
                ) -> None:
    """Read every node's children every TRACK_S until cancelled: the last reading of each."""
    while True:
        await asyncio.sleep(TRACK_S)
        for name, pid in postmasters.items():
            seen[name].update(snapshot(pid, titles).procs)


# ---------------------------------------------------------------------------------------------------------
# py-spy


@dataclass(slots=True)
class Stacks:
    total: int = 0
    self_: Counter[str] = field(default_factory=Counter)
    inclusive: Counter[str] = field(default_factory=Counter)


def parse_collapsed(text: str) -> Stacks:
    """py-spy's raw format: one `frame;frame;...;leaf count` line per distinct stack."""
    out = Stacks()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), [LINE.sub(")", f) for f in stack.split(";")]
        out.total += n
        out.self_[frames[-1]] += n
        below_loop = next((i + 1 for i, frame in enumerate(frames) if frame == LOOP), 0)
        for key in set(frames[below_loop:]):  # not the chain every sample passes to reach the loop
            out.inclusive[key] += n
    return out


class Spy:
    """`py-spy record` on this process from start() to stop(); the raw file at `path`."""

    __slots__ = ("cpu_s", "error", "exe", "output", "path", "proc")

    def __init__(self, exe: str, path: Path) -> None:
        self.exe, self.path = exe, path
        self.proc: asyncio.subprocess.Process | None = None
        self.output: asyncio.Task[bytes] | None = None
        self.cpu_s, self.error = 0.0, ""

    async def start(self) -> None:
        for stale in (self.path, self.path.with_name(self.path.name + ".gz")):
            stale.unlink(missing_ok=True)
        self.proc = await asyncio.create_subprocess_exec(
            self.exe, "record", "--pid", str(os.getpid()), "--rate", str(SPY_RATE), "--nonblocking",
            "--format", "raw", "-o", str(self.path), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT)
        assert self.proc.stdout is not None
        first = await asyncio.wait_for(self.proc.stdout.readline(), 15)  # "Sampling process ..." once it runs
        self.output = asyncio.create_task(self.proc.stdout.read())
        if b"Sampling" not in first:
            self.error = first.decode(errors="replace").strip()

    async def stop(self) -> None:
        if self.proc is None:
            return
        self.cpu_s = proc_seconds(self.proc.pid)
        with contextlib.suppress(ProcessLookupError):  # SIGINT: it writes the file and exits
            self.proc.send_signal(signal.SIGINT if self.output else signal.SIGKILL)
        try:
            await asyncio.wait_for(self.proc.wait(), 120)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        rest = (await self.output).decode(errors="replace") if self.output else ""
        if self.proc.returncode != 0 or not self.path.exists():
            self.error = (self.error + " " + rest).strip()[-500:] or f"py-spy exited {self.proc.returncode}"


# ---------------------------------------------------------------------------------------------------------
# The window


@dataclass(slots=True)
class Window:
    system: str
    workload: str
    wall_s: float = 0.0
    bench_cpu_s: float = 0.0
    machine_s: float = 0.0  # busy CPU of the whole machine in the window
    nodes: dict[str, dict[str, float]] = field(default_factory=dict)
    exits: dict[str, Counter[str]] = field(default_factory=dict)  # per node, children seen that exited
    spy: Spy | None = None


class Profiler:
    """Makes each workload's window (`windows` is a bench.harness.workloads.Windows) and keeps what it
    measured."""

    __slots__ = ("done", "out", "spy_exe")

    def __init__(self, out: Path, spy_exe: str | None) -> None:
        self.out, self.spy_exe = out, spy_exe
        self.done: dict[tuple[str, str], Window] = {}

    def windows(self, system: System, workload: str) -> WindowFactory:
        return lambda: self._window(system, workload)

    @contextlib.asynccontextmanager
    async def _window(self, system: System, workload: str) -> AsyncIterator[None]:
        result = self.done[(system.name, workload)] = Window(system.name, workload)
        postmasters = {n.name: int((n.datadir / "postmaster.pid").read_text().split()[0])
                       for n in system.nodes}
        if self.spy_exe and system.name.startswith("pgmesh"):
            result.spy = Spy(self.spy_exe, self.out / f"{system.name}-{workload}.collapsed.txt")
            try:
                await result.spy.start()
            except (OSError, TimeoutError) as exc:
                result.spy.error = f"py-spy did not start: {type(exc).__name__}: {exc}"
        titles: dict[Key, str] = {}
        before = {name: snapshot(pid, titles) for name, pid in postmasters.items()}
        seen = {name: dict(snap.procs) for name, snap in before.items()}
        tracker = asyncio.create_task(track(postmasters, titles, seen))
        cpu, began, busy = time.process_time(), time.perf_counter(), machine_busy_seconds()
        try:
            yield
        finally:
            result.wall_s, result.bench_cpu_s = time.perf_counter() - began, time.process_time() - cpu
            result.machine_s = machine_busy_seconds() - busy
            tracker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tracker
            after = {name: snapshot(pid, titles) for name, pid in postmasters.items()}
            for name, snap in after.items():
                seen[name].update(snap.procs)
            result.nodes = {name: node_cpu(before[name], after[name], seen[name]) for name in postmasters}
            result.exits = {name: Counter(proc.category for key, proc in seen[name].items()
                                          if key not in after[name].procs) for name in postmasters}
            if result.spy is not None:
                await result.spy.stop()


# ---------------------------------------------------------------------------------------------------------
# Report


def units(w: Window, m: Measurement) -> tuple[str, float]:
    unit, detail = UNITS[w.workload]
    count = float(m.details[detail]) * (w.wall_s if w.workload == "lag" else 1.0)  # lag: tx/s over the window
    return unit, count


def node_total(w: Window, name: str) -> float:
    return sum(w.nodes.get(name, {}).values())


def cpu_table(w: Window, unit: str, count: float) -> list[str]:
    lines = [f"{'process':<34} {'CPU s':>9} {f'µs/{unit}':>16} {'% of one core':>14}"]

    def row(label: str, seconds: float) -> None:
        lines.append(f"{label:<34} {seconds:>9.3f} {seconds / count * 1e6 if count else 0:>16.1f}"
                     f" {seconds / w.wall_s * 100 if w.wall_s else 0:>13.1f}%")

    for name, cats in w.nodes.items():
        for cat, seconds in cats.items():
            exited = w.exits.get(name, Counter())[cat]
            row(f"node {name}: {cat}" + (f" ({exited} exited)" if exited else ""), seconds)
        row(f"node {name}: all", node_total(w, name))
    row("bench process" + (" (the router)" if w.system.startswith("pgmesh") else ""), w.bench_cpu_s)
    total = sum(node_total(w, n) for n in w.nodes) + w.bench_cpu_s
    row("total (nodes + bench process)", total)
    if w.spy is not None:
        row("py-spy itself (not in the total)", w.spy.cpu_s)
    row("anything else on the machine", others(w))
    return lines


def others(w: Window) -> float:
    """The machine's busy CPU in the window beyond the nodes, the bench process and py-spy: the bench's
    watcher and pgbench, the kernel's own work, and whatever else ran (then the figures are disturbed)."""
    spy = w.spy.cpu_s if w.spy is not None else 0.0
    return max(0.0, w.machine_s - sum(node_total(w, n) for n in w.nodes) - w.bench_cpu_s - spy)


def spy_section(w: Window) -> list[str]:
    if w.spy is None:
        return []
    if w.spy.error or not w.spy.path.exists():
        return ["", f"py-spy failed: {w.spy.error or 'no output file'}"]
    stacks = parse_collapsed(w.spy.path.read_text())
    kept = w.spy.path
    if kept.stat().st_size > GZIP_OVER:
        kept = kept.with_name(kept.name + ".gz")
        kept.write_bytes(gzip.compress(w.spy.path.read_bytes()))
        w.spy.path.unlink()
    busy = stacks.total / (w.wall_s * SPY_RATE) * 100 if w.wall_s else 0.0
    lines = ["", f"py-spy: {stacks.total:,} samples at {SPY_RATE} Hz over {w.wall_s:.2f} s (non-idle:"
             f" {busy:.0f}% of the window, all threads); stacks: {kept.name} (flamegraph.pl, speedscope).",
             "Self samples in Runner.run (asyncio/runners.py) are uvloop's C code: the loop, socket reads and"
             " writes, callbacks' scheduling."]
    for title, counts in (("self", stacks.self_), ("inclusive (below the event loop)", stacks.inclusive)):
        lines += ["", f"Top {TOP} functions by {title} samples", f"{'%':>6} {'samples':>8}  function (file)"]
        lines += [f"{n / stacks.total * 100:>6.1f} {n:>8}  {key}" for key, n in counts.most_common(TOP)]
    return lines


def describe(header: list[str], w: Window | None, m: Measurement | None, error: str) -> list[str]:
    lines = list(header)
    if m is not None:
        shown = ", ".join(f"{k} {v:,.3f}" for k, v in m.values.items())
        lines.append(f"measured: {shown}")
    if error:
        lines.append(f"FAILED: {error}")
    if w is None:
        return lines
    unit, count = units(w, m) if m is not None else ("unit", 0.0)
    lines += [f"window: {w.wall_s:.3f} s wall; {count:,.0f} {unit}s", "",
              "CPU in the timed window", *cpu_table(w, unit, count)]
    return lines + spy_section(w)


def readme_row(key: tuple[str, str], w: Window | None, m: Measurement | None, names: Sequence[str],
               error: str) -> str:
    if w is None or m is None:
        return f"| {key[0]} | {key[1]} | failed: {error[:300].replace('|', '/')} |"
    unit, count = units(w, m)
    metric = PRIMARY[w.workload]
    cells = []
    for name in names:
        cats = w.nodes.get(name)
        cells.append("" if cats is None else f"**{node_total(w, name):.2f}** ("
                     + ", ".join(f"{c} {s:.2f}" for c, s in cats.items()) + ")")
    total = sum(node_total(w, n) for n in w.nodes) + w.bench_cpu_s
    per = f"{total / count * 1e6:,.1f} µs/{unit}" if count else ""
    return (f"| {w.system} | {w.workload} | {w.wall_s:.2f} | {metric} {m.values[metric]:,.3f}"
            f" | {w.bench_cpu_s:.2f} | " + " | ".join(cells) + f" | {per} | {others(w):.2f} |")


def write_readme(out: Path, command: str, header: list[str], rows: list[str], names: Sequence[str]) -> None:
    lines = [
        "# bench.suite.profile: where the CPU goes in each bench workload", "",
        *[f"- {h}" for h in header], "",
        "CPU seconds inside each workload's timed window (see bench/harness/workloads.py), from"
        " /proc/<pid>/stat of every PostgreSQL process by its title (a child that exits in the window"
        " counts up to its last reading,"
        f" every {TRACK_S} s; `exited` is the rest); `bench CPU s`: the bench process, which for pgmesh is"
        " the router (on uvloop). µs per unit: nodes + bench process over the workload's transactions or"
        " rows. A target's `backend` includes the bench watcher's polling (a query per target every 5 ms)"
        " and, for pgmesh, the router's apply sessions. Per workload:"
        " `<system>-<workload>.txt` (the CPU table and, for pgmesh, py-spy's top functions) and"
        " `<system>-<workload>.collapsed.txt[.gz]` (py-spy's stacks). `other CPU s`: the machine's busy CPU"
        " in the window beyond the nodes, the bench process and py-spy (the watcher, pgbench, the kernel;"
        " a large figure means something else ran and disturbed the measurement).", "",
        f"| system | workload | wall s | metric | bench CPU s | {' | '.join(f'{n} CPU s' for n in names)}"
        " | CPU per unit | other CPU s |", "|---|---|--:|---|--:|" + "---|" * len(names) + "--:|--:|", *rows,
        "",
        f"Reproduce: `{command}` (py-spy needs ptrace: run as root).", ""]
    (out / "README.md").write_text("\n".join(lines))


# ---------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    about = (__doc__ or "").splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m bench.suite.profile", description=about)
    parser.add_argument("--system", action="append", choices=tuple(SYSTEMS),
                        help=f"repeatable ({', '.join(DEFAULT_SYSTEMS)})")
    parser.add_argument("--workload", action="append", choices=WORKLOADS,
                        help=f"repeatable ({', '.join(DEFAULT_WORKLOADS)})")
    parser.add_argument("--scale", type=float, default=1.0, help="workload size factor, as the suite's")
    parser.add_argument("--backlog", choices=tuple(BACKLOGS), default="default",
                        help="backlog sizes, as the suite's (long: 80,000 TPC-B, 400,000 one-row inserts)")
    parser.add_argument("--out", type=Path, default=OUT, help="output directory (bench/results/profiles)")
    parser.add_argument("--no-py-spy", action="store_true", help="only the CPU tables")
    args = parser.parse_args(argv)
    if args.scale <= 0:
        parser.error("--scale must be > 0")
    return args


def profile_system(name: str, workloads: Sequence[str], args: argparse.Namespace, profiler: Profiler,
                   header: list[str], names: Sequence[str]) -> list[str]:
    """One run of one system, each workload's file written; returns its README rows."""
    sizes = Sizes.for_scale(args.scale, backlog=args.backlog)
    limit = WORKLOAD_TIMEOUT_S * max(1.0, args.scale)
    results, failures = run_once(name, sizes, 0, workloads, limit, profiler.windows)
    done = {m.workload: m for m in results}
    errors = {f.workload: f.error for f in failures}
    sizes_of = {line.split(":")[0]: line for line in sizes.describe()}
    rows = []
    for workload in workloads:
        w, m, error = profiler.done.get((name, workload)), done.get(workload), errors.get(workload, "")
        top = [f"# bench.suite.profile: {name}, {workload}", *header, f"workload: {sizes_of[workload]}"]
        (args.out / f"{name}-{workload}.txt").write_text("\n".join(describe(top, w, m, error)) + "\n")
        rows.append(readme_row((name, workload), w, m, names, error))
        print(rows[-1])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    systems = args.system or list(DEFAULT_SYSTEMS)
    workloads = [w for w in WORKLOADS if w in (args.workload or DEFAULT_WORKLOADS)]
    args.out.mkdir(parents=True, exist_ok=True)
    beside = Path(sys.executable).parent / "py-spy"  # the venv's, else one on PATH
    spy_exe = str(beside) if os.access(beside, os.X_OK) else shutil.which("py-spy")
    spy_exe = None if args.no_py_spy else spy_exe
    if spy_exe is None and not args.no_py_spy:
        print("py-spy not found (pip install -e '.[bench]'): CPU tables only, no stacks", file=sys.stderr)
    command = shlex.join([".venv/bin/python", "-m", "bench.suite.profile", *raw])
    header = [f"command: `{command}`", f"commit: {git_commit()}",
              f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
              f"machine: {os.cpu_count()} CPUs; py-spy: {'yes' if spy_exe else 'no'}"]
    planned, not_run = plan_workloads(systems, workloads, include_slow=False)
    for skip in not_run:
        print(f"{skip['system']} {skip['workload']}: not run ({skip['reason']})", file=sys.stderr)
    profiler = Profiler(args.out, spy_exe)
    names = sorted({n for s in systems for n in SYSTEMS[s].node_names}, key=lambda n: (len(n), n))
    rows: list[str] = []
    for name in systems:
        print(f"{name}: {', '.join(planned[name])}", file=sys.stderr)
        rows += profile_system(name, planned[name], args, profiler, header, names)
    sizes = Sizes.for_scale(args.scale, backlog=args.backlog).describe()
    write_readme(args.out, command, header + [f"workload {line}" for line in sizes
                                              if line.split(":")[0] in workloads], rows, names)
    print(f"wrote {args.out / 'README.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
