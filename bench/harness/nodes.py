"""What every bench does to its throw-away nodes, and the clocks it reads them with.

Owns: the server settings every system's nodes get (`NODE_SETTINGS`; `SETTINGS` adds pglogical's
preload when it is installed, and its output plugin to `output_plugin_libraries` on servers that have
that setting: Debian's 15.19+, 18.6), the bench tables each system creates at setup (`EXTRA_SCHEMA`), running
pgbench from the PostgreSQL bindir without the caller's libpq variables (`client_env`, `pgbench`,
`pgbench_field`), a node's pgbench tables (`pgbench_init`), the marker rows a backlog ends with, a
CHECKPOINT, a node's server CPU from /proc, and the uvloop event loop the router runs on in a bench
(`run_async`).

Must not: start or stop replication (that is each system's class), time a workload (`workloads`), or
touch a node, process or file it was not handed.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from protocol.lsn import parse_lsn
from router.testing.localnodes import LocalNode, find_pg_bindir
from router.testing.mesh import execute, fetch

T = TypeVar("T")

CLUSTER = "bench"
# On top of router.testing.localnodes.DEFAULT_SETTINGS, for every node of every system.
NODE_SETTINGS: dict[str, str] = {
    "shared_buffers": "256MB",
    "max_wal_size": "4GB",
    "checkpoint_timeout": "30min",
    "wal_writer_delay": "10ms",
    # The native launcher starts a subscription's worker at most once per this interval (default 5 s):
    # without it, re-enabling the subscription for the next backlog would add seconds of idle wait.
    "wal_retrieve_retry_interval": "50ms",
}
# Tables every system creates on its data nodes at setup: a backlog's rows, the lag probes, the markers.
EXTRA_SCHEMA = """
CREATE TABLE bench_bulk (id int PRIMARY KEY, a int, b text);
CREATE TABLE bench_probe (id int PRIMARY KEY, sent timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE bench_marker (id int PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp());
"""


def pglogical_installed() -> bool:
    """Whether the server has pglogical (Debian's postgresql-15-pglogical): without it the library
    cannot be preloaded, and the pglogical system is not run."""
    try:
        return (find_pg_bindir().parent / "lib" / "pglogical.so").exists()
    except Exception:
        return False


PGLOGICAL_PLUGIN = "pglogical_output"  # the output plugin pglogical 2's subscriber asks its provider for


def described_default(setting: str) -> str | None:
    """The built-in default of `setting` by the server's `postgres --describe-config` (which runs without
    a data directory, also as root), or None when this server has no such setting or cannot say."""
    try:
        argv = [str(find_pg_bindir() / "postgres"), "--describe-config"]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError, RuntimeError):
        return None
    for line in out.splitlines():
        fields = line.split("\t")
        if fields[0] == setting and len(fields) > 4:
            return fields[4]
    return None


def pglogical_settings() -> dict[str, str]:
    """pglogical's server settings, when it is installed: its preload and, where the server has
    `output_plugin_libraries` (Debian's 15.19+ and 18.6 refuse a plugin not listed there: "library
    \"pglogical_output\" may not be used as an output plugin"), the default list plus its plugin.
    Older minor releases lack the setting (a server refuses to start with an unknown one): none there."""
    if not pglogical_installed():
        return {}
    settings = {"shared_preload_libraries": "pglogical"}
    allowed = described_default("output_plugin_libraries")
    if allowed is not None:
        listed = [name.strip() for name in allowed.split(",") if name.strip()]
        settings["output_plugin_libraries"] = ", ".join(
            listed if PGLOGICAL_PLUGIN in listed else [*listed, PGLOGICAL_PLUGIN]
        )
    return settings


# Identical server settings for every system's nodes in the suite.
SETTINGS: dict[str, str] = {**NODE_SETTINGS, **pglogical_settings()}


def client_env() -> dict[str, str]:
    """Our environment without libpq variables that could send a client program elsewhere."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.setdefault("LC_ALL", "C")
    return env


async def pgbench(*args: str) -> str:
    """Run pgbench (from the PostgreSQL bindir) and return its stdout; raise with its stderr on failure."""
    argv = [str(find_pg_bindir() / "pgbench"), *args]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=client_env()
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"pgbench {args[0]} ... exited {proc.returncode}: {err.decode()[-2000:]}")
    return out.decode()


def pgbench_field(output: str, pattern: str) -> float:
    """One figure from pgbench's report (`pattern` has one group)."""
    match = re.search(pattern, output)
    if match is None:
        raise RuntimeError(f"unexpected pgbench output (no {pattern!r}):\n{output[-2000:]}")
    return float(match.group(1))


def pgbench_txns(output: str) -> int:
    return int(pgbench_field(output, r"number of transactions actually processed: (\d+)"))


def pgbench_tps(output: str) -> float:
    return pgbench_field(output, r"tps = ([\d.]+)")


def pgbench_ready() -> str | None:
    """Why the benches cannot run here (no pgbench in the bindir), or None."""
    if not os.access(find_pg_bindir() / "pgbench", os.X_OK):
        return f"pgbench not found in {find_pg_bindir()}"
    return None


async def pgbench_init(node: LocalNode) -> None:
    """pgbench tables at scale 1 (identical rows on every node) and pgbench_history with a key."""
    await pgbench("-i", "-s", "1", "-q", node.dsn())
    await execute(node.dsn(), "ALTER TABLE pgbench_history ADD COLUMN hid bigserial PRIMARY KEY")


async def add_marker(dsn: str, marker: int) -> None:
    await execute(dsn, "INSERT INTO bench_marker (id) VALUES (%s)", params=[marker])


async def checkpoint(nodes: Sequence[LocalNode]) -> None:
    for node in nodes:
        await execute(node.dsn(), "CHECKPOINT")


async def origin_position(node: LocalNode, origin: str) -> int:
    """Where the replication origin `origin` on `node` stands (0 when it has not moved or is '')."""
    if not origin:
        return 0
    rows = await fetch(node.dsn(), "SELECT pg_catalog.pg_replication_origin_progress(%s, false)::text",
                       [origin])
    return parse_lsn(rows[0][0]) if rows and rows[0][0] else 0


def server_cpu_seconds(node: LocalNode) -> float:
    """CPU seconds used so far by the node's postmaster, its live children and the children it reaped."""
    try:
        postmaster = int((node.datadir / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        if pid == postmaster:
            ticks += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
        elif int(fields[1]) == postmaster:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def run_async(factory: Callable[[], Coroutine[Any, Any, T]], loop: str = "uvloop") -> T:
    """Run one coroutine on a fresh event loop, uvloop by default (the router runs on it, as in
    production; `loop="asyncio"` for the standard one). Loop start-up is outside any timed window."""
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if loop == "uvloop":
        import uvloop

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(factory())
