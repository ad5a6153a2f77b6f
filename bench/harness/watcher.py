"""The watcher: a helper process that polls the targets of a system, and the bench's end of its pipe.

Owns: the process (spawned per system and run, one connection to each data node) and what it answers:
`ready`; `wait` (each target's time its replication origin first moved past a baseline and the time it
showed a marker row); `probe` (a probe row on a every PROBE_INTERVAL_S and each target's lag to see it);
`visibility` (one big transaction ending in a marker, committed on a, then `wait`); `converge` (every
node holding the same rows). And `Watcher`, the bench's end: it sends a request and awaits the answer
without blocking the event loop, checking once a second that the system has not failed meanwhile.

The polling runs in its own process so that it never takes turns on pgmesh's event loop or GIL; its
timestamps are `time.perf_counter()` (CLOCK_MONOTONIC: one clock for every process on Linux). Node 0 is
a; a target is (node index, origin name or '', baseline LSN).

Must not: start, stop or change replication, write anything but its probe, visibility and marker rows on
a, or decide what a figure means (the workloads turn its timestamps into measurements).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import psycopg

from protocol.lsn import parse_lsn

if TYPE_CHECKING:  # the watcher process imports this module: keep the router out of it
    from bench.harness.system import System

POLL_S = 0.005  # markers and convergence
PROBE_POLL_S = 0.001  # lag probes: up to ~1 ms of polling granularity, the same for every system
PROBE_INTERVAL_S = 0.050
PROGRESS_AND_MARKER = (
    "SELECT pg_catalog.pg_replication_origin_progress(%s, false)::text,"
    " EXISTS (SELECT 1 FROM bench_marker WHERE id = %s)"
)
Target = tuple[int, str, int]


def watcher_main(pipe: Connection, dsns: list[str]) -> None:
    """Answer requests from the pipe until "quit" (or the pipe closes)."""
    conns = [psycopg.connect(dsn, autocommit=True) for dsn in dsns]
    handlers = {"ready": lambda _conns: True, "wait": _wait_markers, "probe": _probe_lag,
                "visibility": _big_commit_visibility, "converge": _converge}
    try:
        while True:
            try:
                request = pipe.recv()
            except EOFError:
                return
            kind, args = request[0], request[1:]
            if kind == "quit":
                return
            try:
                handler: Any = handlers[kind]
                answer = handler(conns, *args)
                pipe.send(("ok", answer))
            except Exception as exc:
                pipe.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        for conn in conns:
            conn.close()


def _wait_markers(
    conns: list[psycopg.Connection[Any]], targets: list[Target], marker: int, timeout: float
) -> list[tuple[float, float]]:
    """Poll every target until each has the marker: per target (first time its origin moved, that time)."""
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    deadline = time.perf_counter() + timeout
    while len(done) < len(targets):
        for index, origin, baseline in targets:
            if index in done:
                continue
            if origin:
                row = conns[index].execute(PROGRESS_AND_MARKER, [origin, marker]).fetchone()
            else:
                row = conns[index].execute(
                    "SELECT NULL, EXISTS (SELECT 1 FROM bench_marker WHERE id = %s)", [marker]
                ).fetchone()
            now = time.perf_counter()
            assert row is not None
            if index not in first and row[0] and parse_lsn(row[0]) > baseline:
                first[index] = now
            if row[1]:
                done[index] = now
                first.setdefault(index, now)
        if len(done) < len(targets):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"marker {marker} not on every target within {timeout:.0f} s")
            time.sleep(POLL_S)
    return [(first[i], done[i]) for i, _, _ in targets]


def _probe_lag(
    conns: list[psycopg.Connection[Any]], targets: list[int], start_delay: float, duration: float
) -> list[tuple[float, list[float]]]:
    """A probe row on a every PROBE_INTERVAL_S: (seconds since the first probe, lag to each target)."""
    out: list[tuple[float, list[float]]] = []
    time.sleep(start_delay)
    begin = next_at = time.perf_counter()
    end = next_at + duration
    probe = 0
    while next_at < end:
        pause = next_at - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        probe += 1
        conns[0].execute("INSERT INTO bench_probe (id) VALUES (%s)", [probe])
        committed = time.perf_counter()
        lags: dict[int, float] = {}
        while len(lags) < len(targets):
            for index in targets:
                if index not in lags and conns[index].execute(
                    "SELECT 1 FROM bench_probe WHERE id = %s", [probe]
                ).fetchone() is not None:
                    lags[index] = time.perf_counter() - committed
            if len(lags) < len(targets):
                if time.perf_counter() - committed > 60:
                    raise TimeoutError(f"probe {probe} did not reach every target within 60 s")
                time.sleep(PROBE_POLL_S)
        out.append((committed - begin, [lags[i] for i in targets]))
        next_at = max(next_at + PROBE_INTERVAL_S, time.perf_counter())
    return out


def _big_commit_visibility(
    conns: list[psycopg.Connection[Any]], targets: list[Target], rows: int, marker: int, timeout: float
) -> tuple[float, float, list[tuple[float, float]]]:
    """Commit `rows` rows and, last, the marker in one transaction on a; then wait for the marker.

    Returns (seconds the transaction took on a, commit acknowledged at, per target (first, visible at)).
    """
    a = conns[0]
    began = time.perf_counter()
    with a.transaction():
        a.execute("INSERT INTO bench_vis (id, a, b) SELECT g, g %% 1000, md5(g::text)"
                  " FROM generate_series(1, %s) g", [rows])
        a.execute("INSERT INTO bench_marker (id) VALUES (%s)", [marker])
    committed = time.perf_counter()
    return committed - began, committed, _wait_markers(conns, targets, marker, timeout)


def _converge(
    conns: list[psycopg.Connection[Any]], tables: list[str], timeout: float, interval: float
) -> tuple[float, int]:
    """Poll every node until all hold the same rows in `tables`: (that time, the number of polls).

    Row counts first (cheap); the md5 of every sorted row only once the counts agree, so the polling
    does not take a core away from the replication it waits for.
    """
    counts = " UNION ALL ".join(f"SELECT count(*) FROM {table}" for table in tables)
    prints = " UNION ALL ".join(
        f"SELECT count(*), md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) FROM {table} t"
        for table in tables
    )
    deadline = time.perf_counter() + timeout
    polls = 0
    while True:
        polls += 1
        for query in (counts, prints):
            seen = [conn.execute(query).fetchall() for conn in conns]
            if any(s != seen[0] for s in seen[1:]):
                break
        else:
            return time.perf_counter(), polls
        if time.perf_counter() > deadline:
            raise TimeoutError(f"nodes did not converge within {timeout:.0f} s")
        time.sleep(interval)


class Watcher:
    """The bench's end, bound to one system: start the process, ask it about the system's targets.

    Every request checks the system's health once a second while it waits, so a broken link fails fast
    instead of waiting out its time limit.
    """

    def __init__(self, system: System) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        dsns = [n.dsn() for n in system.data_nodes]
        self._proc = ctx.Process(target=watcher_main, args=(child, dsns), daemon=True)
        self._proc.start()
        child.close()
        self.system = system
        self._index = {n.name: i for i, n in enumerate(system.data_nodes)}

    async def call(self, *request: Any) -> Any:
        """Send one request and await its answer without blocking the loop."""
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

    async def call_checked(self, *request: Any) -> Any:
        """`call`, checking every second that replication has not failed meanwhile."""
        answer = asyncio.ensure_future(self.call(*request))
        try:
            while True:
                done, _ = await asyncio.wait({answer}, timeout=1.0)
                if done:
                    return answer.result()
                await self.system.check()
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

    def _spec(self, baselines: dict[str, int] | None = None) -> list[Target]:
        return [(self._index[t.name], self.system.origins[t.name], (baselines or {}).get(t.name, 0))
                for t in self.system.targets]

    async def wait(self, marker: int, limit: float, baselines: dict[str, int] | None = None
                   ) -> list[tuple[float, float]]:
        """Per target (first time its origin moved past the baseline, time it had the marker)."""
        answer = await self.call_checked("wait", self._spec(baselines), marker, limit)
        return [(float(first), float(done)) for first, done in answer]

    async def probe(self, start_delay: float, duration: float) -> list[tuple[float, list[float]]]:
        """Lag probes from a: (seconds since the first probe, lag to each target in seconds)."""
        targets = [self._index[t.name] for t in self.system.targets]
        answer = await self.call_checked("probe", targets, start_delay, duration)
        return [(float(at), [float(lag) for lag in lags]) for at, lags in answer]

    async def visibility(self, rows: int, marker: int, limit: float
                         ) -> tuple[float, float, list[tuple[float, float]]]:
        """(seconds the big transaction took on a, its commit acknowledged at, per target as in `wait`)."""
        took, committed, links = await self.call_checked("visibility", self._spec(), rows, marker, limit)
        return float(took), float(committed), [(float(f), float(d)) for f, d in links]

    async def converge(self, tables: list[str], limit: float, interval: float) -> tuple[float, int]:
        """(time every data node first held the same rows in `tables`, the number of polls)."""
        at, polls = await self.call_checked("converge", tables, limit, interval)
        return float(at), int(polls)
