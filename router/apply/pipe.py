"""One link's pipelined session on its target (`Pipe`): the extended protocol, the statements prepared
once, each run by Bind/Execute with the tuple's own text bytes as its parameters, a whole batch of
transactions sent with one Sync and its results read back in one pass.

psycopg connects, authenticates and sets the session up; then a session without TLS is driven through its
socket by protocol.frontend (`_SocketPipe`: the batch's bytes written as they are, a change's Bind +
Execute built once for all the source's links, router.apply.shapes.Statements.wire, and the answer walked
in one pass), libpq left idle until the session closes. A session over TLS keeps libpq's pipeline mode
(`_LibpqPipe`: psycopg's `pq` layer, one call per statement), libpq owning the encryption.

asyncpg cannot do this: it pipelines only many executions of one statement (`executemany`), and a batch
runs a handful of statements per transaction. Its simple query protocol, which the script path uses, makes
the target parse every statement's text (literals included) for every transaction.

Each transaction in a batch is its own target transaction (BEGIN ... COMMIT, router.apply.shapes); an error
in one makes the server skip everything after it up to the Sync, so those before it are committed and
those after it are not, as with the script path's one simple query a batch. The error comes back as the
asyncpg exception the server's fields make (`asyncpg.PostgresError.new`), so router.errors and the applier
treat it as any other; a session that is gone raises ConnectionLost.

The session is set up as every applier session (router.apply.sessions: `SESSION_SETUP`, synchronous_commit,
`pgmesh.installed_at`, the source, the decision functions' settings), with [ha]'s fence. It holds the
source's replication origin while the pipe applies (`take_origin`, `let_origin_go`).

Must not: build SQL or decide what an error means.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any, ClassVar, Final

import asyncpg
import psycopg
from psycopg import pq

from protocol.frontend import SYNC, Results, bind_execute, close_statement, parse
from router.apply.fence import FENCE
from router.apply.sessions import SESSION_SETUP
from router.errors import ConnectionLost
from router.progress.applied import SOURCE_SETTING

__all__ = ["Piece", "Pipe", "PipeResult"]

logger = logging.getLogger(__name__)

# What a batch runs: a statement's Bind + Execute as bytes (router.apply.shapes.Statements.wire: only for a
# pipe that is `raw`), or its (name, parameters)
Piece = bytes | tuple[bytes, Sequence[bytes | None] | None]
_READ: Final = 1 << 18  # bytes read at most per recv

_OK: Final = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)
_SYNC: Final = pq.ExecStatus.PIPELINE_SYNC
_ERROR: Final = pq.ExecStatus.FATAL_ERROR
_FIELDS: Final = {  # libpq's diagnostic fields -> the keys asyncpg's exceptions are made from
    "C": pq.DiagnosticField.SQLSTATE, "M": pq.DiagnosticField.MESSAGE_PRIMARY,
    "D": pq.DiagnosticField.MESSAGE_DETAIL, "H": pq.DiagnosticField.MESSAGE_HINT,
    "S": pq.DiagnosticField.SEVERITY, "W": pq.DiagnosticField.CONTEXT, "s": pq.DiagnosticField.SCHEMA_NAME,
    "t": pq.DiagnosticField.TABLE_NAME, "c": pq.DiagnosticField.COLUMN_NAME,
    "n": pq.DiagnosticField.CONSTRAINT_NAME, "d": pq.DiagnosticField.DATATYPE_NAME,
}


class PipeResult:
    """What a batch did: `failed_at` (the index of the command that failed, or None), `error` (its asyncpg
    exception), `decided` (the last command, DECIDED, returned a row: a decision function decided)."""

    __slots__ = ("decided", "error", "failed_at")

    def __init__(self) -> None:
        self.failed_at: int | None = None
        self.error: BaseException | None = None
        self.decided = False


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


def _server_error(result: pq.abc.PGresult) -> BaseException:
    fields = {}
    for key, field in _FIELDS.items():
        value = result.error_field(field)
        if value is not None:
            fields[key] = value.decode(errors="replace")
    if "C" not in fields:
        text = result.error_message.decode(errors="replace").strip()
        return ConnectionLost(f"the pipe session failed: {text}")
    error: BaseException = asyncpg.PostgresError.new(fields)
    return error


class Pipe:
    """One link's pipelined session (see the module docstring): what both ways share. `raw`: the batch
    may carry Bind + Execute bytes (`Piece`)."""

    __slots__ = ("_watch", "conn", "node", "origin_held", "pg")
    raw: ClassVar[bool] = False

    def __init__(self, conn: psycopg.AsyncConnection[Any], node: str) -> None:
        self.conn = conn
        self.pg = conn.pgconn
        self.node = node
        self.origin_held = False
        # while waiting for the socket: the future woken, the loop and fd watched, whether for writing too
        self._watch: tuple[asyncio.Future[None], asyncio.AbstractEventLoop, int, bool] | None = None

    @classmethod
    async def open(
        cls, dsn: str, node: str, *, source: str, synchronous_commit: str, installed_at: str | None,
        settings: str, libpq: bool = False,
    ) -> Pipe:
        """A new session on the target, set up as every applier session is (router.apply.sessions).
        `libpq`: through libpq's pipeline mode even without TLS (bench.micro.pipecpu compares the two)."""
        name = FENCE.application_name
        # UTF-8, as the replication connection reads the rows (and as asyncpg's sessions are): else a
        # database in another encoding would read the tuple's bytes in its own
        extra: dict[str, Any] = {"client_encoding": "UTF8"}
        if name is not None:
            extra["application_name"] = name
        try:
            conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, **extra)
        except psycopg.OperationalError as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConnectionLost(f"the pipe session did not open: {first}", node=node) from None
        try:
            await FENCE.check(_Raw(conn), dsn)
            await conn.execute(f"{SESSION_SETUP}SET synchronous_commit = {synchronous_commit};")
            await _raw(conn, "SELECT set_config($1, $2, false)", SOURCE_SETTING, source)
            if installed_at:
                await _raw(conn, "SELECT set_config('pgmesh.installed_at', $1, false)", installed_at)
            if settings:
                await conn.execute(settings)
            if conn.pgconn.ssl_in_use or libpq:
                conn.pgconn.nonblocking = 1
                conn.pgconn.enter_pipeline_mode()
                return _LibpqPipe(conn, node)
            return _SocketPipe(conn, node)  # (libpq idle from here on)
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.close()
            raise

    @property
    def closed(self) -> bool:
        raise NotImplementedError

    async def send(
        self, prepares: Sequence[tuple[bytes, str, Sequence[int] | None]], plan: Sequence[Piece],
        closes: Sequence[bytes] = (),
    ) -> int:
        """Close `closes` (statements no longer used, or to be prepared again), prepare `prepares` (name,
        SQL, parameter types), run `plan`, one Sync, all written out; returns how many commands `results`
        reads back. The last of `plan` is DECIDED (router.apply.shapes)."""
        raise NotImplementedError

    async def results(self, commands: int) -> PipeResult:
        """The results of the `commands` sent, up to their Sync."""
        raise NotImplementedError

    async def recover(self) -> None:
        """After a failed batch: roll the failed transaction back and clear the origin's set-up left in
        the session (else a later commit without a set-up would record it)."""
        result = await self._unnamed(
            (b"ROLLBACK", None), (b"SELECT pg_catalog.pg_replication_origin_xact_reset()", None))
        if result.error is not None:
            raise result.error

    async def statement(self, sql: str, params: Sequence[bytes | None] | None = None) -> PipeResult:
        """One statement on its own (the origin taken or let go)."""
        return await self._unnamed((sql.encode(), params))

    async def _unnamed(self, *statements: tuple[bytes, Sequence[bytes | None] | None]) -> PipeResult:
        raise NotImplementedError

    async def take_origin(self, origin: str) -> None:
        """Hold the source's origin (a session that just let it go may not have yet: a moment allowed)."""
        for attempt in range(50):
            result = await self.statement("SELECT pg_catalog.pg_replication_origin_session_setup($1)",
                                          [origin.encode()])
            if result.error is None:
                self.origin_held = True
                return
            if getattr(result.error, "sqlstate", None) != "55006" or attempt == 49:
                raise result.error
            await asyncio.sleep(0.1)

    async def let_origin_go(self) -> None:
        if self.origin_held:
            result = await self.statement("SELECT pg_catalog.pg_replication_origin_session_reset()")
            if result.error is not None:
                raise result.error
            self.origin_held = False

    def _lost(self, exc: BaseException) -> ConnectionLost:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return ConnectionLost(f"the pipe session was lost: {text}", node=self.node)

    async def _wait(self, fd: int, *, writable: bool) -> None:
        """Until `fd` is readable (or, `writable`, readable or writable)."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _wake, ready)
        if writable:
            loop.add_writer(fd, _wake, ready)
        self._watch = (ready, loop, fd, writable)
        try:
            await ready
        finally:
            self._unwatch()

    def _unwatch(self) -> None:
        """Stop watching the socket (before it is closed: its number may be another's next)."""
        watch, self._watch = self._watch, None
        if watch is not None:
            _, loop, fd, writable = watch
            loop.remove_reader(fd)
            if writable:
                loop.remove_writer(fd)

    def terminate(self) -> None:
        """End the session at once: a batch in flight fails with ConnectionLost."""
        watch = self._watch
        self._unwatch()
        if watch is not None and not watch[0].done():
            watch[0].set_exception(ConnectionLost("the pipe session was ended", node=self.node))
        self._end()
        with contextlib.suppress(Exception):
            self.pg.finish()

    def _end(self) -> None:
        """What a way of sending closes of its own."""

    async def close(self) -> None:
        self.terminate()
        with contextlib.suppress(Exception):
            await self.conn.close()


class _SocketPipe(Pipe):
    """The pipe written and read through the session's socket (no TLS): protocol.frontend's bytes."""

    __slots__ = ("_bare", "_buf", "_gone", "_sock")
    raw = True

    def __init__(self, conn: psycopg.AsyncConnection[Any], node: str) -> None:
        super().__init__(conn, node)
        # our own descriptor of libpq's socket: closed by us, libpq's by pg.finish()
        self._sock = socket.socket(fileno=os.dup(self.pg.socket))
        self._sock.setblocking(False)
        self._buf = bytearray()  # read, not yet walked
        self._gone = False
        self._bare: dict[bytes, bytes] = {}  # the Bind + Execute of a statement without parameters

    @property
    def closed(self) -> bool:
        return self._gone

    async def send(
        self, prepares: Sequence[tuple[bytes, str, Sequence[int] | None]], plan: Sequence[Piece],
        closes: Sequence[bytes] = (),
    ) -> int:
        parts = [close_statement(name) for name in closes]
        parts += [parse(name, sql.encode(), types) for name, sql, types in prepares]
        bare = self._bare
        for piece in plan:
            if isinstance(piece, bytes):
                parts.append(piece)
                continue
            name, params = piece
            if params is None:  # (DECIDED, every batch)
                found = bare.get(name)
                if found is None:
                    found = bare[name] = bind_execute(name, None)
                parts.append(found)
            else:
                parts.append(bind_execute(name, params))
        commands = len(parts)
        parts.append(SYNC)
        await self._write(b"".join(parts))
        return commands

    async def results(self, commands: int) -> PipeResult:
        reader = Results(commands)
        buf = self._buf
        waited = False
        while not reader.feed(buf):
            try:
                # after the first part, what arrived while it was walked is read without a wait
                if not waited or not self._read():
                    await self._wait(self._fileno(), writable=False)
                    waited = True
                    self._read()
            except ConnectionLost:
                if reader.error is None:
                    raise
                said = reader.error.get("M", "")  # (a FATAL error: the server ends the session)
                raise ConnectionLost(f"the pipe session was closed by the server: {said}",
                                     node=self.node) from None
        out = PipeResult()
        if reader.error is not None:
            out.failed_at = reader.failed_at
            out.error = asyncpg.PostgresError.new(reader.error)
        out.decided = reader.decided
        return out

    async def _unnamed(self, *statements: tuple[bytes, Sequence[bytes | None] | None]) -> PipeResult:
        parts: list[bytes] = []
        for sql, params in statements:
            parts += (parse(b"", sql), bind_execute(b"", params))
        await self._write(b"".join(parts) + SYNC)
        return await self.results(len(parts))

    def _fileno(self) -> int:
        if self._gone:
            raise ConnectionLost("the pipe session was ended", node=self.node)
        return self._sock.fileno()

    async def _write(self, data: bytes) -> None:
        """Write `data` out; while the socket is full, read what the server writes meanwhile (else both
        sides may block on a large batch)."""
        view = memoryview(data)
        sock = self._sock
        while True:
            fd = self._fileno()
            try:
                sent = sock.send(view)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._gone = True
                raise self._lost(exc) from None
            if sent == len(view):
                return
            view = view[sent:]
            await self._wait(fd, writable=True)
            self._read()

    def _read(self) -> bool:
        """What the socket has now, into the buffer (whether anything); ConnectionLost at its end."""
        sock, buf = self._sock, self._buf
        got = False
        while True:
            try:
                data = sock.recv(_READ)
            except (BlockingIOError, InterruptedError):
                return got
            except OSError as exc:
                self._gone = True
                raise self._lost(exc) from None
            if not data:
                self._gone = True
                raise ConnectionLost("the pipe session was closed by the server", node=self.node)
            buf += data
            got = True
            if len(data) < _READ:
                return got

    def _end(self) -> None:
        self._gone = True
        with contextlib.suppress(OSError):
            self._sock.close()


class _LibpqPipe(Pipe):
    """The pipe through libpq's pipeline mode (a session over TLS: libpq encrypts)."""

    __slots__ = ()

    @property
    def closed(self) -> bool:
        return self.pg.status != pq.ConnStatus.OK

    async def send(
        self, prepares: Sequence[tuple[bytes, str, Sequence[int] | None]], plan: Sequence[Piece],
        closes: Sequence[bytes] = (),
    ) -> int:
        pg = self.pg
        try:
            for name in closes:  # (closing one that is not there is no error)
                pg.send_close_prepared(name)
            for name, sql, types in prepares:
                pg.send_prepare(name, sql.encode(), types)
            send = pg.send_query_prepared
            for piece in plan:
                assert type(piece) is tuple, "Bind bytes are for a raw pipe"
                send(*piece)
            pg.pipeline_sync()
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from None
        await self._flush()
        return len(closes) + len(prepares) + len(plan)

    async def results(self, commands: int) -> PipeResult:
        pg = self.pg
        out = PipeResult()
        index = 0
        last = commands - 1
        result: pq.abc.PGresult | None
        while True:
            while pg.is_busy():
                await self._wait(pg.socket, writable=False)
                try:
                    pg.consume_input()
                except psycopg.OperationalError as exc:
                    raise self._lost(exc) from None
            result = pg.get_result()
            if result is None:
                continue
            status = result.status
            if status == _SYNC:
                break
            if status == _ERROR and out.failed_at is None:
                out.failed_at, out.error = index, _server_error(result)
            elif index == last and status in _OK:
                out.decided = result.ntuples > 0
            index += 1
        if self.closed:
            raise ConnectionLost("the pipe session was closed by the server", node=self.node)
        return out

    async def _unnamed(self, *statements: tuple[bytes, Sequence[bytes | None] | None]) -> PipeResult:
        try:
            for sql, params in statements:
                self.pg.send_query_params(sql, params)
            self.pg.pipeline_sync()
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from None
        await self._flush()
        return await self.results(len(statements))

    async def _flush(self) -> None:
        pg = self.pg
        while True:
            try:
                if pg.flush() == 0:
                    return
                # the server may be writing results while we write: read them too, or both sides block
                await self._wait(pg.socket, writable=True)
                pg.consume_input()
            except psycopg.OperationalError as exc:
                raise self._lost(exc) from None


class _Raw:
    """What the fence reads a session through (`fetchval` with $n parameters), for a psycopg session."""

    __slots__ = ("conn",)

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn

    async def fetchval(self, query: str, *args: object) -> object:
        cursor = psycopg.AsyncRawCursor(self.conn)
        await cursor.execute(query, args)
        row = await cursor.fetchone()
        return None if row is None else row[0]


async def _raw(conn: psycopg.AsyncConnection[Any], query: str, *args: object) -> None:
    await _Raw(conn).fetchval(query, *args)
