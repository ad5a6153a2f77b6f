"""The admin token (router.service.admintoken) and the listener's checks on requests that change state:
no token, a wrong one, or a web page's Origin header, and the POST is refused; reads stay open."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from router.config.model import Config, parse_config
from router.service.admin import AdminServer, admin_request
from router.service.admintoken import TOKEN_ENV, client_token, router_token, token_path
from router.service.metrics import Metrics
from tests.unit.router.service.test_admin import HOST, Router, raw

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
"""


def config_in(directory: Path) -> Config:
    return parse_config(CONFIG.format(directory=directory))


def test_the_router_makes_a_private_token_the_command_line_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    config = config_in(tmp_path)
    assert client_token(config) is None
    token = router_token(config)
    path = token_path(config)
    assert path == tmp_path / "t" / "admin.token" and len(token) >= 40
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert router_token(config) == token == client_token(config)
    monkeypatch.setenv(TOKEN_ENV, "from-the-environment")
    assert router_token(config) == client_token(config) == "from-the-environment"


async def test_a_post_needs_the_token_and_no_origin_a_get_does_not() -> None:
    router = Router()
    server = AdminServer(HOST, 0, metrics=Metrics(), status=router.status, pause=router.pause,
                         resume=router.resume, health=router.health, token="s3cret")
    async with server as admin:
        status, _ = await admin_request(HOST, admin.port, "POST", "/pause?target=b")
        assert status == 401 and router.calls == []
        assert (await admin_request(HOST, admin.port, "POST", "/pause", token="wrong"))[0] == 401
        reply = await raw(admin.port, b"POST /pause HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
                                      b"Origin: http://evil.example\r\nContent-Length: 0\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 403") and router.calls == []
        assert (await admin_request(HOST, admin.port, "POST", "/pause?target=b", token="s3cret"))[0] == 200
        assert router.calls == [("pause", "b")]
        assert (await admin_request(HOST, admin.port, "GET", "/status"))[0] == 200
        assert (await admin_request(HOST, admin.port, "GET", "/healthz"))[0] in (200, 503)
