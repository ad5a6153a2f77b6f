"""Running the router over real nodes in tests, bench and the demo: config, schema, a set-up mesh, a
running router, convergence, and the few process facts those tests read (a free port, peak memory).

Owns: the config text every test cluster uses, `prepare_mesh` (the one set-up: the same schema on every
node, a config, `pgmesh init`) and the `Mesh` it returns, `running_router`, and waiting on conditions.
Must not: start or destroy servers (`router.testing.localnodes` and the test fixtures do), sleep for a
fixed time to let something happen, or be imported by shipped code other than the demo.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import resource
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from router.cluster.install import init_cluster
from router.config.model import Config, parse_config
from router.service.supervisor import Router
from router.testing.compare import fingerprints, same_everywhere

NODE_SETTINGS = {"deadlock_timeout": "100ms", "wal_sender_timeout": "10s"}


def log_directory() -> str:
    """A directory of its own for one cluster's router logs (router.stream.log.store), under one parent that
    goes when the process ends: clusters of one name in several tests must not share their logs."""
    global _LOGS
    if _LOGS is None:
        _LOGS = tempfile.mkdtemp(prefix="pgmesh-test-logs-")
        atexit.register(shutil.rmtree, _LOGS, True)
    return tempfile.mkdtemp(dir=_LOGS)


_LOGS: str | None = None


def config_text(
    nodes: Sequence[Any], cluster: str = "t", replication: str = "", admin_port: int = 0, extra: str = "",
    log_dir: str | None = None,
) -> str:
    """A config's text; the router's logs in `log_dir` (default: a new directory of their own)."""
    lines = [f'[cluster]\nname = "{cluster}"\n']
    for node in nodes:
        lines.append(f'[[nodes]]\nname = "{node.name}"\ndsn = "{node.dsn()}"\n')
    lines.append(f"[replication]\nstatus_interval_ms = 100\n{replication}\n")
    lines.append(f'[admin]\nlisten = "127.0.0.1:{admin_port}"\n')
    directory = f'directory = "{log_dir or log_directory()}"\n'
    if "[log]" not in extra:
        lines.append("[log]\n" + directory)
    elif "directory" not in extra:
        extra = extra.replace("[log]\n", "[log]\n" + directory, 1)
    lines.append(extra)
    return "\n".join(lines)


def make_config(nodes: Sequence[Any], **kw: Any) -> Config:
    return parse_config(config_text(nodes, **kw))


async def execute(dsn: str, *statements: str, params: Any = None) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            await conn.execute(statement, params)


async def fetch(dsn: str, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(query, params)
        return await cur.fetchall()


class Mesh:
    """Nodes set up as one pgmesh cluster (schema, config, init), and spare nodes started beside them.

    `nodes` are the members, in config order; `spares` were started with the same settings but hold
    nothing (a node to join, or to replace one). `config` is made from the options, which are kept: a
    config for other nodes (`config_for`) or a config file (`write_config`) says the same of the cluster.
    """

    __slots__ = ("admin_port", "cluster", "config", "extra", "log_dir", "nodes", "replication", "spares")

    def __init__(
        self,
        nodes: Sequence[Any],
        *,
        spares: Sequence[Any] = (),
        cluster: str = "t",
        replication: str = "",
        admin_port: int = 0,
        extra: str = "",
    ) -> None:
        self.nodes = list(nodes)
        self.spares = list(spares)
        self.cluster = cluster
        self.replication = replication
        self.admin_port = admin_port
        self.extra = extra
        self.log_dir = log_directory()  # one for the mesh: every config of it names the same
        self.config = self.config_for(self.nodes)

    @property
    def all_nodes(self) -> list[Any]:
        """Members, then spares."""
        return [*self.nodes, *self.spares]

    @property
    def dsns(self) -> list[str]:
        return [node.dsn() for node in self.nodes]

    def node(self, name: str) -> Any:
        for node in self.all_nodes:
            if node.name == name:
                return node
        raise KeyError(f"no node {name!r} in this mesh")

    def config_text(self, nodes: Sequence[Any] | None = None) -> str:
        """The config.toml text for `nodes` (default: the members) with this mesh's options."""
        return config_text(
            self.nodes if nodes is None else nodes,
            cluster=self.cluster,
            replication=self.replication,
            admin_port=self.admin_port,
            extra=self.extra,
            log_dir=self.log_dir,
        )

    def config_for(self, nodes: Sequence[Any]) -> Config:
        """This cluster's config over other nodes (after a join, or for a subset)."""
        return parse_config(self.config_text(nodes))

    def write_config(self, path: Path, nodes: Sequence[Any] | None = None, extra: str = "") -> Path:
        """Write the config file the `pgmesh` command line reads; `extra` is appended."""
        path.write_text(self.config_text(nodes) + extra)
        return path


