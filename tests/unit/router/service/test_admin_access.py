"""Who may change state through the admin listener, and where it may listen (router.service.admin):
the token over TCP, the Unix socket whose permissions decide, the Origin rule on both, the refusal of
a listener beyond loopback without the token and TLS, and HTTPS with a certificate made here."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from router.config.model import Config, parse_config
from router.errors import ConfigError
from router.service.admin import AdminServer, admin_request, ask_router
from router.service.adminclient import client_tls
from router.service.admintoken import TOKEN_ENV
from tests.unit.router.service.test_admin import HOST, TOKEN, Router, error_of


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (a Unix socket's path is limited to about 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="pgm", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def listener(router: Router, host: str = HOST, **kw: object) -> AdminServer:
    return AdminServer(host, 0, metrics=router.metrics, status=router.status, pause=router.pause,
                       resume=router.resume, health=router.health, **kw)  # type: ignore[arg-type]


async def over_unix(path: Path, data: bytes) -> bytes:
    """Raw bytes over the Unix socket; the whole reply."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


# --- the Unix socket ---------------------------------------------------------------------------------


async def test_a_post_over_the_unix_socket_needs_no_token(short_dir: Path) -> None:
    router = Router()
    path = short_dir / "admin.sock"
    async with listener(router, token=TOKEN, unix=str(path)) as admin:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_ISSOCK(os.stat(path).st_mode)
        assert await admin_request(HOST, 0, "POST", "/pause?target=b", unix=str(path)) == (200,
                                                                                           b'{"pause":"b"}\n')
        assert await admin_request(HOST, 0, "GET", "/healthz", unix=str(path)) == (200, b"ok\n")
        # the same POST over TCP still needs the token
        assert (await admin_request(HOST, admin.port, "POST", "/pause?target=c"))[0] == 401
        assert router.calls == [("pause", "b")]
    assert not path.exists()  # removed at close


async def test_the_unix_socket_still_refuses_a_web_page(short_dir: Path) -> None:
    router = Router()
    path = short_dir / "admin.sock"
    async with listener(router, unix=str(path)):
        reply = await over_unix(path, b"POST /pause HTTP/1.1\r\nHost: x\r\nOrigin: http://evil.example\r\n"
                                      b"Content-Length: 0\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 403")
        assert router.calls == []


async def test_without_a_token_tcp_takes_no_change_but_the_socket_does(short_dir: Path) -> None:
    router = Router()
    path = short_dir / "admin.sock"
    async with listener(router, unix=str(path)) as admin:
        status, body = await admin_request(HOST, admin.port, "POST", "/resume", token="anything")
        assert status == 403 and "Unix socket" in error_of(body)
        assert (await admin_request(HOST, 0, "POST", "/resume", unix=str(path)))[0] == 200
        assert router.calls == [("resume", None)]


async def test_a_stale_socket_is_replaced_and_a_live_one_refused(short_dir: Path) -> None:
    path = short_dir / "admin.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # bound, never listening: what a killed router leaves
    stale.close()
    router = Router()
    async with listener(router, unix=str(path)):
        assert (await admin_request(HOST, 0, "GET", "/healthz", unix=str(path)))[0] == 200
        with pytest.raises(OSError, match="a router already listens there"):
            await listener(Router(), unix=str(path)).start()
        assert (await admin_request(HOST, 0, "GET", "/healthz", unix=str(path)))[0] == 200


async def test_a_file_in_the_sockets_place_is_a_config_error(short_dir: Path) -> None:
    path = short_dir / "admin.sock"
    path.write_text("not a socket")
    with pytest.raises(ConfigError, match=r"admin\.socket: .* is not a socket"):
        await listener(Router(), unix=str(path)).start()
    assert path.read_text() == "not a socket"


# --- where it may listen -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "tls", "missing"),
    [
        (None, None, "the admin token and TLS"),
        (TOKEN, None, "TLS"),
        (None, ("cert.pem", "key.pem"), "the admin token missing"),
    ],
)
async def test_beyond_loopback_needs_the_token_and_tls(
    token: str | None, tls: tuple[str, str] | None, missing: str
) -> None:
    admin = listener(Router(), host="0.0.0.0", token=token, tls=tls)
    with pytest.raises(ConfigError, match=r"^admin\.listen: 0\.0\.0\.0 is not a loopback address") as refused:
        await admin.start()
    assert missing in str(refused.value)
    with pytest.raises(RuntimeError, match="not started"):
        _ = admin.port


