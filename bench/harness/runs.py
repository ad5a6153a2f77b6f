"""One system, one run: fresh nodes, the system set up on them, its workloads in order, nodes destroyed.

Owns: the systems by name (`SYSTEMS`) and which workloads each runs (`plan_workloads`), `run_once`
(create the nodes, run on a fresh uvloop loop, destroy the nodes whatever happened), the settling before
each workload, the per-workload time limit, and what a failure looks like (`Failure`, with the last
error of each node's server log): a failed workload is recorded and the run goes on with the next one,
after a fresh watcher and replication stopped.

Must not: aggregate or report across runs (`bench.suite`, `bench.micro.apply`), or measure anything
itself (`workloads` and the window a caller passes in).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.harness.bucardo import Bucardo
from bench.harness.delay import DelayLinks
from bench.harness.nodes import SETTINGS, pglogical_installed, run_async
from bench.harness.pgmesh import (
    Pgmesh2,
    Pgmesh2B,
    Pgmesh2Lanes,
    Pgmesh2NoLog,
    Pgmesh2NoLogB,
    Pgmesh2Script,
    Pgmesh3,
    Pgmesh3Script,
    Pgmesh5,
    Pgmesh5Script,
    Pgmesh8,
    Pgmesh8Script,
)
from bench.harness.subscriptions import Native, Native3, Pglogical
from bench.harness.system import System
from bench.harness.watcher import Watcher
from bench.harness.workloads import RUNNERS, Context, Measurement, Sizes, Windows, prepare, write_scripts
from router.testing.localnodes import LocalNode, create_nodes

SYSTEMS: dict[str, type[System]] = {
    "native": Native,
    "native3": Native3,
    "pglogical": Pglogical,
    "bucardo": Bucardo,
    "pgmesh2": Pgmesh2,
    "pgmesh2lanes": Pgmesh2Lanes,
    "pgmesh2script": Pgmesh2Script,
    "pgmesh2nolog": Pgmesh2NoLog,
    "pgmesh2nologb": Pgmesh2NoLogB,
    "pgmesh2b": Pgmesh2B,
    "pgmesh3": Pgmesh3,
    "pgmesh3script": Pgmesh3Script,
    "pgmesh5": Pgmesh5,
    "pgmesh5script": Pgmesh5Script,
    "pgmesh8": Pgmesh8,
    "pgmesh8script": Pgmesh8Script,
}


@dataclass(slots=True)
class Failure:
    system: str
    workload: str
    run: int
    error: str


def plan_workloads(systems: Sequence[str], workloads: Sequence[str], include_slow: bool
                   ) -> tuple[dict[str, list[str]], list[dict[str, str]]]:
    """The workloads each system runs, and the (system, workload, reason) it does not."""
    planned: dict[str, list[str]] = {}
    not_run: list[dict[str, str]] = []
    for name in systems:
        kind = SYSTEMS[name]
        skip = {**kind.unsupported, **({} if include_slow else kind.slow)}
        if name == "pglogical" and not pglogical_installed():
            skip = {w: "postgresql-15-pglogical is not installed" for w in workloads}
        planned[name] = [w for w in workloads if w not in skip]
        not_run += [{"system": name, "workload": w, "reason": skip[w]} for w in workloads if w in skip]
    return planned, not_run


def describe_failure(exc: BaseException, system: System | None) -> str:
    """What went wrong, for the report: the exception and the last error in each node's server log."""
    text = f"{type(exc).__name__}: {exc}".strip()
    if isinstance(exc, TimeoutError) and not str(exc):
        text = "TimeoutError: the workload did not finish within its time limit"
    if system is not None:
        for node in system.nodes:
            errors = [ln for ln in node.log_tail(300).splitlines() if " ERROR: " in ln or " FATAL: " in ln]
            if errors:
                text += f" | last error in {node.name}'s log: {errors[-1][:300]}"
    return text[:1500]


def _show(m: Measurement) -> str:
    shown = ", ".join(f"{k} {v:,.2f}" for k, v in m.values.items())
    return f"run {m.run}: {m.system:<9} {m.workload:<11} {shown}"


async def _recover(system: System, watcher: Watcher) -> tuple[Watcher, str | None]:
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


async def run_system(name: str, nodes: list[LocalNode], sizes: Sizes, run: int, workloads: Sequence[str],
                     scripts: Path, limit: float, windows: Windows | None = None,
                     links: DelayLinks | None = None) -> tuple[list[Measurement], list[Failure]]:
    """Set the system up on `nodes`, run each workload (settled first), close the system. `links`: its
    replication connections go through these delaying proxies."""
    system = SYSTEMS[name](nodes)
    if links is not None:
        system.link_dsn = links.dsn
    try:
        await prepare(system)
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
        await watcher.call("ready")  # the process is up and connected before anything is timed
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


def measure_rtt(rtt_ms: float) -> tuple[float, float]:
    """The round trip to a fresh node directly and through a proxy adding `rtt_ms`, in ms."""
    (node,) = create_nodes(["rtt"], settings=SETTINGS)
    try:
        links = DelayLinks([node], rtt_ms)
        try:
            return links.round_trip_ms(node)
        finally:
            links.close()
    finally:
        node.destroy()


def run_once(name: str, sizes: Sizes, run: int, workloads: Sequence[str], timeout: float,
             windows: Windows | None = None, rtt_ms: float = 0.0) -> tuple[list[Measurement], list[Failure]]:
    """One system, one run: fresh nodes, every workload in order, then the nodes are destroyed.
    `windows(system, workload)`, when given, makes each workload's timed window (Context.window).
    `rtt_ms`: the system's replication connections get that round-trip time (bench.harness.delay)."""
    try:
        nodes = create_nodes(list(SYSTEMS[name].node_names), settings=SETTINGS)
    except Exception as exc:
        error = f"creating nodes: {type(exc).__name__}: {exc}"[:1500]
        return [], [Failure(name, w, run, error) for w in workloads]
    links: DelayLinks | None = None
    try:
        links = DelayLinks(nodes, rtt_ms) if rtt_ms > 0 else None
        with tempfile.TemporaryDirectory(prefix="pgmesh-bench-scripts-") as tmp:
            scripts = write_scripts(Path(tmp))
            return run_async(
                lambda: run_system(name, nodes, sizes, run, workloads, scripts, timeout, windows, links)
            )
    except Exception as exc:  # a bug in the runner itself: keep the other systems going
        traceback.print_exc()
        return [], [Failure(name, w, run, f"runner: {type(exc).__name__}: {exc}"[:1500]) for w in workloads]
    finally:
        if links is not None:
            links.close()
        for node in nodes:
            node.destroy()
