"""One logical replication source per node: positions, assembly, spill, and handing out transactions.

A `ReplicationSource` streams one node's logical slot through its `ReplicationConnection` (the I/O
shell, `router.stream.connection`: replication commands, START_REPLICATION, CopyData batches,
keepalives and status updates) and turns the batches of XLogData frames it reads into whole committed
transactions (and non-transactional logical messages), decoded once by `protocol/`, handed out in
commit order. `feed` takes one batch and returns what completed: a unit test feeds it captured bytes.
A transaction bigger than `SourceOptions.spill_bytes` is written to a `router.stream.spool.Spool` as it
arrives, its tail too at its commit, and handed out on disk (`Transaction.spill`). Inserts are decoded
only at a commit that finds them in memory (`RawInsert`: a spilled row goes on to COPY as sent). With
`early_streamed`, a streamed (in-progress) transaction is also announced at its first spill
(`EarlyStream`), so that appliers may start on it before it commits; it is still handed out at its
commit, in commit order. Its state (`router.stream.state.Lifecycle`) and counters (`SourceStats`) are
read by the supervisor and the metrics.

What it guarantees its caller:
- Pull-based backpressure: nothing is read from the socket while the caller is not asking for more, yet
  status updates go out on their own timer so the walsender never times the link out.
- The flush position reported to the server is only ever what the caller passed to `confirm()` (or, when
  every delivered transaction is confirmed and nothing is half received, the server's own idle position),
  and never past its `ceiling` when it has one (a joining node's pin).
- Reconnect with backoff after a connection loss, resuming after the last transaction handed out: no
  transaction is lost (the slot keeps everything after the confirmed position) and none is handed out
  twice (transactions the server resends from before that point are dropped here). `lost_since` says
  since when the stream has been lost (None while it streams, or is only re-reading after a rewind), so
  that the links out of a node that stopped show it at once (router.service.report).

It must not touch the socket or libpq (the connection does), apply anything, decide about echoes, or
know about other nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import struct
import time
from collections.abc import AsyncGenerator, Callable
from typing import Final

import msgspec

from protocol.errors import ProtocolError
from protocol.lsn import format_lsn
from protocol.messages import Commit, Message, PgOutputMessage, RawInsert, StreamCommit
from protocol.pgoutput import Decoder, raw_insert, raw_insert_run
from protocol.replication import XLogData, parse_copy_data
from protocol.transactions import Spill, SpillDropped, Transaction, TransactionAssembler
from router import failpoints
from router.errors import ConnectionLost, SlotError, SourceError
from router.stream.connection import Frames, ReplicationConnection
from router.stream.items import EarlyStream, SourceOptions, StreamSettings, SystemInfo
from router.stream.slots import SlotCreated, SlotInfo, check_slot_name
from router.stream.spool import Spool
from router.stream.state import Lifecycle, SourceState, SourceStats

__all__ = ["ReplicationSource"]

logger = logging.getLogger(__name__)

_WAL_START: Final = struct.Struct(">Q")  # after the 'w' of an XLogData body
_ROW_TAGS: Final = frozenset(b"IUD")
_INSERT_TAG: Final = 0x49  # 'I'
_COMMIT_TAGS: Final = frozenset(b"Cc")  # Commit, Stream Commit
_COMMITS: Final = (Commit, StreamCommit)
_BUSY_S: Final = 30.0  # how long a slot found active (55006) is taken for this router's own walsender exiting
_XLOG_PAYLOAD: Final = 25  # 'w' + WAL start, WAL end, send time

Item = Transaction | Message | EarlyStream


class ReplicationSource:
    """The decoded stream from one node's slot, over its replication connection."""

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
        ceiling: int | None = None,
    ) -> None:
        """`spool`: where transactions over `options.spill_bytes` go (shared by a router's sources);
        without one, the source makes its own when it has a bound. `ceiling`: the slot is never reported
        flushed past it. Nothing connects until asked."""
        self.node = node
        self.ceiling = ceiling
        self.slot = check_slot_name(slot, node)
        self.publications = tuple(publications)
        self.options = options or SourceOptions()
        self.stats = SourceStats()
        self._life = Lifecycle(node)
        self.connection = ReplicationConnection(
            node, dsn, self.slot, self.publications, self.options, self,
            life=self._life, stats=self.stats, clock=clock,
        )
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
        self._announced: set[int] = set()  # xids of streamed transactions announced, while still open
        self._clock = clock
        self.lost_since: float | None = None  # since when the connection is lost and not back (`stream`)

    # ---------------------------------------------------------------- state

    @property
    def state(self) -> SourceState:
        return self._life.state

    @property
    def last_error(self) -> str | None:
        return self._life.last_error

    def mark_error(self, error: str, *, detail: str = "") -> None:
        """Its owner saw the stream stop on `error` (and will retry): the state says so until then."""
        self._life.to(SourceState.ERROR, error=error, detail=detail)

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

    def on_keepalive(self, wal_end: int) -> None:
        """The server's WAL end from a keepalive: everything before it was sent (or is not for us). A
        synchronous source (`options.synchronous`) answers one that moves it at once."""
        if wal_end > self._server_wal_end and self.options.synchronous:
            self.connection.nudge()
        self._server_wal_end = max(self._server_wal_end, wal_end)
        self._received = max(self._received, wal_end)

    def on_stream_start(self, settings: StreamSettings) -> None:
        """The connection started streaming with `settings` (before its first frame): decode as it sends."""
        self.lost_since = None
        self._decoder.reset(abort_info=settings.abort_info)

    def confirm(self, lsn: int) -> None:
        """The caller has durably handled everything before `lsn` (a transaction's `end_lsn`)."""
        if lsn > self._confirmed:
            self._confirmed = lsn
            self.connection.nudge()

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
        self.connection.abort(ConnectionLost("rewinding", node=self.node, lsn=lsn))

    def flush_position(self) -> int:
        """The flush position to report: the caller's, or the idle position once all is confirmed; never
        past `ceiling` (a joining node's pin, router.cluster.joining)."""
        out = self.idle_position(self._confirmed) if self.options.advance_when_idle else self._confirmed
        return out if self.ceiling is None else min(out, self.ceiling)

    def idle_position(self, lsn: int) -> int:
        """`lsn`, a position up to which everything handed out is handled; the server's WAL end instead
        when nothing was handed out past `lsn` and nothing is being received: what came after was not for
        us."""
        if (
            lsn >= self._delivered_high
            and self._rewind_to is None
            and self._assembler.idle
            and self._server_wal_end > lsn
        ):
            return self._server_wal_end
        return lsn

    # ---------------------------------------------------------------- the connection's commands

    async def close(self) -> None:
        """Stop streaming and close the connection (the slot stays)."""
        await self.connection.disconnect()
        if self._life.state is not SourceState.FAILED:
            self._life.to(SourceState.STOPPED)

    async def send_status(self, *, reply: bool = False) -> None:
        """Send a standby status update with the positions as they are now."""
        await self.connection.send_status(reply=reply)

    async def identify_system(self) -> SystemInfo:
        return await self.connection.identify_system()

    async def create_slot(self, *, export_snapshot: bool = False, temporary: bool = False) -> SlotCreated:
        """CREATE_REPLICATION_SLOT ... LOGICAL pgoutput; with an exported snapshot held open if asked."""
        return await self.connection.create_slot(export_snapshot=export_snapshot, temporary=temporary)

    async def drop_slot(self, *, wait: bool = True, missing_ok: bool = False) -> bool:
        """DROP_REPLICATION_SLOT; returns False when it did not exist and `missing_ok`."""
        return await self.connection.drop_slot(wait=wait, missing_ok=missing_ok)

    async def slot_info(self) -> SlotInfo | None:
        """The slot's row in pg_replication_slots (over a short-lived normal connection)."""
        return await self.connection.slot_info()

    # ---------------------------------------------------------------- streaming

    async def raw_frames(self, start_lsn: int = 0) -> AsyncGenerator[XLogData, None]:
        """XLogData frames from one connection, without decoding or reconnecting (captures, benches)."""
        async with contextlib.aclosing(self.connection.frames(start_lsn)) as batches:
            async for batch in batches:
                for data in batch:
                    frame = parse_copy_data(data)
                    assert isinstance(frame, XLogData)
                    self._received = max(self._received, frame.wal_end)
                    yield frame

    async def stream(self) -> AsyncGenerator[Item, None]:
        """Committed transactions and non-transactional messages, in commit order, reconnecting as needed.

        Each item is handed out once; call `confirm(item.end_lsn)` (messages: `lsn + 1`) once it is durable.
        With `early_streamed`, also `EarlyStream` announcements (nothing to confirm: they are not
        transactions yet).
        """
        backoff = self.options.backoff_initial
        busy_since: float | None = None  # since when START_REPLICATION finds the slot active (55006)
        while True:
            try:
                async with contextlib.aclosing(self._stream_once()) as items:
                    async for item in items:
                        backoff = self.options.backoff_initial
                        busy_since = None
                        yield item
            except SlotError as exc:
                # "active for PID n": most likely this router's own walsender of a moment ago, still
                # exiting after a reconnect or a rewind: retried for a while, then the error stands (another
                # process holds the slot)
                now = self._clock()
                busy_since = now if busy_since is None else busy_since
                if exc.sqlstate != "55006" or now - busy_since > _BUSY_S:
                    self._life.to(SourceState.FAILED, error=str(exc))
                    await self.connection.disconnect()
                    raise
                self._life.to(SourceState.RECONNECTING, error=str(exc), detail=f"retrying in {backoff:.1f} s")
                await self.connection.disconnect()
                await asyncio.sleep(backoff * (0.5 + random.random() / 2))
                backoff = min(backoff * 2, self.options.backoff_max)
                continue
            except ConnectionLost as exc:
                busy_since = None
                if self._rewind_to is not None:
                    self._skip_before, self._rewind_to = self._rewind_to, None
                    logger.info("node %s: re-reading from %s", self.node, format_lsn(self._skip_before))
                    await self.connection.disconnect()
                    continue
                self._life.to(SourceState.RECONNECTING, error=str(exc), detail=f"retrying in {backoff:.1f} s")
                if self.lost_since is None:
                    self.lost_since = self._clock()
                self.stats.reconnects += 1
                await self.connection.disconnect()
                await asyncio.sleep(backoff * (0.5 + random.random() / 2))
                backoff = min(backoff * 2, self.options.backoff_max)
            except (SourceError, ProtocolError) as exc:
                self._life.to(SourceState.FAILED, error=str(exc))
                await self.connection.disconnect()
                if isinstance(exc, ProtocolError):
                    text = f"cannot decode the stream: {exc}"
                    raise SourceError(text, node=self.node, lsn=exc.lsn) from exc
                raise

    async def _stream_once(self) -> AsyncGenerator[Item, None]:
        if self._rewind_to is not None:
            self._skip_before, self._rewind_to = self._rewind_to, None
        self.restart()
        try:
            async with contextlib.aclosing(self.connection.frames(self._skip_before)) as batches:
                async for batch in batches:
                    done = self.feed(batch)
                    if not done and (self._assembler.spilling or self._announced):
                        # Deep in a transaction that is being handed out early: let its appliers run
                        # (the socket may never run dry before the commit, so nothing else would yield).
                        await asyncio.sleep(0)
                        if failpoints.ARMED:  # a test's: spilling, commit not read (router.failpoints)
                            await failpoints.hit("source.spilling")
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

    # ---------------------------------------------------------------- assembly

    def restart(self) -> None:
        """The next frames come on a new connection, from the delivered position: decode afresh.

        What the server sends again from before that position is dropped by `feed`.
        """
        self._decoder.reset()
        self._assembler.reset()
        self._announced.clear()

    def feed(self, batch: Frames) -> list[Item]:
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
        done: list[Item] = []
        handed = (self._skip_before, self._delivered_high, self.stats.transactions_out)
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
                        self.stats.echo_rows_skipped += end - i + 1  # an echo's: nobody will look at them
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
                    self.stats.transactions_out += 1
                elif isinstance(out, Message):
                    # A non-transactional message carries the END of its WAL record (decode.c passes
                    # `buf->endRecPtr`): a commit record right after it starts there, so a transaction
                    # whose commit LSN is the message's LSN comes after it and must not count as resent
                    # (a pgmesh.applied note on a 16+ node made the next commit vanish: issue 19).
                    if out.lsn <= self._skip_before:
                        continue  # resent (or ended where decoding starts: the server skips it too)
                    self._skip_before = out.lsn
                    self._delivered_high = max(self._delivered_high, self._skip_before)
                else:
                    early = self._spill(out, wal_start)
                    if early is not None:
                        done.append(early)
                    continue
                done.append(out)
        except BaseException:
            self._skip_before, self._delivered_high, self.stats.transactions_out = handed
            _discard_spills(done)
            raise
        finally:
            self._received = received  # also when a frame does not decode: it was received
            self.stats.raw_inserts += raws
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
        self.stats.spills += 1
        self.stats.spilled_changes += len(out.changes)
        self.stats.spill_peak_bytes = max(self.stats.spill_peak_bytes, out.nbytes)
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
            self.stats.early_streams += 1
            return EarlyStream(msgspec.structs.replace(stream, spill=handle))
        if not self.options.early_spilled:
            return None
        txn = self._assembler.open_transaction()
        if txn is None or txn.origin is not None or txn.commit_lsn < self._skip_before:
            return None
        handle.grow()
        handle.acquire()  # the source's own, to the commit: the file must outlive holders that let go
        self.stats.early_transactions += 1
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
            handle.drop_ref()  # the source's (taken at grow); the links that took it hold theirs
        return final


def _row_run(batch: Frames, start: int, tag: int, echo: bool) -> int:
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


def _discard_spills(items: list[Item]) -> None:
    """Delete the spill files of transactions that will not be handed out after all."""
    for item in items:
        if isinstance(item, Transaction) and item.spill is not None:
            item.spill.discard()
