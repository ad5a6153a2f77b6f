"""The admin listener over real sockets: routes, callbacks, and clients that misbehave.

Each test starts an `AdminServer` on a free loopback port on the test's own event loop (one test on
uvloop, as the router runs), talks to it with `admin_request` or raw asyncio streams, and checks that
the listener keeps serving afterwards.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import msgspec
import pytest
import uvloop

from router.config.model import parse_config
from router.errors import ConfigError
from router.service.admin import AdminServer, admin_request
from router.service.metrics import Metrics
from router.service.supervisor import Router as Supervisor

HOST = "127.0.0.1"
TOKEN = "t0ken"  # the admin token the test listeners take (router.service.admintoken)


class Router:
    """The callbacks a router gives the admin listener, recording what they were asked."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.healthy: tuple[bool, str] = (True, "")
        self.calls: list[tuple[str | None, ...]] = []
        self.fail_with: Exception | None = None
        self.state: object = {
            "cluster": "demo",
            "links": [{"source": "a", "target": "b", "state": "streaming"}],
        }

    def status(self) -> object:
        return self.state

    def health(self) -> tuple[bool, str]:
        if self.fail_with is not None:
            raise self.fail_with
        return self.healthy

    async def pause(self, target: str | None, source: str | None) -> object:
        return self._record("pause", target, source)

    async def resume(self, target: str | None, source: str | None) -> object:
        return self._record("resume", target, source)

    def _record(self, action: str, target: str | None, source: str | None) -> object:
        if self.fail_with is not None:
            raise self.fail_with
        self.calls.append((action, target) if source is None else (action, target, source))
        return {action: target or "all"}

    def server(self, port: int = 0, *, read_timeout: float = 10.0) -> AdminServer:
        return AdminServer(
            HOST,
            port,
            metrics=self.metrics,
            status=self.status,
            pause=self.pause,
            resume=self.resume,
            health=self.health,
            read_timeout=read_timeout,
            token=TOKEN,
        )


@pytest.fixture
def router() -> Router:
    return Router()


@pytest.fixture
async def admin(router: Router) -> AsyncIterator[AdminServer]:
    server = router.server()
    await server.start()
    try:
        yield server
    finally:
        await server.close()


async def raw(port: int, data: bytes, *, eof: bool = False) -> bytes:
    """Send bytes as they are, then read the whole reply until the server closes."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(data)
        if eof:
            writer.write_eof()
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
        await writer.wait_closed()


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def header(reply: bytes, name: bytes) -> bytes | None:
    head = reply.partition(b"\r\n\r\n")[0]
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.lower() == name.lower():
            return value.strip()
    return None


def error_of(body: bytes) -> str:
    decoded = msgspec.json.decode(body)
    assert isinstance(decoded, dict)
    message = decoded["error"]
    assert isinstance(message, str)
    return message


async def assert_still_serving(admin: AdminServer) -> None:
    assert await admin_request(HOST, admin.port, "GET", "/healthz") == (200, b"ok\n")


async def post(admin: AdminServer, path: str) -> tuple[int, bytes]:
    """A POST with the listener's token, as the command line sends it."""
    return await admin_request(HOST, admin.port, "POST", path, token=TOKEN)


# --- routes ----------------------------------------------------------------------------------------


