"""The admin listener: the router's HTTP API on aiohttp's low-level server, inside the router's own loop.

Owns: the routes (`GET /metrics`, `GET /healthz`, `GET /status`, `POST /pause` and `POST /resume`
(`?target=NODE`, `?source=NODE`: the links into / from a node), `POST /skip?source=A&target=B&lsn=X/Y`
(`pgmesh skip`), and `POST /hold` / `POST /release` for a join while the router runs), how callback
results and errors become responses, who may change state, where it listens and the bounds on what a
client may send (docs/admin.md).

Who may change state: every POST is refused when it carries an Origin header (a web page's, 403); over
TCP it needs the router's token as `Authorization: Bearer` (401; router.service.admintoken); over the Unix
socket (`[admin] socket`, made 0600) the file's permissions decided who connected, and no token is asked.
GETs stay open. `listen` beyond loopback is refused at start unless there is a token and TLS
(`[admin] tls_cert`, `tls_key`: HTTPS then).

Bounds: a request line or header over 8190 bytes or 64 headers (aiohttp's parser: 400), a body over
64 KiB (413), a request whose head and body are not in within `[admin] header_timeout_ms` of connecting
(its connection is closed; a body late by then: 408). Each connection carries one request (every
response says `Connection: close`); past `max_clients` open connections the oldest is closed, so slow
or idle clients never make the port unreachable, and a bad client never stops the listener.

Must not: know how the router pauses a link or what status holds (it calls the callbacks it was given),
or log a token. Callbacks report a problem by raising: `LookupError` (an unknown node) becomes 404,
`ValueError` or a `PgmeshError` becomes 400, anything else 500; each with a JSON body `{"error": "..."}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import os
import socket
import ssl
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import msgspec
from aiohttp import web

from router.config.model import Config
from router.errors import ConfigError, PgmeshError
from router.service.adminclient import DEFAULT_HOST, admin_request, ask_router, bare_host, is_loopback
from router.service.admintoken import router_token
from router.service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from router.service.metrics import Metrics

__all__ = ["DEFAULT_HOST", "AdminServer", "admin_request", "ask_router"]

logger = logging.getLogger(__name__)

MAX_LINE_BYTES: Final = 8190  # the request line, and each header line
MAX_HEADERS: Final = 64
MAX_BODY_BYTES: Final = 65536  # read and discarded: no route takes a body
MAX_QUERY_FIELDS: Final = 16
READ_TIMEOUT: Final = 10.0  # seconds from connecting to the whole request ([admin] header_timeout_ms)
MAX_CLIENTS: Final = 256
LINGER: Final = 1.0  # seconds a refused request's unread body is drained before the close
SHUTDOWN_TIMEOUT: Final = 1.0  # seconds requests in flight get at close() before they are cancelled

TEXT: Final = "text/plain; charset=utf-8"
JSON: Final = "application/json"

_Handler = Callable[[web.BaseRequest], Awaitable[web.Response]]
_Links = Callable[[str | None, str | None], Awaitable[object]]  # (target, source)


class _Reject(Exception):
    """The request cannot be served: answer `status` with `message`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _response(status: int, body: bytes, content_type: str, allow: str | None = None) -> web.Response:
    headers = {"Content-Type": content_type, "Cache-Control": "no-store"}
    if allow is not None:
        headers["Allow"] = allow
    return web.Response(status=status, body=body, headers=headers)


def _json(status: int, value: object) -> web.Response:
    return _response(status, msgspec.json.encode(value) + b"\n", JSON)


def _error(status: int, message: str, *, allow: str | None = None) -> web.Response:
    return _response(status, msgspec.json.encode({"error": message}) + b"\n", JSON, allow)


