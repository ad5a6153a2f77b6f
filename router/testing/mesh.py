"""Helpers for tests that run the router over real nodes: config, schema, a running router, convergence."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import psycopg

from router.cluster.catalog import init_cluster
from router.config import Config, parse_config
from router.service.supervisor import Router
from router.testing.compare import fingerprints, same_everywhere

NODE_SETTINGS = {"deadlock_timeout": "100ms", "wal_sender_timeout": "10s"}


def config_text(
    nodes: Sequence[Any], cluster: str = "t", replication: str = "", admin_port: int = 0, extra: str = ""
) -> str:
    lines = [f'[cluster]\nname = "{cluster}"\n']
    for node in nodes:
        lines.append(f'[[nodes]]\nname = "{node.name}"\ndsn = "{node.dsn()}"\n')
    lines.append(f"[replication]\nstatus_interval_ms = 100\n{replication}\n")
    lines.append(f'[admin]\nlisten = "127.0.0.1:{admin_port}"\n')
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


async def setup_mesh(nodes: Sequence[Any], schema: str, **kw: Any) -> Config:
    """Same schema on every node, then `pgmesh init`."""
    for node in nodes:
        await execute(node.dsn(), schema)
    config = make_config(nodes, **kw)
    report, _ = await init_cluster(config)
    assert report.ok, report.render()
    return config


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
    await wait_for(lambda: converged(nodes, tables), "all nodes to hold identical rows", limit)