async def test_metrics_are_served_in_the_text_format(router: Router, admin: AdminServer) -> None:
    router.metrics.applied_transactions_total.labels(source="a", target="b").inc(3)
    router.metrics.set_link_state("a", "b", "streaming")
    status, body = await admin_request(HOST, admin.port, "GET", "/metrics")
    assert status == 200
    assert body.decode() == router.metrics.render()
    assert 'pgmesh_applied_transactions_total{source="a",target="b"} 3.0\n' in body.decode()
    reply = await raw(admin.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert header(reply, b"content-type") == b"text/plain; version=0.0.4; charset=utf-8"
    assert header(reply, b"connection") == b"close"
    assert header(reply, b"content-length") == str(len(body)).encode()


async def test_healthz_reports_both_states(router: Router, admin: AdminServer) -> None:
    assert await admin_request(HOST, admin.port, "GET", "/healthz") == (200, b"ok\n")
    router.healthy = (False, "link a->b is down: node b refused the connection")
    assert await admin_request(HOST, admin.port, "GET", "/healthz") == (
        503,
        b"link a->b is down: node b refused the connection\n",
    )


async def test_healthz_is_503_when_the_check_raises(router: Router, admin: AdminServer) -> None:
    router.fail_with = RuntimeError("state unavailable")
    status, body = await admin_request(HOST, admin.port, "GET", "/healthz")
    assert status == 503
    assert b"state unavailable" in body


async def test_status_is_json(router: Router, admin: AdminServer) -> None:
    status, body = await admin_request(HOST, admin.port, "GET", "/status")
    assert status == 200
    assert msgspec.json.decode(body) == router.status()
    reply = await raw(admin.port, b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")
    assert header(reply, b"content-type") == b"application/json"


async def test_pause_and_resume_call_back_with_the_target(router: Router, admin: AdminServer) -> None:
    assert await post(admin, "/pause?target=b") == (200, b'{"pause":"b"}\n')
    assert await post(admin, "/resume?target=b") == (200, b'{"resume":"b"}\n')
    assert await post(admin, "/pause") == (200, b'{"pause":"all"}\n')
    assert await post(admin, "/resume") == (200, b'{"resume":"all"}\n')
    assert (await post(admin, "/pause?target=node%20c"))[0] == 200
    assert (await post(admin, "/pause?target=b&source=a"))[0] == 200  # the link a -> b
    assert (await post(admin, "/resume?source=a"))[0] == 200  # every link from a
    assert router.calls == [
        ("pause", "b"),
        ("resume", "b"),
        ("pause", None),
        ("resume", None),
        ("pause", "node c"),
        ("pause", "b", "a"),
        ("resume", None, "a"),
    ]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/pause?node=b", "unknown query parameter 'node'"),
        ("/pause?target=", "give one non-empty target"),
        ("/resume?target=a&target=b", "give one non-empty target"),
        ("/pause?source=", "give one non-empty source"),
    ],
)
async def test_a_doubtful_target_pauses_nothing(
    router: Router, admin: AdminServer, path: str, message: str
) -> None:
    status, body = await post(admin, path)
    assert status == 400
    assert message in error_of(body)
    assert router.calls == []


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (LookupError("no node named 'zz'"), 404),
        (KeyError("no node named 'zz'"), 404),
        (ValueError("link a->b is already paused"), 400),
        (RuntimeError("boom"), 500),
    ],
)
async def test_callback_errors_become_replies(
    router: Router, admin: AdminServer, error: Exception, status: int
) -> None:
    router.fail_with = error
    reply_status, body = await post(admin, "/pause?target=zz")
    assert reply_status == status
    assert str(error.args[0]) in error_of(body)
    router.fail_with = None
    await assert_still_serving(admin)


async def test_status_that_cannot_be_encoded_is_500(router: Router, admin: AdminServer) -> None:
    router.state = object()
    status, body = await admin_request(HOST, admin.port, "GET", "/status")
    assert status == 500
    assert error_of(body)
    await assert_still_serving(admin)


@pytest.mark.parametrize("path", ["/", "/metrics/", "/nope", "/status/extra"])
async def test_unknown_paths_are_404(admin: AdminServer, path: str) -> None:
    status, body = await admin_request(HOST, admin.port, "GET", path)
    assert status == 404
    assert "no such endpoint" in error_of(body)


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("POST", "/metrics", b"GET"),
        ("DELETE", "/status", b"GET"),
        ("HEAD", "/healthz", b"GET"),
        ("GET", "/pause", b"POST"),
        ("PUT", "/resume?target=b", b"POST"),
    ],
)
async def test_wrong_methods_are_405(
    router: Router, admin: AdminServer, method: str, path: str, allow: bytes
) -> None:
    reply = await raw(admin.port, f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert status_of(reply) == 405
    assert header(reply, b"allow") == allow
    assert router.calls == []


async def test_query_string_is_ignored_on_get(admin: AdminServer) -> None:
    assert (await admin_request(HOST, admin.port, "GET", "/healthz?verbose=1"))[0] == 200


# --- clients that misbehave --------------------------------------------------------------------------


AUTH = f"Authorization: Bearer {TOKEN}\r\n".encode()


@pytest.mark.parametrize(
    "data",
    [
        b"\x00\xff\x13garbage\r\n\r\n",
        b"GET\r\n\r\n",
        b"GET metrics HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /metrics HTTP/9.9\r\nHost: x\r\n\r\n",
        b"GET /metrics SPDY/3\r\n\r\n",
        b"GET /met\x01rics HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"POST /pause HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Length: -1\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
        b"\r\n\nGET /healthz HTTP/1.0\nHost: x\n\n",  # bare LF: the strict parser takes CRLF only
        b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # a request line over 8190 bytes
        b"GET / HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"y" * 9000 + b"\r\n\r\n",  # a header line too
        b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Filler: yes\r\n" * 1000 + b"\r\n",  # over 64 headers
    ],
)
async def test_malformed_or_oversize_http_is_400_and_the_server_lives_on(
    router: Router, admin: AdminServer, data: bytes
) -> None:
    """What aiohttp's parser refuses: 400 (an HTTP/1.0 reply), then the connection closed (`raw` reads to
    the end), and no callback called."""
    reply = await raw(admin.port, data)
    assert status_of(reply) == 400
    assert router.calls == []
    await assert_still_serving(admin)


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"POST /pause HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Length: 999999999\r\n\r\n", 413),
        (b"POST /pause HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Length: 65537\r\n\r\n", 413),
        (b"POST /pause HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 501),
        (b"GET /status?" + b"a=1&" * 100 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ],
)
async def test_requests_over_the_listeners_bounds_are_refused(
    router: Router, admin: AdminServer, data: bytes, status: int
) -> None:
    reply = await raw(admin.port, data)
    assert status_of(reply) == status
    assert header(reply, b"connection") == b"close"
    assert error_of(reply.partition(b"\r\n\r\n")[2])
    assert router.calls == []
    await assert_still_serving(admin)


