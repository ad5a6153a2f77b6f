"""One logical replication source per node: the only code that touches a replication connection.

A `ReplicationSource` owns a psycopg 3 connection in `replication=database` mode to one node: it runs
IDENTIFY_SYSTEM, creates / drops / inspects the node's logical slot (optionally handing out an exported
snapshot that outlives the slot's creation; what it hands back is in `router.stream.slots`), and streams
pgoutput with START_REPLICATION. The stream is read with `pgconn.get_copy_data` driven by the event loop
(no threads), decoded once by `protocol/` and handed out as whole committed transactions (and
non-transactional logical messages) in commit order.
A transaction bigger than `SourceOptions.spill_bytes` is written to a `router.stream.spool.Spool` as it
arrives, its tail too at its commit, and handed out on disk (`Transaction.spill`). Inserts are decoded
only at a commit that finds them in memory (`RawInsert`: a spilled row goes on to COPY as sent). With
`early_streamed`, a streamed (in-progress) transaction is also announced at its first spill
(`EarlyStream`), so that appliers may start on it before it commits; it is still handed out at its
commit, in commit order.

What it guarantees its caller:
- Pull-based backpressure: nothing is read from the socket while the caller is not asking for more, yet
  status updates go out on their own timer so the walsender never times the link out.
- The flush position reported to the server is only ever what the caller passed to `confirm()` (or, when
  every delivered transaction is confirmed and nothing is half received, the server's own idle position).
- Reconnect with backoff after a connection loss, resuming after the last transaction handed out: no
  transaction is lost (the slot keeps everything after the confirmed position) and none is handed out
  twice (transactions the server resends from before that point are dropped here).

It must not apply anything, decide about echoes, or know about other nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import struct
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Final

import msgspec
import psycopg
from psycopg import pq, sql

from protocol.errors import ProtocolError
from protocol.lsn import format_lsn, parse_lsn, unix_seconds_to_pg_us
from protocol.messages import Commit, Message, PgOutputMessage, RawInsert, StreamCommit
from protocol.pgoutput import Decoder, raw_insert, raw_insert_run
from protocol.replication import PrimaryKeepalive, XLogData, parse_copy_data, standby_status_update
from protocol.transactions import Spill, SpillDropped, Transaction, TransactionAssembler
from router.errors import Action, ConnectionLost, SlotError, SourceError, decide, decide_sqlstate, describe
from router.stream.items import EarlyStream, SourceOptions, SystemInfo, publication_list
from router.stream.slots import SlotCreated, SlotInfo, check_slot_name, hold_snapshot
from router.stream.spool import Spool

__all__ = ["EarlyStream", "ReplicationSource", "SourceOptions", "SystemInfo"]

logger = logging.getLogger(__name__)

_XLOG_TAG: Final = 0x77  # 'w'
_KEEPALIVE_TAG: Final = 0x6B  # 'k'
_BATCH: Final = 512
_WAL_START: Final = struct.Struct(">Q")  # after the 'w' of an XLogData body
_ROW_TAGS: Final = frozenset(b"IUD")
_INSERT_TAG: Final = 0x49  # 'I'
_COMMIT_TAGS: Final = frozenset(b"Cc")  # Commit, Stream Commit
_COMMITS: Final = (Commit, StreamCommit)
_XLOG_PAYLOAD: Final = 25  # 'w' + WAL start, WAL end, send time


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


class ReplicationSource:
    """The replication connection to one node, its slot, and the decoded stream from it."""

    def __init__(
        self,
        node: str,
        dsn: str,
        slot: str,
        publications: tuple[str, ...] | list[str],
        *,
        options: SourceOptions | None = None,
        start_lsn: int = 0,
        clock: Callable[[], float] = time.time,
        spool: Spool | None = None,
    ) -> None:
        """`spool`: where transactions over `options.spill_bytes` go (shared by a router's sources);
        without one, the source makes its own when it has a bound."""
        self.node = node
        self._dsn = dsn
        self.slot = check_slot_name(slot, node)
        self.publications = tuple(publications)
        self.options = options or SourceOptions()
        self._clock = clock
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._streaming = False
        self._decoder = Decoder()
        spill = self.options.spill_bytes
        self._assembler = TransactionAssembler(spill if spill > 0 else None)
        self.spool = spool if spool is not None or spill <= 0 else Spool(cluster=node)
        # Everything whose WAL record starts before this position has been handed out.
        self._skip_before = start_lsn
        self._delivered_high = start_lsn  # the highest position ever handed out (rewinds go below it)
        self._rewind_to: int | None = None
        self._confirmed = start_lsn
        self._received = 0
        self._server_wal_end = 0
        # When the reader started waiting on an empty socket (None while it has data or is not
        # reading): silence only counts while we are ready to receive, never while the caller is slow.
        self._starved_since: float | None = None
        self._last_status_sent = 0.0
        self._confirm_event = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._status_task: asyncio.Task[None] | None = None
        self._reading: tuple[int, asyncio.Future[None]] | None = None
        self.state = "idle"
        self.last_error: str | None = None
        self.reconnects = 0
        self.bytes_received = 0
        self.transactions_out = 0
        self.echo_rows_skipped = 0
        self.status_updates_sent = 0
        self.spills = 0  # Spill pieces written to the spool
        self.spilled_changes = 0
        self.raw_inserts = 0  # inserts passed on undecoded (RawInsert)
        self.spill_peak_bytes = 0  # the most payload one transaction held in memory before it spilled
        self.early_transactions = 0  # transactions handed out at their first spill, before their commit
        self.early_streams = 0  # streamed transactions announced at their first spill (EarlyStream)
        self._announced: set[int] = set()  # their xids, while they are still open

    # ---------------------------------------------------------------- positions

    @property
    def confirmed_lsn(self) -> int:
        """What the caller has confirmed as durably handled."""
        return self._confirmed

    @property
    def delivered_lsn(self) -> int:
        """Position after the last transaction or message handed out."""
        return self._skip_before

    @property
    def received_lsn(self) -> int:
        return self._received

    def confirm(self, lsn: int) -> None:
        """The caller has durably handled everything before `lsn` (a transaction's `end_lsn`)."""
        if lsn > self._confirmed:
            self._confirmed = lsn
            self._confirm_event.set()

    def rewind(self, lsn: int) -> None:
        """Hand out everything again from `lsn` (>= the confirmed position): a lagging consumer re-reads.

        Nothing more from the current connection is handed out; the stream reconnects from `lsn` at once.
        """
        if lsn < self._confirmed:
            raise SourceError(
                f"cannot rewind to {format_lsn(lsn)}: the slot is confirmed to {format_lsn(self._confirmed)}",
                node=self.node,
            )
        self._rewind_to = lsn
        self._abort_connection(ConnectionLost("rewinding", node=self.node, lsn=lsn))

    def flush_position(self) -> int:
        """The flush position to report: the caller's, or the idle position once all is confirmed."""
        flush = self._confirmed
        if (
            self.options.advance_when_idle
            and flush >= self._delivered_high
            and self._rewind_to is None
            and self._assembler.idle
            and self._server_wal_end > flush
        ):
            flush = self._server_wal_end
        return flush

    # ---------------------------------------------------------------- connection

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        self.state = "connecting"
        try:
            conn = await psycopg.AsyncConnection.connect(
                self._dsn,
                replication="database",
                autocommit=True,
                application_name=self.options.application_name,
                connect_timeout=max(1, int(self.options.connect_timeout)),
            )
        except psycopg.Error as exc:
            raise self._wrap(exc, "cannot open the replication connection") from exc
        self._conn = conn
        return conn

    def _wrap(self, exc: BaseException, what: str) -> Exception:
        text = f"{what}: {describe(exc)}"
        state = getattr(exc, "sqlstate", None)
        if decide(exc) is Action.RETRY:
            return ConnectionLost(text, node=self.node, lsn=self._skip_before or None, sqlstate=state)
        return SourceError(text, node=self.node, lsn=self._skip_before or None, sqlstate=state)

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

    async def close(self) -> None:
        """Stop streaming and close the connection (the slot stays)."""
        task, self._status_task = self._status_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        conn, self._conn = self._conn, None
        self._streaming = False
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()
        if self.state != "failed":
            self.state = "stopped"

    # ---------------------------------------------------------------- commands

    async def identify_system(self) -> SystemInfo:
        rows = await self._command("IDENTIFY_SYSTEM")
        system_id, timeline, xlogpos, dbname = rows[0]
        return SystemInfo(str(system_id), int(timeline), parse_lsn(str(xlogpos)), dbname)

    async def create_slot(self, *, export_snapshot: bool = False, temporary: bool = False) -> SlotCreated:
        """CREATE_REPLICATION_SLOT ... LOGICAL pgoutput; with an exported snapshot held open if asked."""
        snapshot_mode = "export" if export_snapshot else "nothing"
        command = sql.SQL("CREATE_REPLICATION_SLOT {} {}LOGICAL pgoutput (SNAPSHOT {})").format(
            sql.Identifier(self.slot),
            sql.SQL("TEMPORARY " if temporary else ""),
            sql.Literal(snapshot_mode),
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
            snapshot = await hold_snapshot(self._dsn, str(snapshot_name), slot=self.slot, node=self.node,
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

    # ---------------------------------------------------------------- streaming

    def _start_command(self, lsn: int) -> bytes:
        o = self.options
        opts = [
            f"proto_version '{int(o.proto_version)}'",
            f"publication_names {publication_list(self.publications)}",
        ]
        if o.binary:
            opts.append("binary 'true'")
        if o.messages:
            opts.append("messages 'true'")
        if o.streaming and o.proto_version >= 2:
            opts.append("streaming 'true'")
        return f'START_REPLICATION SLOT "{self.slot}" LOGICAL {format_lsn(lsn)} ({", ".join(opts)})'.encode()

    async def _start(self, lsn: int) -> None:
        conn = await self._connect()
        pgconn = conn.pgconn
        pgconn.send_query(self._start_command(lsn))
        await self._flush_out(pgconn)
        while True:
            pgconn.consume_input()
            if not pgconn.is_busy():
                break
            await self._wait_readable(pgconn, self.options.receive_timeout)
        result = pgconn.get_result()
        if result is None or result.status != pq.ExecStatus.COPY_BOTH:
            message = result.error_message.decode(errors="replace").strip() if result else "no result"
            state = result.error_field(pq.DiagnosticField.SQLSTATE) if result else None
            code = state.decode() if state else None
            error_cls = SlotError if code in ("42704", "55006") else SourceError
            raise error_cls(
                f"START_REPLICATION on slot {self.slot!r} failed: {message}",
                node=self.node,
                lsn=lsn,
                sqlstate=code,
            )
        pgconn.nonblocking = 1
        self._streaming = True
        self.state = "streaming"
        self._starved_since = None
        logger.info("node %s: streaming slot %s from %s", self.node, self.slot, format_lsn(lsn))

    async def _wait_readable(self, pgconn: pq.abc.PGconn, limit: float | None) -> None:
        """Until the socket is readable; `_abort_connection` ends the wait with ConnectionLost."""
        loop = asyncio.get_running_loop()
        fd = pgconn.socket
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

    async def send_status(self, *, reply: bool = False) -> None:
        """Send a standby status update with the positions as they are now."""
        conn = self._conn
        if conn is None or not self._streaming:
            return
        async with self._send_lock:
            flush = self.flush_position()
            write = max(self._received, flush)
            now = unix_seconds_to_pg_us(self._clock())
            pgconn = conn.pgconn
            try:
                pgconn.put_copy_data(standby_status_update(write, flush, flush, now, reply))
                await self._flush_out(pgconn)
            except (psycopg.Error, OSError, TimeoutError) as exc:
                raise ConnectionLost(f"cannot send status update: {describe(exc)}", node=self.node) from exc
            self._last_status_sent = asyncio.get_running_loop().time()
            self.status_updates_sent += 1

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
                self._abort_connection()
                return
            try:
                await self.send_status(reply=silent > timeout / 2)
            except ConnectionLost:
                self._abort_connection()
                return

    def _abort_connection(self, reason: ConnectionLost | None = None) -> None:
        """Make the reader see a dead connection (it then reconnects)."""
        reading, self._reading = self._reading, None
        if reading is not None:
            fd, ready = reading
            asyncio.get_running_loop().remove_reader(fd)
            if not ready.done():
                lost = reason or ConnectionLost("receive timeout: the node stopped answering", node=self.node)
                ready.set_exception(lost)
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.pgconn.finish()

    def _read_available(self, pgconn: pq.abc.PGconn) -> list[memoryview] | None:
        """Up to _BATCH messages already received; [] when none; None when the COPY stream ended.

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
        result = pgconn.get_result()
        if result is not None and result.status == pq.ExecStatus.FATAL_ERROR:
            message = result.error_message.decode(errors="replace").strip()
            state = result.error_field(pq.DiagnosticField.SQLSTATE)
            code = state.decode() if state else None
            retry = code is None or decide_sqlstate(code) is Action.RETRY
            error_cls = ConnectionLost if retry else SourceError
            return error_cls(f"stream ended: {message}", node=self.node, lsn=self._received, sqlstate=code)
        return ConnectionLost("the server ended the replication stream", node=self.node, lsn=self._received)

    async def _frames(self, start_lsn: int) -> AsyncGenerator[list[memoryview], None]:
        """Batches of XLogData CopyData bodies from one connection; keepalives handled here."""
        await self._start(start_lsn)
        assert self._conn is not None
        pgconn = self._conn.pgconn
        loop = asyncio.get_running_loop()
        self._status_task = asyncio.create_task(self._status_loop(), name=f"pgmesh-status-{self.node}")
        try:
            while True:
                try:
                    batch = self._read_available(pgconn)
                except (psycopg.Error, OSError) as exc:
                    text = f"replication connection lost: {describe(exc)}"
                    raise ConnectionLost(text, node=self.node, lsn=self._received) from exc
                if batch is None:
                    raise self._end_of_copy(pgconn)
                if not batch:
                    if self._starved_since is None:
                        self._starved_since = loop.time()
                    try:
                        await self._wait_readable(pgconn, self.options.receive_timeout)
                    except TimeoutError:
                        continue  # the status loop decides when silence means death
                    except (psycopg.Error, OSError, ValueError) as exc:  # socket closed under us
                        raise ConnectionLost(f"replication socket closed: {exc}", node=self.node) from exc
                    continue
                self._starved_since = None
                self.bytes_received += sum(map(len, batch))
                frames: list[memoryview] = []
                append = frames.append
                reply = False
                for data in batch:
                    tag = data[0]
                    if tag == _XLOG_TAG:
                        append(data)
                    elif tag == _KEEPALIVE_TAG:
                        # Everything sent before this keepalive must be assembled and handed out before
                        # its WAL end may count as the idle position: yield the frames first.
                        if frames:
                            yield frames
                            frames = []
                            append = frames.append
                        reply = self._keepalive(data) or reply
                    else:
                        parse_copy_data(data)  # raises the right ProtocolError
                if frames:
                    yield frames
                if reply:
                    await self.send_status()
        finally:
            self._streaming = False
            task, self._status_task = self._status_task, None
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def _keepalive(self, data: memoryview) -> bool:
        """Record a primary keepalive; True when the server asks for an immediate reply."""
        keepalive = parse_copy_data(data)
        assert isinstance(keepalive, PrimaryKeepalive)
        self._server_wal_end = max(self._server_wal_end, keepalive.wal_end)
        self._received = max(self._received, keepalive.wal_end)
        return keepalive.reply_requested

    async def raw_frames(self, start_lsn: int = 0) -> AsyncGenerator[XLogData, None]:
        """XLogData frames from one connection, without decoding or reconnecting (captures, benches)."""
        async with contextlib.aclosing(self._frames(start_lsn)) as batches:
            async for batch in batches:
                for data in batch:
                    frame = parse_copy_data(data)
                    assert isinstance(frame, XLogData)
                    self._received = max(self._received, frame.wal_end)
                    yield frame

    async def stream(self) -> AsyncGenerator[Transaction | Message | EarlyStream, None]:
        """Committed transactions and non-transactional messages, in commit order, reconnecting as needed.

        Each item is handed out once; call `confirm(item.end_lsn)` (messages: `lsn + 1`) once it is durable.
        With `early_streamed`, also `EarlyStream` announcements (nothing to confirm: they are not
        transactions yet).
        """
        backoff = self.options.backoff_initial
        while True:
            try:
                async with contextlib.aclosing(self._stream_once()) as items:
                    async for item in items:
                        backoff = self.options.backoff_initial
                        yield item
            except ConnectionLost as exc:
                if self._rewind_to is not None:
                    self._skip_before, self._rewind_to = self._rewind_to, None
                    logger.info("node %s: re-reading from %s", self.node, format_lsn(self._skip_before))
                    await self.close()
                    continue
                self.last_error = str(exc)
                self.state = "reconnecting"
                self.reconnects += 1
                logger.warning("node %s: %s; reconnecting in %.1f s", self.node, exc, backoff)
                await self.close()
                self.state = "reconnecting"
                await asyncio.sleep(backoff * (0.5 + random.random() / 2))
                backoff = min(backoff * 2, self.options.backoff_max)
            except (SourceError, ProtocolError) as exc:
                self.last_error = str(exc)
                self.state = "failed"
                await self.close()
                if isinstance(exc, ProtocolError):
                    text = f"cannot decode the stream: {exc}"
                    raise SourceError(text, node=self.node, lsn=exc.lsn) from exc
                raise

    async def _stream_once(self) -> AsyncGenerator[Transaction | Message | EarlyStream, None]:
        if self._rewind_to is not None:
            self._skip_before, self._rewind_to = self._rewind_to, None
        self._decoder.reset()
        self._assembler.reset()
        self._announced.clear()
        try:
            async with contextlib.aclosing(self._frames(self._skip_before)) as batches:
                async for batch in batches:
                    done = self._assemble(batch)
                    if not done and (self._assembler.spilling or self._announced):
                        # Deep in a transaction that is being handed out early: let its appliers run
                        # (the socket may never run dry before the commit, so nothing else would yield).
                        await asyncio.sleep(0)
                    sent = 0
                    try:
                        for out in done:
                            if self._rewind_to is not None:
                                raise ConnectionLost("rewinding", node=self.node, lsn=self._rewind_to)
                            sent += 1
                            yield out
                    finally:
                        _discard_spills(done[sent:])  # never handed out (read again, or nobody asks)
                    if self._rewind_to is not None:
                        raise ConnectionLost("rewinding", node=self.node, lsn=self._rewind_to)
        finally:
            if self.spool is not None:  # the server sends the unfinished transactions again, whole
                self.spool.discard_open(self.node)

    def _assemble(self, batch: list[memoryview]) -> list[Transaction | Message | EarlyStream]:
        """Decode a batch of XLogData bodies; return what completed and was not handed out before.

        When a frame fails, nothing of the batch counts as handed out (a retry reads it all again).
        """
        decode = self._decoder.decode
        feed = self._assembler.feed
        wal_start_of = _WAL_START.unpack_from
        received = self._received
        skip_echoes = self.options.skip_echo_rows
        echo = self._assembler.in_echo
        spill_tail = self._assembler.spill_tail
        feed_rows = self._assembler.feed_rows
        spool = self.spool
        decoder = self._decoder
        raws = 0
        done: list[Transaction | Message | EarlyStream] = []
        handed = (self._skip_before, self._delivered_high, self.transactions_out)
        try:
            i, n = 0, len(batch)
            while i < n:
                data = batch[i]
                i += 1
                # A frame is 'w', WAL start, WAL end, send time, then the pgoutput message. It is read
                # in place; what is kept is copied once (by the decoder, or a raw row's bytes), and the
                # row of an echo not at all.
                try:
                    wal_start = wal_start_of(data, 1)[0]
                except struct.error:  # shorter than its header: decode() reports it as truncated
                    wal_start = int.from_bytes(data[1:9], "big")
                if wal_start > received:
                    received = wal_start
                size = len(data) - _XLOG_PAYLOAD
                tag = data[_XLOG_PAYLOAD] if size > 0 else -1  # the pgoutput message's
                if tag in _ROW_TAGS:
                    # Rows come in runs: the rest of this one that the batch holds is taken at once.
                    taken = skip_echoes and echo()
                    end = _row_run(batch, i, tag, taken)
                    if taken:
                        self.echo_rows_skipped += end - i + 1  # an echo's: nobody will look at them
                    elif end > i:  # inserts
                        run = batch[i - 1 : end]
                        try:
                            rows = raw_insert_run(run, _XLOG_PAYLOAD, streaming=decoder.in_stream)
                        except ProtocolError:
                            pass  # one by one, below: the bad one is reported with its LSN
                        else:
                            taken = True
                            raws += len(rows)
                            for part in feed_rows(rows, [len(d) - _XLOG_PAYLOAD for d in run], wal_start):
                                early = self._spill(part, wal_start)
                                if early is not None:
                                    done.append(early)
                    if taken:
                        if end > i:
                            received = max(received, wal_start_of(batch[end - 1], 1)[0])
                            i = end
                        continue
                if tag == _INSERT_TAG:
                    # Kept as the server sent it: decoded at the commit if it is still in memory then,
                    # else (the transaction spilled) to disk as it is, and from there into COPY.
                    message: PgOutputMessage | RawInsert = raw_insert(
                        data, _XLOG_PAYLOAD, streaming=decoder.in_stream, lsn=wal_start
                    )
                    raws += 1
                else:
                    message = decode(data, wal_start, _XLOG_PAYLOAD)
                    if tag in _COMMIT_TAGS and spool is not None and isinstance(message, _COMMITS):
                        # A transaction that spilled goes to disk whole, its last rows too (nothing of
                        # it is decoded at its commit).
                        tail = spill_tail(message)
                        if tail is not None:
                            early = self._spill(tail, wal_start)
                            if early is not None:
                                done.append(early)
                out = feed(message, wal_start, size)
                if out is None:
                    continue
                if isinstance(out, Transaction):
                    if out.spilled:
                        out = self._spilled(out)
                    if out.commit_lsn < self._skip_before:
                        _discard_spills([out])
                        continue  # resent after a reconnect: already handed out
                    self._skip_before = out.end_lsn
                    self._delivered_high = max(self._delivered_high, out.end_lsn)
                    self.transactions_out += 1
                elif isinstance(out, Message):
                    if out.lsn < self._skip_before:
                        continue
                    self._skip_before = out.lsn + 1
                    self._delivered_high = max(self._delivered_high, self._skip_before)
                else:
                    early = self._spill(out, wal_start)
                    if early is not None:
                        done.append(early)
                    continue
                done.append(out)
        except BaseException:
            self._skip_before, self._delivered_high, self.transactions_out = handed
            _discard_spills(done)
            raise
        finally:
            self._received = received  # also when a frame does not decode: it was received
            self.raw_inserts += raws
        return done

    def _spill(self, out: Spill | SpillDropped, lsn: int) -> Transaction | EarlyStream | None:
        """Part of an open transaction goes to the spool; or an aborted one's file goes away.

        At the first spill of a plain transaction (not streamed, not an echo, not handed out before a
        reconnect) returns it as it is so far, its file attached and growing (`SpillFile.grow`): handed
        out now, its appliers start while the rest arrives; its commit comes out later as the whole
        Transaction, with the same file (`SpillFile.final`). Its `end_lsn` is its commit LSN + 1 until
        then (after every earlier transaction, before its own end).
        """
        assert self.spool is not None  # the assembler spills only with a bound, and then there is one
        if isinstance(out, SpillDropped):
            self._announced.discard(out.xid)
            self.spool.drop(self.node, out.xid)
            return None
        try:
            handle = self.spool.write(self.node, out)
        except OSError as exc:
            raise ConnectionLost(
                f"cannot spill transaction {out.xid} to {self.spool.path}: {exc}; retrying from its start",
                node=self.node, lsn=lsn,
            ) from exc
        self.spills += 1
        self.spilled_changes += len(out.changes)
        self.spill_peak_bytes = max(self.spill_peak_bytes, out.nbytes)
        if handle.live:
            return None
        stream = self._assembler.open_stream(out.xid)
        if stream is not None:
            if not self.options.early_streamed or stream.origin is not None:
                return None
            handle.grow(early=False)
            handle.acquire()  # the source's own, until its commit is handed out (SpillFile.pinned)
            handle.pinned = True
            self._announced.add(out.xid)
            self.early_streams += 1
            return EarlyStream(msgspec.structs.replace(stream, spill=handle))
        if not self.options.early_spilled:
            return None
        txn = self._assembler.open_transaction()
        if txn is None or txn.origin is not None or txn.commit_lsn < self._skip_before:
            return None
        handle.grow()
        handle.acquire()  # the source's own, to the commit: the file must outlive holders that let go
        self.early_transactions += 1
        return msgspec.structs.replace(txn, end_lsn=txn.commit_lsn + 1, spill=handle)

    def _spilled(self, txn: Transaction) -> Transaction:
        """A transaction that spilled, with its closed spill file attached (and, when it was handed out
        early, completed: its readers see the commit)."""
        handle = self.spool.finish(self.node, txn.xid) if self.spool is not None else None
        if handle is None:
            raise SourceError(f"transaction {txn.xid} spilled but its spill file is missing", node=self.node,
                              lsn=txn.commit_lsn)
        final = msgspec.structs.replace(txn, spill=handle)
        self._announced.discard(txn.xid)
        if handle.live:
            handle.complete(final)
        if handle.early:
            handle.release()  # the source's (taken at grow); the links that took it hold theirs
        return final


def _row_run(batch: list[memoryview], start: int, tag: int, echo: bool) -> int:
    """Where the run of row messages that `batch[start - 1]` (tag `tag`) opens ends: the inserts right
    after an insert, or, in an echo, every row message right after a row (`start` when none)."""
    end, n = start, len(batch)
    try:
        if echo:
            while end < n and batch[end][_XLOG_PAYLOAD] in _ROW_TAGS:
                end += 1
        elif tag == _INSERT_TAG:
            while end < n and batch[end][_XLOG_PAYLOAD] == _INSERT_TAG:
                end += 1
    except IndexError:  # a frame without a message: the loop reports it
        pass
    return end


def _discard_spills(items: list[Transaction | Message | EarlyStream]) -> None:
    """Delete the spill files of transactions that will not be handed out after all."""
    for item in items:
        if isinstance(item, Transaction) and item.spill is not None:
            item.spill.discard()
