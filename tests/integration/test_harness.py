"""Tests of the integration harness itself: local nodes, crash restarts and the TCP proxy.

Owns: proving the fixtures do what later replication tests assume (settings, durability across an
immediate restart, cutting / stalling / restoring a link). Must not: test pgmesh's replication logic,
or sleep for fixed times (every wait polls a condition with a deadline).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from tests.proxy import TcpProxy

logger = logging.getLogger(__name__)

DEADLINE_S = 10.0


def wait_until(condition: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def via_proxy(node: Any, proxy: TcpProxy, **extra: Any) -> str:
    return make_conninfo(node.dsn(), host="127.0.0.1", port=proxy.port, **extra)


def test_two_nodes_start_with_replication_settings(pg_nodes: Callable[..., list[Any]]) -> None:
    a, b = pg_nodes(2)
    assert a.port != b.port
    for node in (a, b):
        with psycopg.connect(node.dsn(), autocommit=True) as conn:
            assert conn.execute("SHOW wal_level").fetchone() == ("logical",)
            assert conn.execute("SHOW track_commit_timestamp").fetchone() == ("on",)
            assert conn.execute("SHOW max_replication_slots").fetchone() == ("64",)
            assert conn.execute("SELECT current_database()").fetchone() == ("app",)
        assert node.sql("SELECT 1, 'x'") == "1|x"


def test_settings_override_and_password(pg_nodes: Callable[..., list[Any]]) -> None:
    (node,) = pg_nodes(1, names=["secret"], settings={"max_wal_senders": "7"}, password="pa ss'w")
    with psycopg.connect(node.dsn(), autocommit=True) as conn:
        assert conn.execute("SHOW max_wal_senders").fetchone() == ("7",)
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(node.dsn(password="wrong"), connect_timeout=5).close()


def test_immediate_restart_keeps_committed_rows(pg_nodes: Callable[..., list[Any]]) -> None:
    (node,) = pg_nodes(1)
    with psycopg.connect(node.dsn()) as conn:
        conn.execute('CREATE TABLE "kept" ("id" int PRIMARY KEY, "v" text)')
        conn.execute("""INSERT INTO "kept" SELECT g, 'row ' || g FROM generate_series(1, 500) g""")
        conn.commit()
    node.restart(mode="immediate")
    assert node.is_running()
    assert "automatic recovery in progress" in node.log_tail(200)
    with psycopg.connect(node.dsn()) as conn:
        assert conn.execute('SELECT count(*), max("v") FROM "kept"').fetchone() == (500, "row 99")


def test_proxy_cut_and_restore(
    pg_nodes: Callable[..., list[Any]], tcp_proxy: Callable[[str, int], TcpProxy]
) -> None:
    (node,) = pg_nodes(1)
    proxy = tcp_proxy(node.host, node.port)
    conn = psycopg.connect(via_proxy(node, proxy), autocommit=True)
    try:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        assert proxy.active == 1
        proxy.cut()
        assert proxy.active == 0
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")
    finally:
        conn.close()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(via_proxy(node, proxy, connect_timeout=5)).close()
    assert proxy.refused >= 1
    proxy.restore()
    with psycopg.connect(via_proxy(node, proxy), autocommit=True) as again:
        assert again.execute("SELECT 2").fetchone() == (2,)
    wait_until(lambda: proxy.active == 0, "the proxy to drop the closed connection")
    assert proxy.accepted >= 3


async def _fetch_one(conn: psycopg.AsyncConnection[Any], query: str) -> Any:
    cur = await conn.execute(query)
    return await cur.fetchone()


async def test_proxy_blackhole_stalls_until_restore(
    pg_nodes: Callable[..., list[Any]], tcp_proxy: Callable[[str, int], TcpProxy]
) -> None:
    (node,) = pg_nodes(1)
    proxy = tcp_proxy(node.host, node.port)
    conn = await psycopg.AsyncConnection.connect(via_proxy(node, proxy), autocommit=True)
    try:
        proxy.blackhole()
        query = asyncio.create_task(_fetch_one(conn, "SELECT 42"))
        done, _ = await asyncio.wait({query}, timeout=1.0)
        assert not done, "a query went through a blackholed link"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(psycopg.AsyncConnection.connect(via_proxy(node, proxy)), timeout=0.5)
        assert proxy.active >= 1
        proxy.restore()
        assert await asyncio.wait_for(query, timeout=DEADLINE_S) == (42,)
        assert await _fetch_one(conn, "SELECT 43") == (43,)
    finally:
        await conn.close()
