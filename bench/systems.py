"""The replication systems `bench.suite` compares, and the helper process that watches their targets.

Owns: one class per system (native, pgmesh2, pgmesh3, pglogical, bucardo), each built on fresh throw-away
nodes and exposing what the suite needs beyond `bench.apply.System`: the nodes to create (`node_names`),
the replicated nodes (`data_nodes`, source `a` first), the targets of a's changes (`targets`), the
replication origin that tracks a on each target (`origins`, '' when the system has none), whether it can
take writes on every node at once (`multimaster`), the workloads it skips (`unsupported`, `slow`), its
conflict count, and `close()`; which workloads each system runs, how a failure is described (with the
nodes' last logged error) and the machine and versions under test. Also the watcher: a helper process
that polls every target (markers, lag probes, a big commit's visibility, convergence) so the polling
never takes turns on pgmesh's event loop or GIL.

Must not: time or report anything (that is `bench.suite`), touch nodes it did not create, or change
`bench.apply`'s behaviour. Every system starts stopped after `setup()`; `start()`/`stop()` switch
replication of a's changes on and off, so a backlog can be generated while it is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import multiprocessing
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, ClassVar

import psycopg

from bench import apply
from bench.apply import EXTRA_SCHEMA, _client_env, checkpoint, execute, fetch
from protocol.lsn import parse_lsn
from router.testing.localnodes import LocalNode, find_pg_bindir
from router.testing.mesh import setup_mesh


def pglogical_installed() -> bool:
    """Whether the server has pglogical (Debian's postgresql-15-pglogical): without it the library
    cannot be preloaded, and the pglogical system is not run."""
    try:
        return (find_pg_bindir().parent / "lib" / "pglogical.so").exists()
    except Exception:
        return False


# Identical server settings for every system's nodes (on top of router.testing.localnodes.DEFAULT_SETTINGS).
SETTINGS: dict[str, str] = {
    **apply.NODE_SETTINGS, **({"shared_preload_libraries": "pglogical"} if pglogical_installed() else {})
}
BUCARDO = "/usr/bin/bucardo"
BUCARDO_SYNC = "s"
STOP_TIMEOUT_S = 60.0
SETTLE_LIMIT_S = 120.0


class SuiteSystem(apply.System):
    """`bench.apply.System` plus the shape the suite needs; `nodes` are all nodes created for it."""

    node_names: tuple[str, ...] = ("a", "b")
    multimaster = False
    # Workloads the suite does not run on this system, with the reason (shown as n/a in the report);
    # `slow` ones run with --include-slow.
    unsupported: ClassVar[dict[str, str]] = {"multimaster": "one-way replication only"}
    slow: ClassVar[dict[str, str]] = {}

    def __init__(self, nodes: Sequence[LocalNode]) -> None:
        super().__init__(nodes[0], nodes[1])
        self.nodes = list(nodes)

    @property
    def data_nodes(self) -> list[LocalNode]:
        return self.nodes

    @property
    def targets(self) -> list[LocalNode]:
        return self.data_nodes[1:]

    @property
    def origins(self) -> dict[str, str]:
        return {t.name: self.origin for t in self.targets}

    def conflicts(self) -> int | None:
        """Conflicts the system detected so far (None when it does not expose them)."""
        return None

    async def settle(self) -> None:
        """Called (stopped) before each workload: housekeeping that the system would do by itself in time.
        Every system gets a VACUUM ANALYZE and then a CHECKPOINT on every node, so that no workload pays
        for the last one's dead rows (autovacuum starting inside a timed window) or dirty pages."""
        for node in self.data_nodes:
            await execute(node.dsn(), "VACUUM ANALYZE")
        await checkpoint(self.data_nodes)

    async def close(self) -> None:
        await self.stop()


class Native(SuiteSystem, apply.Native):
    """CREATE PUBLICATION FOR ALL TABLES on a, CREATE SUBSCRIPTION on b (bench.apply.Native); started and
    stopped with ALTER SUBSCRIPTION ENABLE / DISABLE."""

    name = "native"


class Pgmesh2(SuiteSystem, apply.Pgmesh):
    """A two-node pgmesh mesh a <-> b (bench.apply.Pgmesh): the router runs inside the bench process on
    uvloop (its CPU is `bench_cpu_s` in suite.json); every node's walsender also decodes what pgmesh
    applies there (to filter echoes), on the same cores. Started and stopped by starting and stopping the
    router. Conflicts: those decided on every link."""

    name = "pgmesh2"
    multimaster = True
    unsupported: ClassVar[dict[str, str]] = {}

    async def settle(self) -> None:
        """Also let the router read what the last workload left in every node's WAL: in a full mesh on
        PostgreSQL 15 each node's walsender decodes what pgmesh applied there (to filter the echoes),
        and that work belongs to the workload that caused it, not to the next one (a 300k-row echo
        decoded during the lag window raised its p99 from ~6 ms to ~44 ms). The router runs until every
        slot is confirmed up to each node's WAL position of now (or SETTLE_LIMIT_S passed)."""
        wanted = {n.name: (await fetch(n.dsn(), "SELECT pg_current_wal_lsn()::text"))[0][0]
                  for n in self.data_nodes}
        began = time.monotonic()
        await self.start()
        try:
            deadline = time.monotonic() + SETTLE_LIMIT_S
            while True:
                behind = [n.name for n in self.data_nodes if (await fetch(
                    n.dsn(), "SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'logical'"
                    " AND (confirmed_flush_lsn IS NULL OR confirmed_flush_lsn < %s::pg_lsn)",
                    [wanted[n.name]]))[0][0]]
                if not behind:
                    break
                if time.monotonic() > deadline:
                    print(f"{self.name}: settle: slots on {', '.join(behind)} not caught up after"
                          f" {SETTLE_LIMIT_S:.0f} s; going on", file=sys.stderr)
                    break
                await asyncio.sleep(0.1)
        finally:
            await self.stop()
        print(f"{self.name}: settled in {time.monotonic() - began:.1f} s", file=sys.stderr)
        await super().settle()

    def applied(self) -> dict[str, int]:
        counts = super().applied()
        if self.router is not None:
            counts["conflicts_so_far"] = self.conflicts() or 0
        return counts

    def conflicts(self) -> int | None:
        """Conflicts decided on every link since the router started (None while it is stopped)."""
        if self.router is None:
            return None
        return sum(applier.conflicts for applier in self.router.appliers.values())


class Pgmesh3(Pgmesh2):
    """A three-node pgmesh mesh a, b, c (six links, one router in the bench process); a's changes go to b
    and to c, each link reported on its own."""

    name = "pgmesh3"
    node_names = ("a", "b", "c")

    async def setup(self) -> None:
        self.config = await setup_mesh(self.nodes, EXTRA_SCHEMA, cluster=apply.CLUSTER)
        self.origin = self.config.origin_name(self.a.name)

    def applied(self) -> dict[str, int]:
        if self.router is None:
            return {**self._last, "stuck_shutdowns_so_far": self.stuck_shutdowns}
        counts: dict[str, int] = {"stuck_shutdowns_so_far": self.stuck_shutdowns,
                                  "conflicts_so_far": self.conflicts() or 0}
        for target in self.targets:
            applier = self.router.appliers[(self.a.name, target.name)]
            counts[f"applied_transactions a->{target.name}"] = applier.applied_transactions
            counts[f"applied_rows a->{target.name}"] = applier.applied_rows
        return counts


class Pglogical(SuiteSystem):
    """pglogical 2: provider a, subscriber b, replication set `default` (all public tables), no initial
    copy; started and stopped with pglogical.alter_subscription_enable / disable."""

    name = "pglogical"

    def __init__(self, nodes: Sequence[LocalNode]) -> None:
        super().__init__(nodes)
        self._down = 0

    async def setup(self) -> None:
        for node in (self.a, self.b):
            await execute(node.dsn(), EXTRA_SCHEMA, "CREATE EXTENSION pglogical")
            await execute(node.dsn(), "SELECT pglogical.create_node(%s, %s)", params=[node.name, node.dsn()])
        await execute(self.a.dsn(),
                      "SELECT pglogical.replication_set_add_all_tables('default', ARRAY['public'])")
        await execute(
            self.b.dsn(),
            "SELECT pglogical.create_subscription('s', %s, synchronize_structure := false,"
            " synchronize_data := false, forward_origins := '{}')",
            params=[self.a.dsn()],
        )
        await self._wait_status("replicating")
        rows = await fetch(self.b.dsn(), "SELECT slot_name FROM pglogical.show_subscription_status('s')")
        self.origin = rows[0][0]  # pglogical names the origin on b after the slot on a
        self.running = True
        await self.stop()

    async def _status(self) -> str:
        rows = await fetch(self.b.dsn(), "SELECT status FROM pglogical.show_subscription_status('s')")
        return str(rows[0][0]) if rows else "missing"

    async def _wait_status(self, wanted: str) -> None:
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while (status := await self._status()) != wanted:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"pglogical: the subscription is {status!r}, not {wanted!r}; see {self.b.logfile}"
                )
            await asyncio.sleep(0.05)

    async def start(self) -> None:
        await execute(self.b.dsn(), "SELECT pglogical.alter_subscription_enable('s', true)")
        self.running = True

    async def stop(self) -> None:
        if not self.running:
            return
        self.running = False
        await execute(self.b.dsn(), "SELECT pglogical.alter_subscription_disable('s', true)")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while (await fetch(self.a.dsn(), "SELECT count(*) FROM pg_replication_slots WHERE active"))[0][0]:
            if time.monotonic() > deadline:
                raise RuntimeError("pglogical: the apply worker did not stop within 60 s")
            await asyncio.sleep(0.05)

    async def check(self) -> None:
        """A worker that keeps failing shows 'down' (it restarts in between): three checks in a row."""
        self._down = self._down + 1 if await self._status() == "down" else 0
        if self._down >= 3:
            raise RuntimeError(f"pglogical: the subscription is down; see {self.b.logfile}")