async def prepare_mesh(
    nodes: Sequence[Any],
    schema: str = "",
    *,
    spares: Sequence[Any] = (),
    cluster: str = "t",
    replication: str = "",
    admin_port: int = 0,
    extra: str = "",
    init: bool = True,
) -> Mesh:
    """The same schema on every node, their config, then `pgmesh init` (unless `init` is false)."""
    for node in nodes if schema else ():
        await execute(node.dsn(), schema)
    mesh = Mesh(nodes, spares=spares, cluster=cluster, replication=replication, admin_port=admin_port,
                extra=extra)
    if init:
        report, _ = await init_cluster(mesh.config)
        assert report.ok, report.render()
    return mesh


async def setup_mesh(nodes: Sequence[Any], schema: str, **kw: Any) -> Config:
    """Same schema on every node, then `pgmesh init`: the config."""
    return (await prepare_mesh(nodes, schema, **kw)).config


@contextlib.asynccontextmanager
async def running_router(config: Config, **kw: Any) -> AsyncIterator[Router]:
    router = Router(config, **kw)
    stop = asyncio.Event()
    task = asyncio.create_task(router.run(stop))
    started = asyncio.create_task(router.started.wait())
    done, _ = await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        started.cancel()
        task.result()  # raises the start-up error
    try:
        yield router
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


async def wait_for(check: Callable[[], Awaitable[bool] | bool], what: str, limit: float = 60.0) -> None:
    """Poll a condition (plain or async) until it holds."""
    deadline = time.monotonic() + limit
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit:.0f} s waiting for {what}")
        await asyncio.sleep(0.1)


async def fingerprint(dsn: str, tables: Sequence[str]) -> dict[str, tuple[int, str]]:
    return await fingerprints(dsn, tables)


async def converged(nodes: Sequence[Any], tables: Sequence[str]) -> bool:
    return await same_everywhere([n.dsn() for n in nodes], tables)


async def wait_converged(nodes: Sequence[Any], tables: Sequence[str], limit: float = 120.0) -> None:
    try:
        await wait_for(lambda: converged(nodes, tables), "all nodes to hold identical rows", limit)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{await positions(nodes, tables)}") from None


async def positions(nodes: Sequence[Any], tables: Sequence[str]) -> str:
    """What a convergence timeout reports: each node's row counts, origin progress and slot positions."""
    lines = []
    for node in nodes:
        try:
            prints = await fingerprints(node.dsn(), tables)
            async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
                cur = await conn.execute(
                    "SELECT external_id, remote_lsn::text, local_lsn::text FROM pg_replication_origin_status"
                )
                origins = await cur.fetchall()
                cur = await conn.execute(
                    "SELECT slot_name, active, confirmed_flush_lsn::text FROM pg_replication_slots"
                )
                slots = await cur.fetchall()
                cur = await conn.execute("SELECT pg_current_wal_lsn()::text")
                wal = await cur.fetchone()
                detail = await small_contents(conn, prints)
        except (OSError, psycopg.Error) as exc:
            lines.append(f"node {node.name}: unreadable: {exc}")
            continue
        counts = {t: n for t, (n, _) in prints.items()}
        lines.append(f"node {node.name}: wal {wal}, rows {counts}, origins {origins}, slots {slots}")
        lines.extend(f"  {line}" for line in detail)
    return "\n".join(lines)


async def small_contents(conn: Any, prints: dict[str, tuple[int, str]], most: int = 20) -> list[str]:
    """The rows of each table small enough to print, and the conflict history: what a divergence needs."""
    lines = []
    for table, (count, _) in prints.items():
        if count <= most:
            name = sql.Identifier(*table.split("."))
            try:
                cur = await conn.execute(sql.SQL("SELECT * FROM {} t ORDER BY t::text").format(name))
                lines.append(f"{table}: {await cur.fetchall()}")
            except psycopg.Error as exc:
                lines.append(f"{table}: unreadable: {exc}")
    try:
        cur = await conn.execute("SELECT * FROM pgmesh.conflict_history ORDER BY 1 DESC LIMIT %s", [most])
        lines.extend(f"history: {row}" for row in await cur.fetchall())
    except psycopg.Error:
        pass  # no history table on this node
    return lines


def free_port() -> int:
    """A loopback TCP port nothing listens on right now: an admin listener's, or a node that is down."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def peak_rss_kb() -> int:
    """VmHWM of this process (kB): the peak resident set since the last reset_peak_rss()."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def reset_peak_rss() -> int:
    """Reset VmHWM to the current RSS where the kernel allows it; returns the current peak (kB)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return peak_rss_kb()
