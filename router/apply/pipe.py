"""One link's pipelined session on its target (`Pipe`): the extended protocol through libpq's pipeline mode
(psycopg's `pq` layer), the statements prepared once, each run by Bind/Execute with the tuple's own text
bytes as its parameters, a whole batch of transactions sent with one Sync and its results read back in
one pass.

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
from collections.abc import Sequence
from typing import Any, Final

import asyncpg
import psycopg
from psycopg import pq

from router.apply.fence import FENCE
from router.apply.sessions import SESSION_SETUP
from router.errors import ConnectionLost
from router.progress.applied import SOURCE_SETTING

__all__ = ["Pipe", "PipeResult"]

logger = logging.getLogger(__name__)

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
    """One link's pipelined session (see the module docstring)."""

    __slots__ = ("_waiting", "conn", "node", "origin_held", "pg")

    def __init__(self, conn: psycopg.AsyncConnection[Any], node: str) -> None:
        self.conn = conn
        self.pg = conn.pgconn
        self.node = node
        self.origin_held = False
        self._waiting: asyncio.Future[None] | None = None

    @classmethod
    async def open(
        cls, dsn: str, node: str, *, source: str, synchronous_commit: str, installed_at: str | None,
        settings: str,
    ) -> Pipe:
        """A new session on the target, set up as every applier session is (router.apply.sessions)."""
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
            conn.pgconn.nonblocking = 1
            conn.pgconn.enter_pipeline_mode()
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.close()
            raise
        return cls(conn, node)

    @property
    def closed(self) -> bool:
        return self.pg.status != pq.ConnStatus.OK

    async def send(
        self, prepares: Sequence[tuple[bytes, str, Sequence[int] | None]],
        plan: Sequence[tuple[bytes, Sequence[bytes | None] | None]], closes: Sequence[bytes] = (),
    ) -> int:
        """Close `closes` (statements no longer used), prepare `prepares` (name, SQL, parameter types), run
        `plan` (name, parameters), one Sync, all written out; returns how many commands `results` reads
        back. The last of `plan` is DECIDED (router.apply.shapes)."""
        pg = self.pg
        try:
            for name in closes:  # (closing one that is not there is no error)
                pg.send_close_prepared(name)
            for name, sql, types in prepares:
                pg.send_prepare(name, sql.encode(), types)
            send = pg.send_query_prepared
            for name, params in plan:
                send(name, params)
            pg.pipeline_sync()
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from None
        await self._flush()
        return len(closes) + len(prepares) + len(plan)

    async def results(self, commands: int) -> PipeResult:
        """The results of the `commands` sent, up to their Sync."""
        return await self._results(commands)

    async def _results(self, commands: int) -> PipeResult:
        pg = self.pg
        out = PipeResult()
        index = 0
        last = commands - 1
        result: pq.abc.PGresult | None
        while True:
            while pg.is_busy():
                await self._readable()
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

    async def recover(self) -> None:
        """After a failed batch: roll the failed transaction back and clear the origin's set-up left in
        the session (else a later commit without a set-up would record it)."""
        pg = self.pg
        try:
            pg.send_query_params(b"ROLLBACK", None)
            pg.send_query_params(b"SELECT pg_catalog.pg_replication_origin_xact_reset()", None)
            pg.pipeline_sync()
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from None
        await self._flush()
        result = await self._results(2)
        if result.error is not None:
            raise result.error

    async def statement(self, sql: str, params: Sequence[bytes | None] | None = None) -> PipeResult:
        """One statement on its own (the origin taken or let go)."""
        try:
            self.pg.send_query_params(sql.encode(), params)
            self.pg.pipeline_sync()
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from None
        await self._flush()
        return await self._results(1)

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
        return ConnectionLost(f"the pipe session was lost: {str(exc).splitlines()[0]}", node=self.node)

    async def _flush(self) -> None:
        pg = self.pg
        while True:
            try:
                if pg.flush() == 0:
                    return
                # the server may be writing results while we write: read them too, or both sides block
                await self._either()
                pg.consume_input()
            except psycopg.OperationalError as exc:
                raise self._lost(exc) from None

    async def _readable(self) -> None:
        await self._wait(writable=False)

    async def _either(self) -> None:
        """Until the socket is readable or writable (a flush that could not finish)."""
        await self._wait(writable=True)

    async def _wait(self, *, writable: bool) -> None:
        loop = asyncio.get_running_loop()
        fd = self.pg.socket
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _wake, ready)
        if writable:
            loop.add_writer(fd, _wake, ready)
        self._waiting = ready
        try:
            await ready
        finally:
            self._waiting = None
            loop.remove_reader(fd)
            if writable:
                loop.remove_writer(fd)

    def terminate(self) -> None:
        """End the session at once: a batch in flight fails with ConnectionLost."""
        waiting = self._waiting
        if waiting is not None and not waiting.done():
            waiting.set_exception(ConnectionLost("the pipe session was ended", node=self.node))
        with contextlib.suppress(Exception):
            self.pg.finish()

    async def close(self) -> None:
        self.terminate()
        with contextlib.suppress(Exception):
            await self.conn.close()


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
