"""A loopback TCP forwarder that integration tests use to cut, stall and restore a network link.

Owns: one asyncio event loop in a daemon thread per proxy, the listening socket, every forwarded
connection pair. The tests' `tcp_proxy` fixture (tests/proxy.py) and the fault suite (bench/faults.py) use it.

Must not: know anything about PostgreSQL or its protocol (it forwards bytes), or share its event loop with
the test (so it works from sync and async tests alike). Every public method is thread-safe and returns
only once the change has taken effect on the proxy's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
CHUNK = 64 * 1024
CALL_TIMEOUT_S = 10.0


class Mode(enum.Enum):
    FORWARD = "forward"
    CUT = "cut"
    BLACKHOLE = "blackhole"


class _Link:
    """One accepted client connection and its upstream connection."""

    __slots__ = ("client", "tasks", "upstream")

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task[None]] = []

    def writers(self) -> list[asyncio.StreamWriter]:
        return [w for w in (self.client, self.upstream) if w is not None]

    def abort(self) -> None:
        for writer in self.writers():
            writer.transport.abort()
        for task in self.tasks:
            task.cancel()

    async def wait_closed(self) -> None:
        waits = [w.wait_closed() for w in self.writers()]
        await asyncio.gather(*waits, *self.tasks, return_exceptions=True)


class TcpProxy:
    """Forward 127.0.0.1:<port> to (target_host, target_port) with cut / blackhole / restore."""

    __slots__ = (
        "_flowing",
        "_links",
        "_loop",
        "_mode",
        "_server",
        "_thread",
        "accepted",
        "port",
        "refused",
        "target_host",
        "target_port",
    )

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = 0
        self.accepted = 0
        self.refused = 0
        self._mode = Mode.FORWARD
        self._links: set[_Link] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._flowing: asyncio.Event | None = None

    def __repr__(self) -> str:
        return (
            f"TcpProxy(127.0.0.1:{self.port} -> {self.target_host}:{self.target_port}, "
            f"mode={self._mode.value}, active={self.active})"
        )

    # -- public, thread-safe API ------------------------------------------------------------------------

    def start(self) -> TcpProxy:
        """Start the loop thread and listen; returns once `port` accepts connections."""
        if self._loop is not None:
            raise RuntimeError(f"{self!r} already started")
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(
            target=loop.run_forever, name=f"tcp-proxy-{self.target_port}", daemon=True
        )
        self._thread.start()
        self._call(self._listen)
        logger.info("proxy 127.0.0.1:%d -> %s:%d listening", self.port, self.target_host, self.target_port)
        return self

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def active(self) -> int:
        """Connections currently forwarded (or stalled)."""
        return len(self._links)

    def cut(self) -> None:
        """Close every live connection both ways; close new ones as soon as they are accepted."""
        self._call(self._set_mode, Mode.CUT)

    def blackhole(self) -> None:
        """Keep connections open (and accept new ones) but forward no bytes until `restore()`."""
        self._call(self._set_mode, Mode.BLACKHOLE)

    def restore(self) -> None:
        """Forward again; bytes held back by a blackhole are delivered."""
        self._call(self._set_mode, Mode.FORWARD)

    def close(self) -> None:
        """Stop listening, close every connection and stop the loop thread. Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            self._call(self._shutdown)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=CALL_TIMEOUT_S)
        if not thread.is_alive():
            loop.close()
        logger.info("proxy on port %d closed (accepted %d)", self.port, self.accepted)

    def __enter__(self) -> TcpProxy:
        return self.start() if self._loop is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- loop side --------------------------------------------------------------------------------------

    def _call(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        if self._loop is None or self._loop.is_closed():
            raise RuntimeError(f"{self!r} is not running")
        future = asyncio.run_coroutine_threadsafe(fn(*args), self._loop)
        return future.result(timeout=CALL_TIMEOUT_S)

    async def _listen(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _set_mode(self, mode: Mode) -> None:
        assert self._flowing is not None
        logger.info("proxy on port %d: %s -> %s", self.port, self._mode.value, mode.value)
        self._mode = mode
        if mode is Mode.FORWARD:
            self._flowing.set()
            return
        self._flowing.clear()
        if mode is Mode.CUT:
            await self._drop_all()

    async def _drop_all(self) -> None:
        links = list(self._links)
        self._links.clear()
        for link in links:
            link.abort()
        await asyncio.gather(*(link.wait_closed() for link in links))

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._drop_all()
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self._mode is Mode.CUT:
            self.refused += 1
            writer.transport.abort()
            return
        link = _Link(writer)
        self._links.add(link)
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError as exc:
            logger.info("proxy on port %d: upstream connect failed: %s", self.port, exc)
            self._links.discard(link)
            writer.transport.abort()
            return
        link.upstream = up_writer
        if link not in self._links:  # cut while connecting upstream
            link.abort()
            return
        link.tasks = [
            asyncio.create_task(self._pump(reader, up_writer)),
            asyncio.create_task(self._pump(up_reader, writer)),
        ]
        await asyncio.wait(link.tasks, return_when=asyncio.FIRST_COMPLETED)
        self._links.discard(link)
        link.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        flowing = self._flowing
        assert flowing is not None
        try:
            while True:
                await flowing.wait()
                data = await reader.read(CHUNK)
                if not data:
                    return
                await flowing.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            return