class Bucardo(SuiteSystem):
    """Bucardo 5 with default settings: one sync over every table, a and b both sources, conflict_strategy
    bucardo_latest; its database on a third cluster `ctl` (same settings). Trigger-based: each sync run
    copies the rows' final state (not transaction by transaction), so its tx/s means "transactions made
    on a, replicated per second". Started and stopped by `bucardo resume` / `pause` (the triggers keep
    recording meanwhile); a resume restarts the sync's controller (1-2 s, inside the backlog's time, as
    native's includes starting its apply worker). Before each workload its delta tables are purged and
    vacuumed (`settle`). Conflicts: its "Conflicts for <table>: N" log lines.
    """

    name = "bucardo"
    node_names = ("a", "b", "ctl")
    multimaster = True
    unsupported: ClassVar[dict[str, str]] = {}
    slow: ClassVar[dict[str, str]] = {
        w: "skipped by default for cost: Bucardo moves a 1M-row transaction at ~9k rows/s (2-3 min per"
           " run at scale 1); run with --include-slow"
        for w in ("bulk", "visibility")
    }

    def __init__(self, nodes: Sequence[LocalNode]) -> None:
        super().__init__(nodes)
        self.ctl = nodes[2]
        self.workdir = Path(tempfile.mkdtemp(prefix="pgmesh-bench-bucardo-"))
        self.piddir = self.workdir / "run"
        self.logdir = self.workdir / "log"
        self.piddir.mkdir()
        self.logdir.mkdir()
        self._log_seen = 0
        self._daemon = False

    @property
    def data_nodes(self) -> list[LocalNode]:
        return self.nodes[:2]

    @property
    def logfile(self) -> Path:
        return self.logdir / "log.bucardo"

    async def bucardo(self, *args: str, limit: float = 120.0) -> str:
        """Run the bucardo CLI against the control database; raise with its output on failure.

        Output goes to a file, not a pipe: `bucardo start` leaves a daemon holding its stdout.
        """
        argv = [BUCARDO, "--no-bucardorc", "--quiet", "--dbhost", self.ctl.host,
                "--dbport", str(self.ctl.port), "--dbuser", "bucardo", "--dbname", "bucardo", *args]
        with tempfile.TemporaryFile(dir=self.workdir) as out:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=_client_env(),
                cwd=self.workdir, start_new_session=True,
            )
            try:
                await asyncio.wait_for(proc.wait(), limit)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                raise RuntimeError(f"bucardo {' '.join(args)}: no answer within {limit:.0f} s") from None
            out.seek(0)
            text = out.read().decode(errors="replace")
        if proc.returncode != 0:
            raise RuntimeError(f"bucardo {' '.join(args)} exited {proc.returncode}: {text.strip()[-1500:]}")
        return text

    async def setup(self) -> None:
        if not os.access(BUCARDO, os.X_OK):
            raise RuntimeError(f"{BUCARDO} not found (Debian package `bucardo`)")
        for node in self.data_nodes:
            await execute(node.dsn(), EXTRA_SCHEMA)
        # `install` connects as postgres to create the bucardo role and database; the rest as bucardo.
        await self.bucardo("install", "--batch", "--dbuser", "postgres", "--dbname", "postgres",
                           "--piddir", str(self.piddir))
        for node in self.data_nodes:
            await self.bucardo("add", "db", node.name, f"dbname={node.dbname}", f"host={node.host}",
                               f"port={node.port}", "user=postgres")
        await self.bucardo("add", "all", "tables", f"db={self.a.name}", "relgroup=g")
        dbs = f"dbs={self.a.name}:source,{self.b.name}:source"
        await self.bucardo("add", "sync", BUCARDO_SYNC, "relgroup=g", dbs, "conflict_strategy=bucardo_latest")
        self._daemon = True  # from here on close() stops it, even when `start` itself fails
        await self.bucardo("start", "--piddir", str(self.piddir), "--log-destination", str(self.logdir))
        await self._wait_for_file(self.piddir / f"bucardo.kid.sync.{BUCARDO_SYNC}.pid", present=True)
        self.running = True
        await self.stop()

    async def _wait_for_file(self, path: Path, present: bool) -> None:
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while _exists(path) != present:
            if time.monotonic() > deadline:
                state = "appear" if present else "go away"
                raise RuntimeError(f"bucardo: {path.name} did not {state} within 60 s; see {self.logfile}")
            await asyncio.sleep(0.05)

    async def start(self) -> None:
        await self.bucardo("resume", BUCARDO_SYNC)
        self.running = True

    async def stop(self) -> None:
        if not self.running:
            return
        self.running = False
        await self.bucardo("pause", BUCARDO_SYNC)
        await self._wait_for_file(self.piddir / f"bucardo.ctl.sync.{BUCARDO_SYNC}.pid", present=False)

    async def settle(self) -> None:
        """Purge the delta and track rows every target has, and vacuum them: what Bucardo's VAC process
        does every 30 s for rows older than 45 s. Without it a workload's leftovers (100k delta rows after
        the inserts backlog) slow the next one: every sync run scans them."""
        for node in self.data_nodes:
            await execute(node.dsn(), "SELECT bucardo.bucardo_purge_delta('0 seconds')")
            rows = await fetch(node.dsn(), "SELECT format('%I.%I', schemaname, tablename) FROM pg_tables"
                               " WHERE schemaname = 'bucardo' AND tablename ~ '^(delta|track)_'")
            await execute(node.dsn(), *[f"VACUUM ANALYZE {table}" for (table,) in rows])
        await super().settle()

    def _log_since(self, offset: int) -> tuple[str, int]:
        try:
            with self.logfile.open("rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return "", offset
        return data.decode(errors="replace"), offset + len(data)

    async def check(self) -> None:
        text, self._log_seen = self._log_since(self._log_seen)
        died = re.search(r"Kid has died, error is: (?!Stop sync request)(.*)", text)
        if died:
            raise RuntimeError(f"bucardo: the sync's worker died: {died.group(1)[:500]} (see {self.logfile})")

    def conflicts(self) -> int | None:
        text, _ = self._log_since(0)
        return sum(int(n) for n in re.findall(r"Conflicts for \S+: (\d+)", text))

    def applied(self) -> dict[str, int]:
        return {"conflicts_so_far": self.conflicts() or 0}

    async def close(self) -> None:
        """Pause, stop the daemon (waiting for its processes), and kill whatever is left of it."""
        try:
            await self.stop()
        finally:
            if self._daemon:
                self._daemon = False
                with contextlib.suppress(RuntimeError):
                    await self.bucardo("stop", "--piddir", str(self.piddir), limit=30)
                await self._reap()
            shutil.rmtree(self.workdir, ignore_errors=True)

    async def _reap(self) -> None:
        pids = []
        for pidfile in self.piddir.glob("*.pid"):
            with contextlib.suppress(OSError, ValueError):
                pids.append(int(pidfile.read_text().split()[0]))
        deadline = time.monotonic() + 15
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            await asyncio.sleep(0.1)
        for pid in pids:  # our own daemon's processes, by pid
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)


