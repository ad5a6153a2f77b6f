"""Bucardo 5 as a bench system: trigger-based multi-source replication between a and b.

Owns: `Bucardo`: installing its control database on a third node `ctl`, one sync over every table with a
and b both sources (conflict_strategy bucardo_latest), pausing and resuming it, the daemon it starts (run
in a private work directory, stopped and reaped by pid at `close()`), purging its delta tables between
workloads, and reading its log for a dead worker and for the conflicts it resolved.

Must not: time or report anything, touch a Bucardo it did not install, or signal processes other than
the ones its own daemon wrote pid files for.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from bench.harness.nodes import EXTRA_SCHEMA, client_env
from bench.harness.system import System
from router.testing.localnodes import LocalNode
from router.testing.mesh import execute, fetch

BUCARDO = "/usr/bin/bucardo"
BUCARDO_SYNC = "s"
STOP_TIMEOUT_S = 60.0


class Bucardo(System):
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
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=client_env(),
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
