"""The command line's side of the admin listener: one request to a running router, over TCP (HTTPS when
`[admin] tls_cert` is set) or over the router's Unix socket (`[admin] socket`), on aiohttp's client.

Owns: `admin_request` (one request, its reply as (status, body), every failure an `OSError`), `ask_router`
(the same from a config; None when no router listens), which way a command reaches the router (the Unix
socket when its file is there: it needs no token; else TCP with the token of router.service.admintoken),
and the TLS context that trusts the router's own certificate.
Must not: serve anything (router.service.admin does), log or print the token, or retry: a command that
gets no answer says so and its caller decides.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import ssl
from pathlib import Path
from typing import Final

import aiohttp
from yarl import URL

from router.config.model import Config
from router.errors import ConfigError
from router.service.admintoken import client_token

__all__ = ["DEFAULT_HOST", "admin_request", "ask_router", "bare_host", "client_tls", "is_loopback"]

DEFAULT_HOST: Final = "127.0.0.1"
MAX_RESPONSE_BYTES: Final = 64 * 1024 * 1024  # what the client accepts
_TOKEN_RE: Final = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


def bare_host(host: str) -> str:
    """`[::1]` (as written in `admin.listen`) -> `::1`; an empty host means loopback, never every address."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or DEFAULT_HOST


def is_loopback(host: str) -> bool:
    """Whether `host` (bare) is a loopback address or `localhost`; any other name counts as not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def client_tls(config: Config) -> ssl.SSLContext | None:
    """The context a command checks the router's HTTPS with: it trusts exactly `[admin] tls_cert`, the
    router's own certificate (self-signed or not), so no host name is checked. None without TLS."""
    cert = config.admin.tls_cert
    if not cert:
        return None
    path = Path(cert).expanduser()
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(path))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"admin.tls_cert: cannot read {path} as a PEM certificate ({exc})") from None
    context.check_hostname = False  # the one certificate trusted is the router's own
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a CA-signed one is trusted as itself
    return context


async def admin_request(
    host: str,
    port: int,
    method: str,
    path: str,
    *,
    timeout: float = 5.0,  # noqa: ASYNC109 - the CLI's one knob, applied with asyncio.timeout below
    token: str | None = None,
    unix: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> tuple[int, bytes]:
    """Send one request to a running router's admin listener: (HTTP status, body).

    `unix`: the router's Unix socket, used instead of host and port (no token needed there). `tls`: speak
    HTTPS, checking the router's certificate with this context (`client_tls`).
    Every failure is an `OSError`: `ConnectionRefusedError` when no router listens there, `TimeoutError`
    when it does not answer within `timeout` seconds, a plain `OSError` for a reply that is not HTTP.
    """
    if not _TOKEN_RE.match(method) or not path.startswith("/"):
        raise ValueError(f"bad admin request {method!r} {path!r}")
    if any(c.isspace() or not c.isprintable() for c in path):
        raise ValueError(f"bad admin request path {path!r}")
    bare = bare_host(host)
    where = unix if unix is not None else (f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}")
    authority = "localhost" if unix is not None else where
    url = URL(f"{'https' if tls else 'http'}://{authority}{path}", encoded=True)
    connector: aiohttp.BaseConnector = (
        aiohttp.UnixConnector(path=unix, force_close=True) if unix is not None
        else aiohttp.TCPConnector(ssl=tls if tls is not None else False, force_close=True)
    )
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with asyncio.timeout(timeout):
            return await _exchange(connector, method, url, headers, where)
    except TimeoutError as exc:
        raise TimeoutError(f"the admin listener at {where} did not answer within {timeout:g}s") from exc
    except aiohttp.ClientConnectorError as exc:
        if isinstance(exc.os_error, ConnectionRefusedError | FileNotFoundError):
            raise ConnectionRefusedError(
                exc.errno, f"nothing listens on {where}: is the pgmesh router running?"
            ) from exc
        raise OSError(exc.errno, f"cannot reach the admin listener at {where}: {exc}") from exc
    except aiohttp.ClientError as exc:
        raise OSError(f"the admin listener at {where} sent a reply that is not HTTP/1.x ({exc})") from exc


async def _exchange(
    connector: aiohttp.BaseConnector, method: str, url: URL, headers: dict[str, str], where: str
) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session,
        session.request(method, url, headers=headers, allow_redirects=False, auto_decompress=False) as reply,
    ):
        chunks: list[bytes] = []
        size = 0
        while chunk := await reply.content.read(65536):
            size += len(chunk)
            if size > MAX_RESPONSE_BYTES:
                raise OSError(f"the admin listener at {where} sent over {MAX_RESPONSE_BYTES} bytes")
            chunks.append(chunk)
        return reply.status, b"".join(chunks)


def _socket_of(config: Config) -> str | None:
    """The router's Unix socket when `[admin] socket` names one that is there (else TCP is used)."""
    if not config.admin.socket:
        return None
    path = Path(config.admin.socket).expanduser()
    return str(path) if path.is_socket() else None


async def ask_router(config: Config, method: str, path: str, limit: float = 5.0) -> tuple[int, bytes] | None:
    """One request to the running router's admin listener (`[admin] socket` when it is there, else
    `[admin] listen`); None when no router listens."""
    host, port = config.admin_host_port
    unix = _socket_of(config)
    token = client_token(config) if method == "POST" and unix is None else None
    tls = client_tls(config) if unix is None else None
    try:
        return await admin_request(host, port, method, path, timeout=limit, token=token, unix=unix, tls=tls)
    except OSError:
        return None