def make_certificate(directory: Path) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key (openssl's command line)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )
    return str(cert), str(key)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_with_token_and_tls_it_listens_everywhere_over_https(tmp_path: Path) -> None:
    cert, key = make_certificate(tmp_path)
    router = Router()
    trusted = ssl.create_default_context(cafile=cert)
    async with listener(router, host="0.0.0.0", token=TOKEN, tls=(cert, key)) as admin:
        assert await admin_request(HOST, admin.port, "GET", "/healthz", tls=trusted) == (200, b"ok\n")
        assert (await admin_request(HOST, admin.port, "POST", "/pause", tls=trusted))[0] == 401
        assert await admin_request(HOST, admin.port, "POST", "/pause?target=b", tls=trusted, token=TOKEN) == (
            200, b'{"pause":"b"}\n')
        with pytest.raises(OSError):  # plain HTTP to the HTTPS port gets no HTTP reply
            await admin_request(HOST, admin.port, "GET", "/healthz", timeout=5)
        with pytest.raises(OSError):  # nor does a client that does not trust the certificate
            await admin_request(HOST, admin.port, "GET", "/healthz", tls=ssl.create_default_context())
        # the command line's context (router.service.adminclient): the certificate of [admin] tls_cert
        config = config_with(tmp_path, f'tls_cert = "{cert}"\ntls_key = "{key}"')
        pinned = client_tls(config)
        assert pinned is not None
        assert (await admin_request("0.0.0.0", admin.port, "GET", "/status", tls=pinned))[0] == 200
    assert router.calls == [("pause", "b")]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_a_key_that_is_not_the_certificates_is_a_config_error(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    cert, _ = make_certificate(one)
    _, other_key = make_certificate(two)
    with pytest.raises(ConfigError, match=r"admin\.tls_cert / admin\.tls_key: cannot load"):
        await listener(Router(), token=TOKEN, tls=(cert, other_key)).start()


# --- from the config, and the command line's side ----------------------------------------------------

CONFIG = """
[cluster]
name = "t"
[[nodes]]
name = "a"
dsn = "host=127.0.0.1 port=1 dbname=x"
[[nodes]]
name = "b"
dsn = "host=127.0.0.1 port=2 dbname=x"
[log]
directory = "{directory}"
[admin]
listen = "127.0.0.1:0"
{admin}
"""


def config_with(directory: Path, admin: str) -> Config:
    return parse_config(CONFIG.format(directory=directory, admin=admin))


def for_router(config: Config, router: Router) -> AdminServer:
    return AdminServer.for_router(config, metrics=router.metrics, status=router.status, pause=router.pause,
                                  resume=router.resume, health=router.health)


@pytest.mark.parametrize(
    ("admin", "message"),
    [
        ('tls_cert = "c.pem"', "admin.tls_key: set tls_cert and tls_key together"),
        ('tls_key = "k.pem"', "admin.tls_cert: set tls_cert and tls_key together"),
        ("header_timeout_ms = 10", "admin.header_timeout_ms: must be >= 100"),
    ],
)
def test_the_admin_section_is_checked_at_start(tmp_path: Path, admin: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        for_router(config_with(tmp_path, admin), Router())


async def test_ask_router_goes_through_the_socket_when_it_is_there(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    path = short_dir / "admin.sock"
    config = config_with(short_dir, f'socket = "{path}"\nheader_timeout_ms = 2000')
    router = Router()
    admin = for_router(config, router)
    assert admin.unix == str(path)
    assert await ask_router(config, "GET", "/status") is None  # no router yet
    async with admin:
        # the config names port 0: the command line can only find this listener by its socket
        assert await ask_router(config, "POST", "/pause?target=b") == (200, b'{"pause":"b"}\n')
        status = await ask_router(config, "GET", "/status")
        assert status is not None and msgspec.json.decode(status[1]) == router.status()
    assert router.calls == [("pause", "b")]


def test_client_tls_trusts_the_routers_certificate_alone(tmp_path: Path) -> None:
    assert client_tls(config_with(tmp_path, "")) is None
    with pytest.raises(ConfigError, match=r"admin\.tls_cert: cannot read"):
        client_tls(config_with(tmp_path, f'tls_cert = "{tmp_path / "none.pem"}"\ntls_key = "k"'))