async def test_incomplete_request_then_half_close_gets_no_reply(admin: AdminServer) -> None:
    reply = await raw(admin.port, b"GET /metrics HTTP/1.1\r\nHost:", eof=True)
    assert reply == b""
    await assert_still_serving(admin)


async def test_truncated_body_pauses_nothing(router: Router, admin: AdminServer) -> None:
    reply = await raw(admin.port, b"POST /pause HTTP/1.1\r\nHost: x\r\n" + AUTH
                      + b"Content-Length: 10\r\n\r\nabc", eof=True)
    assert reply == b"" or status_of(reply) in (400, 408)
    assert router.calls == []
    await assert_still_serving(admin)


async def test_a_late_body_is_408_and_pauses_nothing(router: Router) -> None:
    async with router.server(read_timeout=0.3) as admin:
        reply = await raw(admin.port, b"POST /pause HTTP/1.1\r\nHost: x\r\n" + AUTH
                          + b"Content-Length: 10\r\n\r\nabc")  # the rest never comes
        assert status_of(reply) == 408
        assert "not received within 0.3s" in error_of(reply.partition(b"\r\n\r\n")[2])
        assert router.calls == []
        await assert_still_serving(admin)


async def test_a_body_is_read_and_ignored(router: Router, admin: AdminServer) -> None:
    reply = await raw(admin.port, b"POST /pause?target=b HTTP/1.1\r\nHost: x\r\n" + AUTH
                      + b"Content-Length: 5\r\n\r\nhello")
    assert status_of(reply) == 200
    assert router.calls == [("pause", "b")]


async def test_http_1_0_without_host_is_served(admin: AdminServer) -> None:
    reply = await raw(admin.port, b"GET /healthz HTTP/1.0\r\n\r\n")
    assert status_of(reply) == 200
    assert reply.endswith(b"\r\n\r\nok\n")


async def test_client_that_connects_and_leaves_is_harmless(admin: AdminServer) -> None:
    for _ in range(5):
        _reader, writer = await asyncio.open_connection(HOST, admin.port)
        writer.close()
        await writer.wait_closed()
    assert await raw(admin.port, b"", eof=True) == b""
    await assert_still_serving(admin)


async def test_client_that_resets_mid_request_is_harmless(admin: AdminServer) -> None:
    _reader, writer = await asyncio.open_connection(HOST, admin.port)
    writer.write(b"GET /metrics HTTP/1.1\r\n")
    await writer.drain()
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    writer.close()  # linger 0: the server sees a reset
    await assert_still_serving(admin)


async def test_silent_client_is_cut_off(router: Router) -> None:
    async with router.server(read_timeout=0.2) as admin:
        reply = await raw(admin.port, b"GET /metrics HTTP/1.1\r\n")  # never finishes its head
        assert reply == b""  # closed at the header timeout, without a reply
        await assert_still_serving(admin)


async def test_many_clients_at_once(admin: AdminServer) -> None:
    replies = await asyncio.gather(*(admin_request(HOST, admin.port, "GET", "/status") for _ in range(40)))
    assert {status for status, _ in replies} == {200}


