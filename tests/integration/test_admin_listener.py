"""The admin listener of a running router on real PostgreSQL nodes (issue 23, item 3).

- 100 slowloris clients hold admin connections and dribble headers while a row replicates: /healthz and
  an authenticated POST keep answering, replication is not held up, and the clients are cut off at the
  header timeout;
- the Unix socket of `[admin] socket` (0600) takes a pause without the token, which `pgmesh pause` uses;
  over TCP the same POST without the token is 401;
- /metrics of the running router keeps the names, types and labels the hand-written exposition had.
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from router.config.model import Config
from router.ops.control import cmd_pause, cmd_resume
from router.service.admin import admin_request
from router.testing.mesh import execute, fetch, running_router, wait_for
from tests.fix_mesh import MeshFactory
from tests.unit.router.service.test_metrics import ADDED_SINCE, BEFORE_PROMETHEUS_CLIENT

SCHEMA = "CREATE TABLE items (id int PRIMARY KEY, v text);"
HOST = "127.0.0.1"


def with_admin(config: Config, **settings: Any) -> Config:
    return msgspec.structs.replace(config, admin=msgspec.structs.replace(config.admin, **settings))


async def has(node: Any, key: int) -> bool:
    return bool(await fetch(node.dsn(), "SELECT 1 FROM items WHERE id = %s", [key]))


async def test_slowloris_clients_stall_neither_the_admin_port_nor_replication(
    mesh: MeshFactory, monkeypatch: Any
) -> None:
    monkeypatch.setenv("PGMESH_ADMIN_TOKEN", "integration-token")
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    config = with_admin(m.config, header_timeout_ms=1500)
    async with running_router(config) as router:
        assert router.admin is not None
        port = router.admin.port
        slow: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        for _ in range(100):
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(b"GET /status HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            slow.append((reader, writer))
        ends = [asyncio.create_task(reader.read()) for reader, _ in slow]
        try:
            for _, writer in slow:
                writer.write(b"a")
            await execute(a.dsn(), "INSERT INTO items VALUES (1, 'one')")
            assert await admin_request(HOST, port, "GET", "/healthz", timeout=10) == (200, b"ok\n")
            assert (await admin_request(HOST, port, "POST", "/pause?target=b", timeout=10))[0] == 401
            paused = await admin_request(HOST, port, "POST", "/pause?target=b", timeout=10,
                                         token="integration-token")
            assert paused[0] == 200
            resumed = await admin_request(HOST, port, "POST", "/resume?target=b", timeout=10,
                                          token="integration-token")
            assert resumed[0] == 200
            await wait_for(lambda: has(b, 1), "row 1 on b")
            await wait_for(lambda: all(end.done() for end in ends), "the slow clients cut off", 30)
            assert {end.result() for end in ends} == {b""}
        finally:
            for _, writer in slow:
                writer.close()
            await asyncio.gather(*ends, return_exceptions=True)
        # a 10 MB body, sent while rows replicate: refused, and replication goes on meanwhile
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(b"POST /pause HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer integration-token\r\n"
                     b"Content-Length: 10485760\r\n\r\n")
        sending = asyncio.create_task(_send_body(writer, 10 << 20))
        await execute(a.dsn(), "INSERT INTO items VALUES (2, 'two')")
        await wait_for(lambda: has(b, 2), "row 2 on b")
        answer = await asyncio.wait_for(reader.read(), 30)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:80]
        await asyncio.gather(sending, return_exceptions=True)
        writer.close()
        await execute(a.dsn(), "INSERT INTO items VALUES (3, 'three')")
        await wait_for(lambda: has(b, 3), "row 3 on b")
        assert not router.appliers[("a", "b")].user_paused


async def _send_body(writer: asyncio.StreamWriter, size: int) -> None:
    """`size` bytes, 64 kB at a time, until done or the server closes."""
    chunk = b"x" * 65536
    for _ in range(size // len(chunk)):
        writer.write(chunk)
        await writer.drain()


async def test_the_unix_socket_takes_a_pause_without_the_token(mesh: MeshFactory, monkeypatch: Any) -> None:
    monkeypatch.setenv("PGMESH_ADMIN_TOKEN", "router-token")
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    directory = Path(tempfile.mkdtemp(prefix="pgm", dir="/tmp"))  # a socket's path is short
    socket_path = directory / "admin.sock"
    try:
        config = with_admin(m.config, socket=str(socket_path))
        async with running_router(config) as router:
            assert router.admin is not None
            assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
            # the command line finds the socket in the config and sends no token
            monkeypatch.delenv("PGMESH_ADMIN_TOKEN")
            out = io.StringIO()
            assert await cmd_pause(config, "b", out) == 0
            assert out.getvalue() == "paused: a -> b\n"  # answered by the router, not written to b
            links = router.status
            await wait_for(lambda: any(lk.target == "b" and lk.state == "paused" for lk in links().links),
                           "a -> b paused")
            await execute(a.dsn(), "INSERT INTO items VALUES (1, 'one')")
            status = await admin_request(HOST, router.admin.port, "POST", "/resume?target=b")
            assert status[0] == 401  # over TCP, without the token: refused
            assert not await has(b, 1)
            assert await cmd_resume(config, "b", out) == 0
            assert out.getvalue().endswith("resumed: a -> b\n")
            await wait_for(lambda: has(b, 1), "row 1 on b after the resume")
        assert not socket_path.exists()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def test_the_running_routers_metrics_keep_their_names(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        assert router.admin is not None
        await execute(a.dsn(), "INSERT INTO items VALUES (1, 'one')")
        await wait_for(lambda: has(b, 1), "row 1 on b")
        await wait_for(lambda: 'pgmesh_applied_transactions_total{source="a",target="b"} 1.0'
                       in router.metrics.render(), "the applied transaction in /metrics")
        code, body = await admin_request(HOST, router.admin.port, "GET", "/metrics")
        assert code == 200
        served = {(s.name, f.type, tuple(sorted(s.labels)))
                  for f in text_string_to_metric_families(body.decode()) for s in f.samples}
        every = BEFORE_PROMETHEUS_CLIENT + ADDED_SINCE
        assert served and served <= set(every)  # every series a name it had before, or one added since
        types = {name: kind for name, kind, _ in every}
        helped = [line.split()[2:4] for line in body.decode().splitlines() if line.startswith("# TYPE")]
        assert {name: kind for name, kind in helped} == types  # every family, with its type
        assert "_created" not in body.decode()