def _links_of(request: web.BaseRequest) -> tuple[str | None, str | None]:
    """The `target` and `source` nodes of a pause / resume (the links into the one, from the other); None
    means every one. Anything else is refused, so a typo such as `?node=b` cannot pause the whole
    cluster."""
    unknown = sorted(set(request.query) - {"target", "source"})
    if unknown:
        raise _Reject(400, f"unknown query parameter {unknown[0]!r}; only 'target' and 'source' are accepted")
    found: list[str | None] = []
    for name in ("target", "source"):
        values = request.query.getall(name, [])
        if name in request.query and (len(values) != 1 or not values[0]):
            raise _Reject(400, f"give one non-empty {name}, or none for every link")
        found.append(values[0] if values else None)
    return found[0], found[1]


def _links_text(target: str | None, source: str | None) -> str:
    if target is None and source is None:
        return "every link"
    return f"links from {source or 'every node'} into {target or 'every node'}"


class _ServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logs each malformed request as an exception with its traceback: here a debug
    line, so a port scanner cannot fill the router's log (the routes log their own faults)."""

    def exception(self, msg: object, *args: object, **kwargs: Any) -> None:
        kwargs.setdefault("exc_info", True)
        self.debug(msg, *args, **kwargs)


class _Server(web.Server):
    """aiohttp's low-level server with two guards of its own. A connection whose request head is not in
    within `header_timeout` seconds of connecting is closed (a slowloris client). Past `max_clients` open
    connections, the oldest still waiting for its head is closed to make room, so slow or idle clients
    never make the port unreachable."""

    def __init__(self, handler: _Handler, *, max_clients: int, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(self._begin, keepalive_timeout=header_timeout, **kwargs)
        self._serve = handler
        self._max_clients = max_clients
        self._header_timeout = header_timeout
        self._waiting: dict[web.RequestHandler, asyncio.TimerHandle] = {}  # no head yet, oldest first
        self._shed = 0

    def connection_made(self, handler: web.RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        for oldest in list(self._waiting)[: max(0, len(self.connections) - self._max_clients)]:
            self._shed += 1
            (logger.warning if self._shed == 1 else logger.debug)(
                "admin listener: over %d connections open, closing the oldest still silent (more quietly)",
                self._max_clients)
            self._expire(oldest)
        loop = asyncio.get_running_loop()
        self._waiting[handler] = loop.call_later(self._header_timeout, self._expire, handler)

    def connection_lost(self, handler: web.RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        timer = self._waiting.pop(handler, None)
        if timer is not None:
            timer.cancel()

    def _expire(self, handler: web.RequestHandler) -> None:
        timer = self._waiting.pop(handler, None)
        if timer is not None:
            timer.cancel()
        handler.force_close()

    async def _begin(self, request: web.BaseRequest) -> web.StreamResponse:
        timer = self._waiting.pop(request.protocol, None)  # its head is in
        if timer is not None:
            timer.cancel()
        return await self._serve(request)


class AdminServer:
    """The admin listener. `start()` binds (port 0 picks a free port, see `.port`); `close()` stops
    listening and drops the connections still open.

    `host` is used as given (an empty host is loopback); beyond loopback, `start()` needs `token` and
    `tls` (a ConfigError names `admin.listen` otherwise). `unix`: a Unix socket to listen on too, made
    0600, whose POSTs need no token. `token` None: POSTs over TCP are refused (the socket still serves).
    """

    __slots__ = (
        "_health",
        "_host",
        "_max_clients",
        "_metrics",
        "_pause",
        "_port",
        "_read_timeout",
        "_resume",
        "_routes",
        "_runners",
        "_skip",
        "_status",
        "_tls",
        "_token",
        "_unix",
        "_unix_inode",
    )

    def __init__(
        self,
        host: str,
        port: int,
        *,
        metrics: Metrics,
        status: Callable[[], object],
        pause: _Links,
        resume: _Links,
        health: Callable[[], tuple[bool, str]],
        hold: Callable[[str | None], Awaitable[object]] | None = None,
        release: Callable[[str | None], Awaitable[object]] | None = None,
        skip: Callable[[str, str, str], Awaitable[object]] | None = None,
        read_timeout: float = READ_TIMEOUT,
        max_clients: int = MAX_CLIENTS,
        token: str | None = None,
        unix: str | None = None,
        tls: tuple[str, str] | None = None,
    ) -> None:
        """`token`: what every POST over TCP must carry as `Authorization: Bearer`. `tls`: the PEM
        certificate and key files to serve HTTPS with. `read_timeout`: seconds a client has, from
        connecting, to send its whole request."""
        self._token = token
        self._host = bare_host(host)
        self._port = port
        self._unix = unix
        self._unix_inode: int | None = None
        self._tls = tls
        self._metrics = metrics
        self._status = status
        self._pause = pause
        self._resume = resume
        self._health = health
        self._read_timeout = read_timeout
        self._max_clients = max_clients
        self._runners: list[web.ServerRunner] = []
        self._routes: dict[str, tuple[str, _Handler]] = {
            "/metrics": ("GET", self._get_metrics),
            "/healthz": ("GET", self._get_healthz),
            "/status": ("GET", self._get_status),
            "/pause": ("POST", self._post_pause),
            "/resume": ("POST", self._post_resume),
        }
        self._skip = skip
        if skip is not None:  # (router.apply.skip)
            self._routes["/skip"] = ("POST", self._post_skip)
        if hold is not None and release is not None:  # a router that can stop streaming for a join
            self._routes["/hold"] = ("POST", _calling(hold, "hold"))
            self._routes["/release"] = ("POST", _calling(release, "release"))

    @classmethod
    def for_router(
        cls,
        config: Config,
        *,
        metrics: Metrics,
        status: Callable[[], object],
        pause: _Links,
        resume: _Links,
        health: Callable[[], tuple[bool, str]],
        hold: Callable[[str | None], Awaitable[object]] | None = None,
        release: Callable[[str | None], Awaitable[object]] | None = None,
        skip: Callable[[str, str, str], Awaitable[object]] | None = None,
    ) -> AdminServer:
        """The listener `[admin]` describes, with the router's token (router.service.admintoken)."""
        section = config.admin
        host, port = config.admin_host_port
        if bool(section.tls_cert) != bool(section.tls_key):
            missing = "admin.tls_key" if section.tls_cert else "admin.tls_cert"
            raise ConfigError(f"{missing}: set tls_cert and tls_key together (HTTPS needs both), or neither")
        if section.header_timeout_ms < 100:
            raise ConfigError("admin.header_timeout_ms: must be >= 100")
        tls = (str(Path(section.tls_cert).expanduser()), str(Path(section.tls_key).expanduser()))
        return cls(
            host, port, metrics=metrics, status=status, pause=pause, resume=resume, health=health,
            hold=hold, release=release, skip=skip, token=router_token(config),
            unix=str(Path(section.socket).expanduser()) if section.socket else None,
            tls=tls if section.tls_cert else None, read_timeout=section.header_timeout_ms / 1000,
        )

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The TCP port actually listened on (the one the OS picked when given 0; with a name that
        resolves to several addresses and port 0, each socket gets its own port and this is the first)."""
        if not self._runners or not self._runners[0].addresses:
            raise RuntimeError("the admin listener is not started")
        port: int = self._runners[0].addresses[0][1]
        return port

    @property
    def unix(self) -> str | None:
        """The Unix socket's path, if there is one."""
        return self._unix

    async def start(self) -> None:
        if self._runners:
            raise RuntimeError("the admin listener is already started")
        context = self._server_tls()
        runner = await self._runner(trusted=False)
        self._runners.append(runner)
        try:
            try:
                await web.TCPSite(runner, self._host, self._port, ssl_context=context).start()
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"admin listener cannot listen on {self._host}:{self._port} ({exc.strerror or exc}); "
                    "change admin.listen in config.toml or stop what uses that port",
                ) from exc
            if self._unix is not None:
                await self._start_unix(self._unix)
        except BaseException:
            await self.close()
            raise
        scheme = "https" if context is not None else "http"
        logger.info("admin listener on %s://%s:%d%s", scheme, self._host, self.port,
                    f" and on the Unix socket {self._unix}" if self._unix else "")
        if not is_loopback(self._host):
            logger.warning("admin listener on %s is not a loopback address: anyone who can reach it reads "
                           "status and metrics (changes need the admin token, over TLS)", self._host)

    def _server_tls(self) -> ssl.SSLContext | None:
        """The HTTPS context, after the rule that a listener beyond loopback has a token and TLS."""
        if not is_loopback(self._host) and (self._token is None or self._tls is None):
            missing = " and ".join(
                what for what, there in (("the admin token", self._token), ("TLS ([admin] tls_cert and "
                                         "tls_key)", self._tls)) if there is None
            )
            raise ConfigError(
                f"admin.listen: {self._host} is not a loopback address, and listening there needs the admin "
                f"token and TLS; {missing} missing. Listen on 127.0.0.1 (and use [admin] socket on this "
                "host), or set tls_cert and tls_key"
            )
        if self._tls is None:
            return None
        cert, key = self._tls
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"admin.tls_cert / admin.tls_key: cannot load {cert} with {key} as a PEM certificate and its "
                f"key ({exc})"
            ) from None
        return context

    async def _runner(self, *, trusted: bool) -> web.ServerRunner:
        server = _Server(
            self._handler(trusted), max_clients=self._max_clients, header_timeout=self._read_timeout,
            max_line_size=MAX_LINE_BYTES, max_field_size=MAX_LINE_BYTES, max_headers=MAX_HEADERS,
            lingering_time=LINGER, access_log=None, logger=_ServerLog(logger, {}),
        )
        runner = web.ServerRunner(server, shutdown_timeout=SHUTDOWN_TIMEOUT)
        await runner.setup()
        return runner

    async def _start_unix(self, path: str) -> None:
        """Listen on the Unix socket `path`, made 0600 (a stale one left by a dead router is replaced)."""
        await _clear_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(OSError):  # Linux: the file is then created 0600 (less the umask)
                os.fchmod(sock.fileno(), 0o600)
            sock.bind(path)
            os.chmod(path, 0o600)
            self._unix_inode = os.stat(path).st_ino
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"admin listener cannot listen on the Unix socket {path} "
                                     f"({exc.strerror or exc}); change admin.socket in config.toml") from exc
        runner = await self._runner(trusted=True)
        self._runners.append(runner)
        await web.SockSite(runner, sock).start()

    async def close(self) -> None:
        """Stop listening, end the requests in flight and drop idle connections. Safe to call twice."""
        runners, self._runners = self._runners, []
        for runner in reversed(runners):
            await runner.cleanup()
        if self._unix is not None and self._unix_inode is not None:
            with contextlib.suppress(OSError):
                if os.stat(self._unix).st_ino == self._unix_inode:  # still ours
                    os.unlink(self._unix)
            self._unix_inode = None
        if runners:
            logger.info("admin listener on %s closed", self._host)

    async def __aenter__(self) -> AdminServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _handler(self, trusted: bool) -> _Handler:
        """Serve one request; `trusted`: it came over the Unix socket."""

        async def handle(request: web.BaseRequest) -> web.Response:
            response = await self._dispatch(request, trusted)
            response.force_close()
            logger.debug("admin listener: %s %s -> %d", request.method, request.path, response.status)
            return response

        return handle

    async def _dispatch(self, request: web.BaseRequest, trusted: bool) -> web.Response:
        route = self._routes.get(request.path)
        if route is None:
            return _error(404, f"no such endpoint {request.path!r}")
        method, handler = route
        if request.method != method:
            return _error(405, f"{request.path} takes {method}, not {request.method}", allow=method)
        if len(request.query) > MAX_QUERY_FIELDS:
            return _error(400, f"over {MAX_QUERY_FIELDS} query parameters")
        if method == "POST":
            refused = self._refused(request, trusted) or await self._read_body(request)
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

    def _refused(self, request: web.BaseRequest, trusted: bool) -> tuple[int, str] | None:
        """Why a request that changes state is refused: sent by a web page (it has an Origin: a browser's
        cross-site POST), or over TCP without the token (router.service.admintoken). None: it may go on."""
        if "Origin" in request.headers:
            return 403, "requests from web pages (with an Origin header) are refused"
        if trusted:
            return None
        if self._token is None:
            return 403, "this listener takes no changes over TCP: use the Unix socket ([admin] socket)"
        scheme, _, value = request.headers.get("Authorization", "").partition(" ")
        matches = hmac.compare_digest(value.strip().encode(), self._token.encode())
        if scheme.lower() != "bearer" or not matches:
            return 401, ("this request changes state and needs the admin token (Authorization: Bearer ...;"
                         " see router/service/admintoken.py: $PGMESH_ADMIN_TOKEN or the token file), or the"
                         " Unix socket ([admin] socket)")
        return None

    async def _read_body(self, request: web.BaseRequest) -> tuple[int, str] | None:
        """Read and drop a small body, within the time left to the request. None: read."""
        if "Transfer-Encoding" in request.headers:
            return 501, "transfer-encoding is not supported; send Content-Length"
        if (request.content_length or 0) > MAX_BODY_BYTES:
            return 413, f"request body over {MAX_BODY_BYTES} bytes"
        if not request.body_exists:
            return None
        try:
            async with asyncio.timeout(self._read_timeout):
                await request.read()
        except TimeoutError:
            return 408, f"request body not received within {self._read_timeout:g}s"
        except (OSError, web.HTTPException) as exc:
            return 400, f"incomplete request body ({type(exc).__name__})"
        return None

    async def _get_metrics(self, request: web.BaseRequest) -> web.Response:
        return _response(200, self._metrics.render().encode("utf-8"), METRICS_CONTENT_TYPE)

    async def _get_healthz(self, request: web.BaseRequest) -> web.Response:
        try:
            ok, reason = self._health()
        except Exception as exc:
            logger.exception("admin listener: the health check failed")
            ok, reason = False, f"health check failed: {type(exc).__name__}: {exc}"
        if ok:
            return _response(200, b"ok\n", TEXT)
        return _response(503, (reason or "unhealthy").encode("utf-8") + b"\n", TEXT)

    async def _get_status(self, request: web.BaseRequest) -> web.Response:
        return _json(200, self._status())

    async def _post_pause(self, request: web.BaseRequest) -> web.Response:
        target, source = _links_of(request)
        logger.info("admin: pause requested for %s", _links_text(target, source))
        return _json(200, await self._pause(target, source))

    async def _post_resume(self, request: web.BaseRequest) -> web.Response:
        target, source = _links_of(request)
        logger.info("admin: resume requested for %s", _links_text(target, source))
        return _json(200, await self._resume(target, source))

    async def _post_skip(self, request: web.BaseRequest) -> web.Response:
        names = ("source", "target", "lsn")
        values = [request.query.getall(name, []) for name in names]
        if set(request.query) - set(names) or any(len(v) != 1 or not v[0] for v in values):
            raise _Reject(400, "give one source, one target and one lsn, and nothing else")
        source, target, lsn = (v[0] for v in values)
        logger.info("admin: skip requested on %s -> %s at %s", source, target, lsn)
        assert self._skip is not None
        return _json(200, await self._skip(source, target, lsn))


def _calling(callback: Callable[[str | None], Awaitable[object]], what: str) -> _Handler:
    async def handle(request: web.BaseRequest) -> web.Response:
        logger.info("admin: %s requested", what)
        return _json(200, await callback(None))

    return handle


async def _clear_stale_socket(path: str) -> None:
    """Remove a Unix socket a dead router left at `path`; refuse a live one or a file of another kind."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"admin.socket: {path} exists and is not a socket; name a path for the router's")
    try:
        _reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), 2)
    except TimeoutError:
        pass  # a listener that does not accept at once: taken for alive
    except OSError:
        os.unlink(path)  # nobody listens there: a dead router's
        return
    else:
        writer.close()
    raise OSError(errno.EADDRINUSE, f"admin listener cannot listen on the Unix socket {path}: a router "
                                    "already listens there; stop it or change admin.socket in config.toml")
