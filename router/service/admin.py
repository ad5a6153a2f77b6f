"""The admin listener: a minimal HTTP/1.1 server owned by the router, and the client the CLI uses.

Owns: the admin socket, request parsing under a size limit and a timeout, the routes
(`GET /metrics`, `GET /healthz`, `GET /status`, `POST /pause` and `POST /resume` (`?target=NODE`,
`?source=NODE`: the links into / from a node), and `POST /hold` / `POST /release` for a join while the
router runs) and how callback results and errors become responses; `admin_request`, the matching client,
and `ask_router` (None when no router listens where the config says).
Every POST (what changes state) is refused when it carries an Origin header (a web page's, 403) or lacks
the router's token as `Authorization: Bearer` (401; router.service.admintoken); GETs stay open.

Must not: know how the router pauses a link or what status holds (it calls the callbacks it was given),
keep a connection open after a response (every response says `Connection: close`), let one bad
client stop the listener, or log a token: it listens where it is told, loopback by default, and warns
when that is not loopback.

Callbacks report a problem by raising: `LookupError` (an unknown node) becomes 404, `ValueError` or a
`PgmeshError` becomes 400, anything else 500; each with a JSON body `{"error": "..."}`.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Final, NamedTuple
from urllib.parse import parse_qs, urlsplit

import msgspec

from router.config import Config
from router.errors import PgmeshError
from router.service.admintoken import client_token
from router.service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from router.service.metrics import Metrics

__all__ = ["DEFAULT_HOST", "AdminServer", "admin_request"]

logger = logging.getLogger(__name__)

DEFAULT_HOST: Final = "127.0.0.1"
MAX_HEAD_BYTES: Final = 8192  # request line and headers together
MAX_HEADERS: Final = 64
MAX_BODY_BYTES: Final = 65536  # read and discarded: no route takes a body
MAX_QUERY_FIELDS: Final = 16
MAX_RESPONSE_BYTES: Final = 64 * 1024 * 1024  # what the client accepts
READ_TIMEOUT: Final = 10.0
WRITE_TIMEOUT: Final = 10.0
MAX_CLIENTS: Final = 64

TEXT: Final = "text/plain; charset=utf-8"
JSON: Final = "application/json"
_TOKEN_RE: Final = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_VERSION_RE: Final = re.compile(rb"^HTTP/(\d)\.(\d)$")
_REASONS: Final = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


class _Request(NamedTuple):
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]


class _Response(NamedTuple):
    status: int
    body: bytes
    content_type: str
    allow: str | None = None

    def encode(self) -> bytes:
        lines = [
            f"HTTP/1.1 {self.status} {_REASONS.get(self.status, 'Unknown')}",
            f"Content-Type: {self.content_type}",
            f"Content-Length: {len(self.body)}",
            "Cache-Control: no-store",
            "Connection: close",
        ]
        if self.allow is not None:
            lines.append(f"Allow: {self.allow}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body


class _Reject(Exception):
    """The request cannot be served: answer `status` with `message`, then close."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _ClientGone(Exception):
    """The client closed the connection before sending anything."""


def _json(status: int, value: object) -> _Response:
    return _Response(status, msgspec.json.encode(value) + b"\n", JSON)


def _error(status: int, message: str, *, allow: str | None = None) -> _Response:
    return _Response(status, msgspec.json.encode({"error": message}) + b"\n", JSON, allow)