def _exists(path: Path) -> bool:
    return path.exists()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


SYSTEMS: dict[str, type[SuiteSystem]] = {
    "native": Native,
    "pglogical": Pglogical,
    "bucardo": Bucardo,
    "pgmesh2": Pgmesh2,
    "pgmesh3": Pgmesh3,
}


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


def describe_failure(exc: BaseException, system: SuiteSystem | None) -> str:
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


# ---------------------------------------------------------------------------------------------------------
# The watcher process: polls the targets. Timestamps are time.perf_counter() (CLOCK_MONOTONIC, the same
# clock in every process on Linux). Node 0 is a; a target is (node index, origin name or '', baseline).

POLL_S = apply.POLL_S
PROBE_POLL_S = apply.PROBE_POLL_S
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
                row = conns[index].execute(apply.PROGRESS_AND_MARKER, [origin, marker]).fetchone()
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
        next_at = max(next_at + apply.PROBE_INTERVAL_S, time.perf_counter())
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


class Watcher(apply.Watcher):
    """The parent's end, bound to one system: what to ask its watcher process about its targets.

    `call`, `call_checked` and `close` are bench.apply.Watcher's; every wait checks the system's health
    once a second, so a broken link fails fast instead of waiting out its time limit.
    """

    def __init__(self, system: SuiteSystem) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        me = importlib.import_module("bench.systems")  # picklable by module name
        dsns = [n.dsn() for n in system.data_nodes]
        self._proc = ctx.Process(target=me.watcher_main, args=(child, dsns), daemon=True)
        self._proc.start()
        child.close()
        self.system = system
        self._index = {n.name: i for i, n in enumerate(system.data_nodes)}

    def _spec(self, baselines: dict[str, int] | None = None) -> list[Target]:
        return [(self._index[t.name], self.system.origins[t.name], (baselines or {}).get(t.name, 0))
                for t in self.system.targets]

    async def wait(self, marker: int, limit: float, baselines: dict[str, int] | None = None
                   ) -> list[tuple[float, float]]:
        """Per target (first time its origin moved past the baseline, time it had the marker)."""
        answer = await self.call_checked(self.system, "wait", self._spec(baselines), marker, limit)
        return [(float(first), float(done)) for first, done in answer]

    async def probe(self, start_delay: float, duration: float) -> list[tuple[float, list[float]]]:
        """Lag probes from a: (seconds since the first probe, lag to each target in seconds)."""
        targets = [self._index[t.name] for t in self.system.targets]
        answer = await self.call_checked(self.system, "probe", targets, start_delay, duration)
        return [(float(at), [float(lag) for lag in lags]) for at, lags in answer]

    async def visibility(self, rows: int, marker: int, limit: float
                         ) -> tuple[float, float, list[tuple[float, float]]]:
        """(seconds the big transaction took on a, its commit acknowledged at, per target as in `wait`)."""
        took, committed, links = await self.call_checked(
            self.system, "visibility", self._spec(), rows, marker, limit
        )
        return float(took), float(committed), [(float(f), float(d)) for f, d in links]

    async def converge(self, tables: list[str], limit: float, interval: float) -> tuple[float, int]:
        """(time every data node first held the same rows in `tables`, the number of polls)."""
        at, polls = await self.call_checked(self.system, "converge", tables, limit, interval)
        return float(at), int(polls)


async def origin_positions(system: SuiteSystem) -> dict[str, int]:
    """Each target's replication origin position for a's changes (0 when the system has no origin)."""
    out: dict[str, int] = {}
    for target in system.targets:
        origin = system.origins[target.name]
        rows = await fetch(target.dsn(), "SELECT pg_catalog.pg_replication_origin_progress(%s, false)::text",
                           [origin]) if origin else []
        out[target.name] = parse_lsn(rows[0][0]) if rows and rows[0][0] else 0
    return out