async def test_close_drops_idle_connections(router: Router) -> None:
    admin = router.server()
    await admin.start()
    reader, writer = await asyncio.open_connection(HOST, admin.port)
    writer.write(b"GET /metrics HTTP/1.1\r\n")  # head never finished
    await writer.drain()
    await assert_still_serving(admin)  # the idle connection has been accepted by now
    await admin.close()
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    await admin.close()  # twice is fine
    with pytest.raises(RuntimeError, match="not started"):
        _ = admin.port


# --- life cycle and the client ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


async def test_port_zero_picks_a_port_and_start_twice_is_refused(admin: AdminServer) -> None:
    assert admin.port > 0
    assert admin.host == HOST
    with pytest.raises(RuntimeError, match="already started"):
        await admin.start()


@pytest.mark.parametrize("host", ["", "[127.0.0.1]", "127.0.0.1"])
async def test_empty_or_bracketed_host_listens_on_loopback(host: str) -> None:
    router = Router()
    server = AdminServer(
        host,
        0,
        metrics=router.metrics,
        status=router.status,
        pause=router.pause,
        resume=router.resume,
        health=router.health,
    )
    async with server:
        assert server.host == HOST
        assert await admin_request(host, server.port, "GET", "/healthz") == (200, b"ok\n")


async def test_port_in_use_is_a_clear_error(router: Router, admin: AdminServer) -> None:
    with pytest.raises(OSError, match=rf"cannot listen on {HOST}:{admin.port}.*admin.listen"):
        await router.server(admin.port).start()


async def test_client_raises_oserror_when_no_router_listens() -> None:
    with pytest.raises(ConnectionRefusedError, match="is the pgmesh router running"):
        await admin_request(HOST, free_port(), "GET", "/status")


async def test_client_raises_oserror_on_a_reply_that_is_not_http() -> None:
    async def babble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(babble, HOST, 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(OSError, match="not HTTP"):
            await admin_request(HOST, port, "GET", "/status")


async def test_client_times_out_as_oserror() -> None:
    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # waits for the client to go away
        writer.close()

    server = await asyncio.start_server(mute, HOST, 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(OSError, match=r"did not answer within 0\.2s"):
            await admin_request(HOST, port, "GET", "/status", timeout=0.2)


@pytest.mark.parametrize(("method", "path"), [("GET", "status"), ("GET", "/a b"), ("G ET", "/status")])
async def test_client_refuses_a_malformed_request(method: str, path: str) -> None:
    with pytest.raises(ValueError, match="bad admin request"):
        await admin_request(HOST, 1, method, path)


def test_serves_on_uvloop(router: Router) -> None:
    async def scenario() -> None:
        async with router.server() as admin:
            assert await post(admin, "/pause?target=b") == (200, b'{"pause":"b"}\n')
            assert status_of(await raw(admin.port, b"\xff\xfe\r\n\r\n")) == 400
            assert await admin_request(HOST, admin.port, "GET", "/metrics") == (
                200,
                router.metrics.render().encode(),
            )

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())
    assert router.calls == [("pause", "b")]


CONFIG = """
[cluster]
name = "demo"
[[nodes]]
name = "a"
dsn = "host=127.0.0.1 port=1 user=u dbname=d"
[[nodes]]
name = "b"
dsn = "host=127.0.0.1 port=1 user=u dbname=d"
"""


@pytest.mark.parametrize("verb", ["pause", "resume"])
async def test_the_router_refuses_a_node_not_in_its_config_with_404(verb: str) -> None:
    """The real router's callbacks (no link built, no node reached): `?target=zz` is 404 with the same
    words the CLI prints for `pgmesh pause --target zz`, never 200 `[]`; a node of the config is not."""
    config = parse_config(CONFIG)
    supervisor = Supervisor(config, admin=False)
    server = AdminServer(HOST, 0, metrics=supervisor.metrics, status=supervisor.status,
                         pause=supervisor.pause, resume=supervisor.resume, health=supervisor.health,
                         token=TOKEN)
    async with server as admin:
        status, body = await post(admin, f"/{verb}?target=zz")
        assert status == 404
        assert (await post(admin, f"/{verb}?source=zz"))[0] == 404
        with pytest.raises(ConfigError) as cli_says:
            config.node("zz")
        assert error_of(body) == str(cli_says.value)
        assert "'zz'" in error_of(body)
        assert await post(admin, f"/{verb}?target=b") == (200, b"[]\n")
        assert (await admin_request(HOST, admin.port, "GET", "/status"))[0] == 200