def _bare_host(host: str) -> str:
    """`[::1]` (as written in `admin.listen`) -> `::1`; an empty host means loopback, never every address."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or DEFAULT_HOST


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# --- reading a request -----------------------------------------------------------------------------


async def _read_head(reader: asyncio.StreamReader) -> list[bytes]:
    """The request line and header lines, without line ends. Accepts CRLF or bare LF."""
    lines: list[bytes] = []
    total = 0
    while True:
        try:
            line = await reader.readline()
        except ValueError as exc:  # a line longer than the stream's limit
            raise _Reject(431, "request line or header too long") from exc
        if not line.endswith(b"\n"):  # end of stream
            if not lines and not line.strip():
                raise _ClientGone
            raise _Reject(400, "incomplete request")
        total += len(line)
        if total > MAX_HEAD_BYTES or len(lines) > MAX_HEADERS:
            raise _Reject(431, "request head too large")
        line = line.rstrip(b"\r\n")
        if line:
            lines.append(line)
        elif lines:  # the empty line that ends the head (empty lines before the request line are skipped)
            return lines


def _parse_request_line(line: bytes) -> tuple[str, str]:
    parts = line.split(b" ")
    if len(parts) != 3 or not _TOKEN_RE.match(parts[0]) or not parts[1].startswith(b"/"):
        raise _Reject(400, "malformed request line")
    version = _VERSION_RE.match(parts[2])
    if version is None:
        raise _Reject(400, "malformed request line")
    if version.group(1) != b"1":
        raise _Reject(505, "only HTTP/1.x is served")
    if any(b < 0x21 or b == 0x7F for b in parts[1]):
        raise _Reject(400, "control characters in the request target")
    return parts[0].decode("ascii"), parts[1].decode("latin-1")


def _parse_headers(lines: list[bytes]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN_RE.match(name):
            raise _Reject(400, "malformed header line")
        key = name.decode("ascii").lower()
        text = value.strip(b" \t").decode("latin-1")
        if key in headers and key in ("content-length", "host") and headers[key] != text:
            raise _Reject(400, f"conflicting {key} headers")
        headers[key] = text
    return headers


async def _discard_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> None:
    """Read and drop a small body, so closing the socket does not reset the reply away."""
    if "transfer-encoding" in headers:
        raise _Reject(501, "transfer-encoding is not supported; send Content-Length")
    length = headers.get("content-length", "0")
    if not length.isdigit():
        raise _Reject(400, "malformed content-length")
    if int(length) > MAX_BODY_BYTES:
        raise _Reject(413, f"request body over {MAX_BODY_BYTES} bytes")
    if int(length):
        try:
            await reader.readexactly(int(length))
        except asyncio.IncompleteReadError as exc:
            raise _Reject(400, "incomplete request body") from exc


async def _read_request(reader: asyncio.StreamReader) -> _Request:
    head = await _read_head(reader)
    method, target = _parse_request_line(head[0])
    headers = _parse_headers(head[1:])
    await _discard_body(reader, headers)
    url = urlsplit(target)
    try:
        query = parse_qs(url.query, keep_blank_values=True, max_num_fields=MAX_QUERY_FIELDS)
    except ValueError as exc:
        raise _Reject(400, f"malformed query string: {exc}") from exc
    return _Request(method, url.path, query, headers)


def _links_of(request: _Request) -> tuple[str | None, str | None]:
    """The `target` and `source` nodes of a pause / resume (the links into the one, from the other); None
    means every one. Anything else is refused, so a typo such as `?node=b` cannot pause the whole
    cluster."""
    unknown = sorted(set(request.query) - {"target", "source"})
    if unknown:
        raise _Reject(400, f"unknown query parameter {unknown[0]!r}; only 'target' and 'source' are accepted")
    found: list[str | None] = []
    for name in ("target", "source"):
        values = request.query.get(name)
        if values is not None and (len(values) != 1 or not values[0]):
            raise _Reject(400, f"give one non-empty {name}, or none for every link")
        found.append(None if values is None else values[0])
    return found[0], found[1]


# --- the server ------------------------------------------------------------------------------------

_Handler = Callable[[_Request], Awaitable[_Response]]


class AdminServer:
    """The admin listener. `start()` binds (port 0 picks a free port, see `.port`); `close()` stops
    listening and drops the connections still open.

    `host` is used as given (`0.0.0.0` listens everywhere, with a warning); an empty host is loopback.
    """

    __slots__ = (
        "_clients",
        "_health",
        "_host",
        "_max_clients",
        "_metrics",
        "_pause",
        "_port",
        "_read_timeout",
        "_resume",
        "_routes",
        "_server",
        "_status",
        "_token",
    )

    def __init__(
        self,
        host: str,
        port: int,
        *,
        metrics: Metrics,
        status: Callable[[], object],
        pause: Callable[[str | None, str | None], Awaitable[object]],  # (target, source)
        resume: Callable[[str | None, str | None], Awaitable[object]],
        health: Callable[[], tuple[bool, str]],
        hold: Callable[[str | None], Awaitable[object]] | None = None,
        release: Callable[[str | None], Awaitable[object]] | None = None,
        read_timeout: float = READ_TIMEOUT,
        max_clients: int = MAX_CLIENTS,
        token: str | None = None,
    ) -> None:
        """`token`: what every POST must carry as `Authorization: Bearer` (None: no check, tests only)."""
        self._token = token
        self._host = _bare_host(host)
        self._port = port
        self._metrics = metrics
        self._status = status
        self._pause = pause
        self._resume = resume
        self._health = health
        self._read_timeout = read_timeout
        self._max_clients = max_clients
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.Task[object]] = set()
        self._routes: dict[str, tuple[str, _Handler]] = {
            "/metrics": ("GET", self._get_metrics),
            "/healthz": ("GET", self._get_healthz),
            "/status": ("GET", self._get_status),
            "/pause": ("POST", self._post_pause),
            "/resume": ("POST", self._post_resume),
        }
        if hold is not None and release is not None:  # a router that can stop streaming for a join
            self._routes["/hold"] = ("POST", _calling(hold, "hold"))
            self._routes["/release"] = ("POST", _calling(release, "release"))

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The port actually listened on (the one the OS picked when given 0; with a name that resolves
        to several addresses and port 0, each socket gets its own port and this is the first one's)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("the admin listener is not started")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("the admin listener is already started")
        try:
            self._server = await asyncio.start_server(
                self._on_client, self._host, self._port, limit=MAX_HEAD_BYTES
            )
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"admin listener cannot listen on {self._host}:{self._port} ({exc.strerror or exc}); "
                "change admin.listen in config.toml or stop what uses that port",
            ) from exc
        logger.info("admin listener on %s:%d", self._host, self.port)
        if not _is_loopback(self._host):
            logger.warning(
                "admin listener on %s is not a loopback address: anyone who can reach it reads status and "
                "metrics (pausing needs the admin token)",
                self._host,
            )

    async def close(self) -> None:
        """Stop listening, cancel the requests in flight and wait for them. Safe to call twice."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        clients = list(self._clients)
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        await server.wait_closed()
        logger.info("admin listener on %s closed", self._host)

    async def __aenter__(self) -> AdminServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: one request, one response, then close. Never raises except cancellation."""
        task = asyncio.current_task()
        if task is None or len(self._clients) >= self._max_clients:
            logger.warning("admin listener: %d connections open, refusing another", len(self._clients))
            writer.transport.abort()
            return
        self._clients.add(task)
        try:
            response = await self._serve(reader)
            if response is not None:
                await _send(writer, response)
            await _close(writer)
        except asyncio.CancelledError:
            writer.transport.abort()
            raise
        except OSError as exc:  # reset, broken pipe, or a client too slow to read its reply
            logger.debug("admin listener: client went away: %r", exc)
            writer.transport.abort()
        except Exception:
            logger.exception("admin listener: unexpected error serving a request")
            writer.transport.abort()
        finally:
            self._clients.discard(task)

    async def _serve(self, reader: asyncio.StreamReader) -> _Response | None:
        try:
            async with asyncio.timeout(self._read_timeout):
                request = await _read_request(reader)
        except TimeoutError:
            return _error(408, f"request not received within {self._read_timeout:g}s")
        except _ClientGone:
            return None
        except _Reject as exc:
            logger.debug("admin listener: refused a request: %s", exc.message)
            return _error(exc.status, exc.message)
        response = await self._dispatch(request)
        logger.debug("admin listener: %s %s -> %d", request.method, request.path, response.status)
        return response

    async def _dispatch(self, request: _Request) -> _Response:
        route = self._routes.get(request.path)
        if route is None:
            return _error(404, f"no such endpoint {request.path!r}")
        method, handler = route
        if request.method != method:
            return _error(405, f"{request.path} takes {method}, not {request.method}", allow=method)
        if method == "POST":
            refused = self._refused(request)
            if refused is not None:
                logger.warning("admin listener: POST %s refused: %s", request.path, refused[1])
                return _error(*refused)
        try:
            return await handler(request)
        except _Reject as exc:
            return _error(exc.status, exc.message)
        except LookupError as exc:
            return _error(404, str(exc.args[0]) if exc.args else repr(exc))
        except (ValueError, PgmeshError) as exc:
            return _error(400, str(exc))
        except Exception as exc:
            logger.exception("admin listener: %s %s failed", request.method, request.path)
            return _error(500, f"{type(exc).__name__}: {exc}")

    def _refused(self, request: _Request) -> tuple[int, str] | None:
        """Why a request that changes state is refused: sent by a web page (it has an Origin: a browser's
        cross-site POST), or without the token (router.service.admintoken). None: it may go on."""
        if "origin" in request.headers:
            return 403, "requests from web pages (with an Origin header) are refused"
        if self._token is None:
            return None
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        matches = hmac.compare_digest(value.strip().encode(), self._token.encode())
        if scheme.lower() != "bearer" or not matches:
            return 401, ("this request changes state and needs the admin token (Authorization: Bearer ...;"
                         " see router/service/admintoken.py: $PGMESH_ADMIN_TOKEN or the token file)")
        return None

    async def _get_metrics(self, request: _Request) -> _Response:
        return _Response(200, self._metrics.render().encode("utf-8"), METRICS_CONTENT_TYPE)

    async def _get_healthz(self, request: _Request) -> _Response:
        try:
            ok, reason = self._health()
        except Exception as exc:
            logger.exception("admin listener: the health check failed")
            ok, reason = False, f"health check failed: {type(exc).__name__}: {exc}"
        if ok:
            return _Response(200, b"ok\n", TEXT)
        return _Response(503, (reason or "unhealthy").encode("utf-8") + b"\n", TEXT)

    async def _get_status(self, request: _Request) -> _Response:
        return _json(200, self._status())

    async def _post_pause(self, request: _Request) -> _Response:
        target, source = _links_of(request)
        logger.info("admin: pause requested for %s", _links_text(target, source))
        return _json(200, await self._pause(target, source))

    async def _post_resume(self, request: _Request) -> _Response:
        target, source = _links_of(request)
        logger.info("admin: resume requested for %s", _links_text(target, source))
        return _json(200, await self._resume(target, source))


def _links_text(target: str | None, source: str | None) -> str:
    if target is None and source is None:
        return "every link"
    return f"links from {source or 'every node'} into {target or 'every node'}"


def _calling(callback: Callable[[str | None], Awaitable[object]], what: str) -> _Handler:
    async def handle(request: _Request) -> _Response:
        logger.info("admin: %s requested", what)
        return _json(200, await callback(None))

    return handle


async def _send(writer: asyncio.StreamWriter, response: _Response) -> None:
    writer.write(response.encode())
    async with asyncio.timeout(WRITE_TIMEOUT):
        await writer.drain()


async def _close(writer: asyncio.StreamWriter) -> None:
    """Close after the reply is flushed; a client that does not read it in time is cut off."""
    writer.close()
    try:
        async with asyncio.timeout(WRITE_TIMEOUT):
            await writer.wait_closed()
    except (OSError, TimeoutError):
        writer.transport.abort()


# --- the client --------------------------------------------------------------------------------------


async def admin_request(
    host: str,
    port: int,
    method: str,
    path: str,
    *,
    timeout: float = 5.0,  # noqa: ASYNC109 - the CLI's one knob, applied with asyncio.timeout below
    token: str | None = None,
) -> tuple[int, bytes]:
    """Send one request to a running router's admin listener: (HTTP status, body).

    Every failure is an `OSError`: `ConnectionRefusedError` when no router listens there, `TimeoutError`
    when it does not answer within `timeout` seconds, a plain `OSError` for a reply that is not HTTP.
    """
    if not _TOKEN_RE.match(method.encode("ascii", "replace")) or not path.startswith("/"):
        raise ValueError(f"bad admin request {method!r} {path!r}")
    if any(c.isspace() or not c.isprintable() for c in path):
        raise ValueError(f"bad admin request path {path!r}")
    bare = _bare_host(host)
    where = f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    request = (f"{method} {path} HTTP/1.1\r\nHost: {where}\r\n{auth}Connection: close\r\n"
               "Content-Length: 0\r\n\r\n")
    try:
        async with asyncio.timeout(timeout):
            raw = await _exchange(bare, port, request.encode("ascii"))
    except TimeoutError as exc:
        raise TimeoutError(f"the admin listener at {where} did not answer within {timeout:g}s") from exc
    except ConnectionRefusedError as exc:
        raise ConnectionRefusedError(
            exc.errno, f"nothing listens on {where}: is the pgmesh router running?"
        ) from exc
    return _parse_response(raw, where)


async def ask_router(config: Config, method: str, path: str, limit: float = 5.0) -> tuple[int, bytes] | None:
    """One request to the running router's admin listener (`[admin] listen`); None when no router listens."""
    host, port = config.admin_host_port
    token = client_token(config) if method == "POST" else None
    try:
        return await admin_request(host, port, method, path, timeout=limit, token=token)
    except OSError:
        return None


async def _exchange(host: str, port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        await writer.drain()
        chunks: list[bytes] = []
        size = 0
        while chunk := await reader.read(65536):
            size += len(chunk)
            if size > MAX_RESPONSE_BYTES:
                raise OSError(f"the admin listener at {host}:{port} sent over {MAX_RESPONSE_BYTES} bytes")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass


def _parse_response(raw: bytes, where: str) -> tuple[int, bytes]:
    head, sep, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = lines[0].split(b" ", 2)
    if not sep or len(status) < 2 or not status[0].startswith(b"HTTP/1.") or not status[1].isdigit():
        raise OSError(f"the admin listener at {where} sent a reply that is not HTTP/1.x")
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip()) if value.strip().isdigit() else -1
            if length < 0 or len(body) < length:
                raise OSError(f"the admin listener at {where} sent a truncated reply")
            body = body[:length]
    return int(status[1]), body
