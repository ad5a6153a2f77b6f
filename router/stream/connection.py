"""The replication connection to one node: the I/O shell under `router.stream.source`.

A `ReplicationConnection` owns one psycopg 3 connection in `replication=database` mode to one node. It
opens it, runs the replication commands (IDENTIFY_SYSTEM, CREATE_ / DROP_REPLICATION_SLOT, optionally
handing out an exported snapshot that outlives the slot's creation, see `router.stream.slots`; the slot's
row in pg_replication_slots comes over a short-lived normal connection), and streams pgoutput with
START_REPLICATION. On a plain socket (no TLS, no GSS encryption) START_REPLICATION and everything after
it go through `router.stream.wire` (the stream read in large chunks and split by `protocol.copyframes`,
status updates written to the socket); over TLS the stream is read with `pgconn.get_copy_data`. Either
way it is driven by the event loop (no threads) and handed up as batches of XLogData CopyData bodies
(`frames`), as they are: the source above decodes them, and can be fed the same batches from captured
bytes.
Primary keepalives are answered here, and standby status updates go out on their own timer with the
positions the source reports (`Positions`), so the walsender never times the link out, even while
nobody reads; silence past `receive_timeout` while ready to read ends the connection.

It is the only module that touches `psycopg.pq` for replication.
Must not: decode pgoutput, assemble or hand out transactions, or choose the positions it reports (the
source above owns them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Final, Protocol

import psycopg
from psycopg import pq, sql
from psycopg.conninfo import conninfo_to_dict

from protocol.copyframes import CopyEnd, query
from protocol.errors import UnknownMessage
from protocol.lsn import format_lsn, parse_lsn, unix_seconds_to_pg_us
from protocol.replication import PrimaryKeepalive, copy_data, parse_copy_data, standby_status_update
from router.errors import Action, ConnectionLost, SlotError, SourceError, decide, decide_sqlstate, describe
from router.stream.items import SourceOptions, StreamSettings, SystemInfo, negotiate
from router.stream.slots import FAILOVER_SLOTS_SINCE, SlotCreated, SlotInfo, keep_snapshot
from router.stream.state import Lifecycle, SourceState, SourceStats
from router.stream.wire import WireStream

__all__ = ["Frames", "Positions", "ReplicationConnection"]

# What `frames` yields: XLogData bodies read past libpq (bytes), or by libpq (memoryviews, over TLS).
Frames = list[bytes] | list[memoryview]

logger = logging.getLogger(__name__)

# Output settings of the walsender's session (libpq `options`), as PostgreSQL's walreceiver sets them.
_OUTPUT_SETTINGS: Final = "-c datestyle=ISO -c intervalstyle=postgres -c extra_float_digits=3"

_XLOG_TAG: Final = 0x77  # 'w'
_BATCH: Final = 512
# server_version_num from which pgoutput skips a missing publication with a warning instead of failing
SKIPS_MISSING_PUBLICATION_SINCE: Final = 180000
# What to do when the node has no pgmesh slot (42704): most often a physical standby just promoted.
_SLOT_MISSING_HINT: Final = (
    "if this node is a physical standby promoted in a failover: PostgreSQL 15 and 16 do not carry logical"
    " slots over to a standby, so re-join the node (`pgmesh join` from a donor, docs/join.md); 17+ keeps the"
    " slot only with sync_replication_slots = on on the standby and the slot synced before the promotion"
    " (docs/failover.md). Otherwise run `pgmesh init` again"
)


class Positions(Protocol):
    """What the connection asks of the source above it: the positions to report and to name in errors."""

    @property
    def delivered_lsn(self) -> int: ...

    @property
    def received_lsn(self) -> int: ...

    def flush_position(self) -> int: ...

    def on_keepalive(self, wal_end: int) -> None: ...

    def on_stream_start(self, settings: StreamSettings) -> None:
        """START_REPLICATION succeeded with `settings`: the frames that follow are in that format."""


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


class ReplicationConnection:
    """One node's replication connection: commands, the CopyData stream, keepalives, status updates."""

    __slots__ = (
        "_clock", "_confirm_event", "_conn", "_dsn", "_last_status_sent", "_life", "_positions", "_reading",
        "_send_lock", "_starved_since", "_stats", "_status_task", "_streaming", "_wire", "node", "options",
        "publications", "settings", "slot",
    )

    # False: libpq reads the stream on a plain socket too, as over TLS (tests and benches compare them).
    own_reads = True

    def __init__(
        self,
        node: str,
        dsn: str,
        slot: str,
        publications: tuple[str, ...],
        options: SourceOptions,
        positions: Positions,
        *,
        life: Lifecycle,
        stats: SourceStats,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`life` and `stats`: the source's state and counters (this connection moves it to connecting
        and streaming, and counts bytes and status updates)."""
        self.node = node
        self._dsn = dsn
        self.slot = slot
        self.publications = publications
        self.options = options
        self._positions = positions
        self._life = life
        self._stats = stats
        self._clock = clock
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._streaming = False
        # When the reader started waiting on an empty socket (None while it has data or is not
        # reading): silence only counts while we are ready to receive, never while the caller is slow.
        self._starved_since: float | None = None
        self._last_status_sent = 0.0
        self._confirm_event = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._status_task: asyncio.Task[None] | None = None
        self._reading: tuple[int, asyncio.Future[None]] | None = None
        self._wire: WireStream | None = None  # the socket, read by us from START_REPLICATION on
        # what the last START_REPLICATION asked of the server (`negotiate`: options and its version)
        self.settings: StreamSettings | None = None

    @property
    def reads_past_libpq(self) -> bool:
        """Whether the stream now streaming is read and written past libpq (`router.stream.wire`)."""
        return self._wire is not None and self._streaming

    # ---------------------------------------------------------------- connection

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        self._life.to(SourceState.CONNECTING)
        try:
            # pgoutput writes text values with the walsender's settings: fix those the applier's input
            # functions must read back exactly, as PostgreSQL's own walreceiver does (a server's
            # DateStyle 'SQL, DMY' or extra_float_digits 0 otherwise reach the target unreadable or cut).
            # Names and text values come in the walsender's client encoding, which the decoder reads as
            # UTF-8: a database in another encoding (LATIN1) would otherwise send its own bytes.
            given = str(conninfo_to_dict(self._dsn).get("options") or "")
            conn = await psycopg.AsyncConnection.connect(
                self._dsn,
                replication="database",
                autocommit=True,
                application_name=self.options.application_name,
                connect_timeout=max(1, int(self.options.connect_timeout)),
                options=f"{given} {_OUTPUT_SETTINGS}".strip(),
                client_encoding="UTF8",
            )
        except psycopg.Error as exc:
            raise self._wrap(exc, "cannot open the replication connection") from exc
        self._conn = conn
        return conn

    def _wrap(self, exc: BaseException, what: str) -> Exception:
        text = f"{what}: {describe(exc)}"
        state = getattr(exc, "sqlstate", None)
        lsn = self._positions.delivered_lsn or None
        if decide(exc) is Action.RETRY:
            return ConnectionLost(text, node=self.node, lsn=lsn, sqlstate=state)
        return SourceError(text, node=self.node, lsn=lsn, sqlstate=state)

    async def _command(self, command: sql.Composed | str) -> list[tuple[Any, ...]]:
        conn = await self._connect()
        if self._streaming:
            raise SourceError("replication commands cannot run while streaming", node=self.node)
        try:
            cur = psycopg.AsyncClientCursor(conn)
            await cur.execute(command)
            return await cur.fetchall() if cur.description else []
        except psycopg.Error as exc:
            raise self._wrap(exc, "replication command failed") from exc

    async def disconnect(self) -> None:
        """Stop streaming and close the connection (the slot stays; the state is the caller's to set)."""
        task, self._status_task = self._status_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        conn, self._conn = self._conn, None
        self._streaming = False
        wire, self._wire = self._wire, None
        if wire is not None:
            wire.close()
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    # ---------------------------------------------------------------- commands

    async def identify_system(self) -> SystemInfo:
        rows = await self._command("IDENTIFY_SYSTEM")
        system_id, timeline, xlogpos, dbname = rows[0]
        return SystemInfo(str(system_id), int(timeline), parse_lsn(str(xlogpos)), dbname)

    async def create_slot(self, *, export_snapshot: bool = False, temporary: bool = False) -> SlotCreated:
        """CREATE_REPLICATION_SLOT ... LOGICAL pgoutput; with an exported snapshot held open if asked."""
        snapshot_mode = "export" if export_snapshot else "nothing"
        # 17+: a permanent slot follows a failover to a physical standby (docs/failover.md)
        failover = not temporary and (await self._connect()).info.server_version >= FAILOVER_SLOTS_SINCE
        command = sql.SQL("CREATE_REPLICATION_SLOT {} {}LOGICAL pgoutput (SNAPSHOT {}{})").format(
            sql.Identifier(self.slot),
            sql.SQL("TEMPORARY " if temporary else ""),
            sql.Literal(snapshot_mode),
            sql.SQL(", FAILOVER true" if failover else ""),
        )
        try:
            rows = await self._command(command)
        except SourceError as exc:
            raise SlotError(
                f"cannot create replication slot {self.slot!r}: {exc.message}",
                node=self.node,
                sqlstate=exc.sqlstate,
                hint="check max_replication_slots and that no slot of that name exists",
            ) from exc
        name, consistent_point, snapshot_name, _plugin = rows[0]
        point = parse_lsn(str(consistent_point))
        logger.info("node %s: created slot %s at %s", self.node, name, format_lsn(point))
        snapshot = None
        if export_snapshot:
            snapshot = await keep_snapshot(self._dsn, str(snapshot_name), slot=self.slot, node=self.node,
                                           application_name=self.options.application_name)
        return SlotCreated(str(name), point, snapshot)

    async def drop_slot(self, *, wait: bool = True, missing_ok: bool = False) -> bool:
        """DROP_REPLICATION_SLOT; returns False when it did not exist and `missing_ok`."""
        command = sql.SQL("DROP_REPLICATION_SLOT {}{}").format(
            sql.Identifier(self.slot), sql.SQL(" WAIT" if wait else "")
        )
        try:
            await self._command(command)
        except SourceError as exc:
            if missing_ok and exc.sqlstate == "42704":
                return False
            raise SlotError(
                f"cannot drop replication slot {self.slot!r}: {exc.message}",
                node=self.node,
                sqlstate=exc.sqlstate,
            ) from exc
        logger.info("node %s: dropped slot %s", self.node, self.slot)
        return True

    async def slot_info(self) -> SlotInfo | None:
        """The slot's row in pg_replication_slots (over a short-lived normal connection)."""
        query = (
            "SELECT slot_name, plugin, slot_type, database, temporary, active, active_pid,"
            " restart_lsn::text, confirmed_flush_lsn::text, wal_status"
            " FROM pg_catalog.pg_replication_slots WHERE slot_name = %s"
        )
        try:
            async with await psycopg.AsyncConnection.connect(self._dsn, autocommit=True) as conn:
                cur = await conn.execute(query, [self.slot])
                row = await cur.fetchone()
        except psycopg.Error as exc:
            raise self._wrap(exc, f"cannot inspect slot {self.slot!r}") from exc
        if row is None:
            return None
        restart = parse_lsn(row[7]) if row[7] else None
        confirmed = parse_lsn(row[8]) if row[8] else None
        return SlotInfo(row[0], row[1], row[2], row[3], row[4], row[5], row[6], restart, confirmed, row[9])

    # ---------------------------------------------------------------- starting the stream

    def _start_command(self, lsn: int, settings: StreamSettings) -> bytes:
        options = settings.option_list(self.publications)
        return f'START_REPLICATION SLOT "{self.slot}" LOGICAL {format_lsn(lsn)} {options}'.encode()

    async def _check_publications(self, lsn: int) -> None:
        """PostgreSQL 18's pgoutput skips a publication that does not exist (a warning in the server log)
        where older ones fail: its changes would go nowhere, silently. Check before streaming."""
        query = sql.SQL(
            "SELECT p.name FROM unnest({}::text[]) AS p(name)"
            " WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = p.name)"
        ).format(sql.Literal(list(self.publications)))
        missing = [row[0] for row in await self._command(query)]
        if missing:
            raise SourceError(
                f"publication {', '.join(missing)} does not exist (PostgreSQL 18 would stream without it,"
                " leaving its changes out): create it again on this node before streaming resumes",
                node=self.node, lsn=lsn,
            )

    async def _start(self, lsn: int) -> None:
        conn = await self._connect()
        if conn.info.server_version >= SKIPS_MISSING_PUBLICATION_SINCE:
            await self._check_publications(lsn)
        pgconn = conn.pgconn
        settings = negotiate(self.options, conn.info.server_version)
        command = self._start_command(lsn, settings)
        if self.own_reads and not pgconn.ssl_in_use and not pgconn.used_gssapi:
            await self._start_wire(pgconn, command, lsn)
        else:
            await self._start_libpq(pgconn, command, lsn)
        pgconn.nonblocking = 1
        self.settings = settings
        self._positions.on_stream_start(settings)
        self._streaming = True
        self._starved_since = None
        self._life.to(SourceState.STREAMING, detail=(
            f"slot {self.slot} from {format_lsn(lsn)}: proto_version {settings.proto_version}, streaming"
            f" {settings.streaming}, {'binary' if settings.binary else 'text'} values"
        ))

    async def _start_libpq(self, pgconn: pq.abc.PGconn, command: bytes, lsn: int) -> None:
        pgconn.send_query(command)
        await self._flush_out(pgconn)
        while True:
            pgconn.consume_input()
            if not pgconn.is_busy():
                break
            await self._wait_readable(pgconn.socket, self.options.receive_timeout)
        result = pgconn.get_result()
        if result is None or result.status != pq.ExecStatus.COPY_BOTH:
            message = result.error_message.decode(errors="replace").strip() if result else "no result"
            state = result.error_field(pq.DiagnosticField.SQLSTATE) if result else None
            self._start_failed(lsn, message, state.decode() if state else None)

    async def _start_wire(self, pgconn: pq.abc.PGconn, command: bytes, lsn: int) -> None:
        """START_REPLICATION written and its answer read past libpq: from here on the socket is ours.

        libpq's input buffer is empty here: every command before ended at its ReadyForQuery, after which
        the server sends nothing until asked.
        """
        wire = self._wire = WireStream(pgconn.socket, self.node)
        await wire.write(query(command), self.options.receive_timeout)
        while (answer := wire.answer(lsn)) is False:
            await self._wait_readable(wire.fd, self.options.receive_timeout)
        if isinstance(answer, CopyEnd):
            # Its ReadyForQuery may still be on the way, unread: libpq must not find it. Not used again.
            await self.disconnect()
            self._start_failed(lsn, answer.text, answer.sqlstate)

    def _start_failed(self, lsn: int, message: str, code: str | None) -> None:
        error_cls = SlotError if code in ("42704", "55006") else SourceError
        raise error_cls(
            f"START_REPLICATION on slot {self.slot!r} failed: {message}",
            node=self.node,
            lsn=lsn,
            sqlstate=code,
            hint=_SLOT_MISSING_HINT if code == "42704" else None,
        )

    async def _wait_readable(self, fd: int, limit: float | None) -> None:
        """Until socket `fd` is readable; `abort` ends the wait with ConnectionLost."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _wake, ready)
        self._reading = (fd, ready)
        try:
            async with asyncio.timeout(limit):  # not wait_for: on 3.11 it can swallow a cancel
                await ready
        finally:
            self._reading = None
            loop.remove_reader(fd)

    async def _flush_out(self, pgconn: pq.abc.PGconn) -> None:
        loop = asyncio.get_running_loop()
        while pgconn.flush() == 1:
            fd = pgconn.socket
            ready: asyncio.Future[None] = loop.create_future()
            loop.add_writer(fd, _wake, ready)
            try:
                async with asyncio.timeout(self.options.receive_timeout):
                    await ready
            finally:
                loop.remove_writer(fd)

    # ---------------------------------------------------------------- feedback

    def nudge(self) -> None:
        """The source's positions moved (a confirm): send a status update now, not at the timer."""
        self._confirm_event.set()

    async def send_status(self, *, reply: bool = False) -> None:
        """Send a standby status update with the positions as they are now."""
        conn = self._conn
        if conn is None or not self._streaming:
            return
        async with self._send_lock:
            flush = self._positions.flush_position()
            write = max(self._positions.received_lsn, flush)
            now = unix_seconds_to_pg_us(self._clock())
            update = standby_status_update(write, flush, flush, now, reply)
            try:
                if self._wire is not None:
                    await self._wire.write(copy_data(update), self.options.receive_timeout)
                else:
                    conn.pgconn.put_copy_data(update)
                    await self._flush_out(conn.pgconn)
            except (psycopg.Error, OSError, TimeoutError) as exc:
                raise ConnectionLost(f"cannot send status update: {describe(exc)}", node=self.node) from exc
            self._last_status_sent = asyncio.get_running_loop().time()
            self._stats.status_updates_sent += 1

    async def _status_loop(self) -> None:
        """Status updates on their own timer: the walsender sees us alive even when nobody consumes."""
        loop = asyncio.get_running_loop()
        interval = self.options.status_interval
        timeout = self.options.receive_timeout
        while self._streaming:
            self._confirm_event.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._confirm_event.wait()
            silent = 0.0 if self._starved_since is None else loop.time() - self._starved_since
            if silent > timeout:
                logger.warning("node %s: nothing received for %.0f s, reconnecting", self.node, silent)
                self.abort()
                return
            try:
                await self.send_status(reply=silent > timeout / 2)
            except ConnectionLost:
                self.abort()
                return

    def abort(self, reason: ConnectionLost | None = None) -> None:
        """Make the reader see a dead connection (`reason`, or a receive timeout): it then reconnects."""
        reading, self._reading = self._reading, None
        if reading is not None:
            fd, ready = reading
            asyncio.get_running_loop().remove_reader(fd)
            if not ready.done():
                lost = reason or ConnectionLost("receive timeout: the node stopped answering", node=self.node)
                ready.set_exception(lost)
        if self._wire is not None:
            self._wire.close(reason)
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.pgconn.finish()

    # ---------------------------------------------------------------- reading

    def _read_available(self, pgconn: pq.abc.PGconn) -> list[memoryview] | None:
        """Up to _BATCH messages already received, and up to the first that is not XLogData (then the
        last, as `CopyReader.split` does); [] when none; None when the COPY stream ended.

        The socket is read only once libpq's buffer holds no whole message (libpq grows that buffer to
        hold whatever was read and never shrinks it).
        """
        out: list[memoryview] = []
        get_copy_data = pgconn.get_copy_data
        append = out.append
        consumed = False
        for _ in range(_BATCH):
            n, data = get_copy_data(1)
            if n > 0:
                append(data)
                if data[0] != _XLOG_TAG:
                    break
            elif n == 0:
                if consumed or out:
                    break
                pgconn.consume_input()
                consumed = True
            elif n == -1:
                return out or None
            else:
                raise psycopg.OperationalError(pgconn.error_message.decode(errors="replace").strip())
        return out

    def _end_of_copy(self, pgconn: pq.abc.PGconn) -> Exception:
        """The error that ended the COPY stream, as ours: retryable or not by its SQLSTATE."""
        received = self._positions.received_lsn
        result = pgconn.get_result()
        if result is not None and result.status == pq.ExecStatus.FATAL_ERROR:
            message = result.error_message.decode(errors="replace").strip()
            state = result.error_field(pq.DiagnosticField.SQLSTATE)
            code = state.decode() if state else None
            retry = code is None or decide_sqlstate(code) is Action.RETRY
            error_cls = ConnectionLost if retry else SourceError
            return error_cls(f"stream ended: {message}", node=self.node, lsn=received, sqlstate=code)
        return ConnectionLost("the server ended the replication stream", node=self.node, lsn=received)

    async def frames(self, start_lsn: int) -> AsyncGenerator[Frames, None]:
        """Batches of XLogData CopyData bodies ('w' and all) from one connection, from `start_lsn`: bytes
        read past libpq (`router.stream.wire`), memoryviews from libpq (over TLS).

        Keepalives are handled here (`Positions.on_keepalive`, and a reply when asked for), each after
        the frames before it were yielded. Ends only by raising: ConnectionLost when retrying may help.
        """
        await self._start(start_lsn)
        assert self._conn is not None
        pgconn = self._conn.pgconn
        wire = self._wire
        counted = 0  # the wire's bytes counted in the stats
        loop = asyncio.get_running_loop()
        self._status_task = asyncio.create_task(self._status_loop(), name=f"pgmesh-status-{self.node}")
        try:
            while True:
                batch: Frames | None
                try:
                    if wire is not None:
                        batch = wire.available(_BATCH, self._positions.received_lsn)
                    else:
                        batch = self._read_available(pgconn)
                except (psycopg.Error, OSError) as exc:
                    text = f"replication connection lost: {describe(exc)}"
                    raise ConnectionLost(text, node=self.node, lsn=self._positions.received_lsn) from exc
                if batch is None:
                    if wire is not None:
                        raise wire.ended(self._positions.received_lsn)
                    raise self._end_of_copy(pgconn)
                if not batch:
                    if self._starved_since is None:
                        self._starved_since = loop.time()
                    try:
                        await self._wait_readable(
                            wire.fd if wire is not None else pgconn.socket, self.options.receive_timeout
                        )
                    except TimeoutError:
                        continue  # the status loop decides when silence means death
                    except (psycopg.Error, OSError, ValueError) as exc:  # socket closed under us
                        raise ConnectionLost(f"replication socket closed: {exc}", node=self.node) from exc
                    continue
                self._starved_since = None
                if wire is not None:
                    counted, before = wire.reader.data_bytes, counted
                    self._stats.bytes_received += counted - before
                else:
                    self._stats.bytes_received += sum(map(len, batch))
                last = batch[-1]
                if last and last[0] == _XLOG_TAG:
                    yield batch
                    reply = False
                else:
                    # A keepalive ends its batch. Everything sent before it must be assembled and handed
                    # out before its WAL end may count as the idle position: yield the frames first.
                    del batch[-1]
                    if batch:
                        yield batch
                    reply = self._control(last)
                # The status task runs only when the loop is free; a long backlog read straight from a
                # full socket never frees it, so status goes out from here too when it is due (else the
                # walsender's wal_sender_timeout ends a connection that is only busy).
                if reply or loop.time() - self._last_status_sent > self.options.status_interval:
                    await self.send_status()
        finally:
            self._streaming = False
            task, self._status_task = self._status_task, None
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def _control(self, data: bytes | memoryview) -> bool:
        """A CopyData body that is not XLogData: a keepalive (`_keepalive`), else ProtocolError."""
        keepalive = parse_copy_data(data)  # raises the right ProtocolError for anything else
        if not isinstance(keepalive, PrimaryKeepalive):
            raise UnknownMessage("XLogData where a keepalive was expected", tag="w")
        return self._keepalive(keepalive)

    def _keepalive(self, keepalive: PrimaryKeepalive) -> bool:
        """Pass a primary keepalive's WAL end up; True when the server asks for an immediate reply."""
        self._positions.on_keepalive(keepalive.wal_end)
        return keepalive.reply_requested
