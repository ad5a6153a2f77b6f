"""The router's log of one source: its committed transactions on disk, written once, read by links behind.

From the router's start (`activate(since)`, or what an earlier run left: `open()`), the fan-out
(router.stream.fanout) appends every committed transaction of the source that a target may need, once
(`append`), before handing it to any link. It is only held (`hold_bytes` of them at most, a spilled one's
file kept, for `hold_ticks` progress ticks at most) while every link keeps up (`forget`): once every
link's target has flushed it, nobody can need it from the log and it is never written (the common case:
links that keep up cost the log a list append); when a link falls behind, or the bounds are reached, it is
encoded. Encoded ones are made durable together by one group fsync (`run`: at most every `fsync_ms`, in a
thread); `durable` is the source position before which everything the log must hold is on disk (encoded
and synced, or flushed by every target), so the source's slot can be confirmed that far on the account of
every link whose own position is past `since` (router.progress.positions). A link that fell behind reads the
log
from its position (`reader(after)`: router.stream.log.reader, which has what is held encoded first) instead
of holding the source's WAL.

The log is continuous from `since`: it holds every transaction ending after it that some target had not
flushed when the log let go of it (flushed positions never go back: no reader ever needs the others).
Segments of `segment_bytes` are deleted once every link is past them (`truncate_before`). When `size`
reaches `cap_bytes` it stops growing (`stop_appending`): links that fall behind then re-read the source,
whose slot keeps the WAL (the stated policy, docs/scale.md); once nobody needs it, it is deleted whole
(`reset`) and a new one starts at a later `since` (router.service.logs).

On disk, one directory per source: `identity` (the source node's system identifier: a log is never read
against another server), `log-id` (a name for this log, recorded on the node: router.service.logs),
segments `NNNNNNNNNN.seg` (the format: router.stream.log.format) and the spill files of big transactions
linked beside them (`NNNNNNNNNN-<xid>-<n>.spill`, deleted with their segment). `open()` reads every
segment back: a record cut short or failing its CRC (a crash in the middle of a write), a transaction
without its end, or a linked file missing end the log there; the rest is truncated.

Must not: decide which link reads what (router.stream.fanout), or talk to a database.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import struct
import uuid
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import cast

from protocol.lsn import format_lsn
from protocol.messages import Relation
from protocol.transactions import Change, Transaction
from router import failpoints
from router.errors import PgmeshError
from router.stream.log.files import fsync_all, write_durably
from router.stream.log.format import (
    BEGIN,
    BIG_CHANGES,
    ENCODER,
    END,
    FINISH,
    FRAMES,
    LENGTH,
    LINKED,
    LINKED_DECODER,
    MAGIC,
    META_DECODER,
    RECORD,
    RELATION,
    SEGMENT_HEADER,
    WHOLE,
    Linked,
    Meta,
    Segment,
    meta_bytes,
)
from router.stream.log.reader import LogReader
from router.stream.spool import SpillFile, Spool, encode_changes, iter_raw_chunks

__all__ = ["LogReader", "SourceLog", "write_durably"]

logger = logging.getLogger(__name__)

_HEAD = struct.Struct(">II")  # a record's length and CRC (its kind follows)
_T_PLACEHOLDER = b"\0" * 8 + WHOLE + b"\0" * 4
_HELD_OVERHEAD = 256  # bytes of Python objects a held transaction keeps beside its payload (a guess)

class SourceLog:
    """The append-only log of one source node; see the module docstring."""

    def __init__(
        self, directory: Path, node: str, *, identity: str | None, spool: Spool,
        segment_bytes: int = 64 << 20, cap_bytes: int = 10 << 30, fsync_ms: int = 20,
        position: Callable[[], int] | None = None, hold_bytes: int = 64 << 20, hold_ticks: int = 10,
    ) -> None:
        """`position`: the source position the fan-out has passed (everything before it that a target
        needs was appended); read at each fsync to move `durable`. `hold_bytes`, `hold_ticks`: at most
        this much of small transactions is held unencoded, for at most this many releases (`forget`)."""
        self.directory = directory
        self.node = node
        self.identity = identity
        self.spool = spool
        self.segment_bytes = segment_bytes
        self.cap_bytes = cap_bytes
        self.fsync_s = fsync_ms / 1000
        self.hold_bytes = hold_bytes
        self._ticks: collections.deque[int] = collections.deque(maxlen=max(hold_ticks, 1))
        self.since: int | None = None  # the log holds every needed transaction after this; None: no log
        # the targets it holds them for, recorded when it starts (file `targets`): a node that joined since
        # may lack transactions every target then had and the log let go of; None: a log from before
        self.targets: frozenset[str] | None = None
        self.end = 0  # end LSN of the last transaction appended
        self._position: Callable[[], int] = position or (lambda: self.end)
        self.durable = 0  # source position: everything needed before it is on disk
        self.appending = False  # False once it stopped growing (closing, or full)
        self._segments: list[Segment] = []
        self._disk = 0  # bytes of the segments and their linked files (kept up to date: `full` is hot)
        self._fd: int | None = None
        self._buf = bytearray()
        self._frames = bytearray()
        self._described: dict[int, Relation] = {}  # relations described in the current segment
        # appended small transactions not encoded yet (`append`, `forget`), their bytes (with a guess at
        # their objects' own), and the end of the one appended before the first of them (everything up to
        # there is encoded, or flushed everywhere); `_ticks`: `appended` at each of the last releases
        self._pending: collections.deque[Transaction] = collections.deque()
        self._pending_bytes = 0
        self._floor = 0
        self._pending_sync: list[int] = []  # descriptors of finished segments to fsync and close
        self._pending_files: list[Path] = []  # spill files linked in since the last fsync
        self._dirty = asyncio.Event()
        self._limit: int | None = None  # where `durable` stops once nothing more is appended
        self._syncing = False
        self.log_id = ""  # read or made by open()
        self.settled = True  # whether its own files (identity, name) are durable (`_write_meta`)
        self.appended = 0  # transactions appended (stats)
        self.bytes_appended = 0
        # a synchronous source's (docs/synchronous.md): while a link is behind (the last `forget` said
        # so), encode at each append, and call `on_durable` whenever `durable` moves
        self.eager = False
        self._behind = False
        self.on_durable: Callable[[], None] | None = None

    # ------------------------------------------------------------ state

    @property
    def active(self) -> bool:
        return self.since is not None

    @property
    def size(self) -> int:
        """Bytes on disk (and buffered)."""
        return self._disk + len(self._buf)

    @property
    def full(self) -> bool:
        return self.size >= self.cap_bytes

    @property
    def holds_anything(self) -> bool:
        """Whether any transaction was ever written to it (by this run, or left by an earlier one)."""
        return self.bytes_appended > 0 or any(s.last for s in self._segments)

    @property
    def first(self) -> int:
        """End LSN of the oldest transaction still in the log (0: none)."""
        return next((s.first for s in self._segments if s.first), 0)

    def covers(self, after: int, target: str) -> bool:
        """Whether every transaction `target` needs ending after `after` is in the log, up to `end`."""
        return (self.since is not None and self.since <= after
                and (self.targets is None or target in self.targets))

    # ------------------------------------------------------------ opening and recovery

    def open(self) -> None:
        """Read back what an earlier run left (torn tail truncated); the log is active if anything is left."""
        self.directory.mkdir(parents=True, exist_ok=True)
        ident = self.directory / "identity"  # the source's system identifier
        if ident.exists() and self.identity is not None:
            found = ident.read_text().strip()
            if found != self.identity:
                raise PgmeshError(
                    f"the router log in {self.directory} belongs to another server (system identifier"
                    f" {found}, this node's is {self.identity}): the node was rebuilt, or two clusters share"
                    " the directory; move it away (or set [log] directory), then check the nodes with"
                    " `pgmesh compare`", node=self.node,
                )
        elif self.identity is not None:
            self._write_meta(ident, self.identity.encode())
        for path in sorted(self.directory.glob("*.seg")):
            if not self._recover(path):
                break
        self._disk = sum(s.size + s.linked for s in self._segments)
        for later in sorted(self.directory.glob("*.seg"))[len(self._segments):]:
            logger.warning("node %s: router log segment %s follows a torn record: deleted", self.node, later)
            later.unlink()
        if self._segments and self.end:
            self.appending = True
            with contextlib.suppress(FileNotFoundError):
                self.targets = frozenset(json.loads((self.directory / "targets").read_bytes()))
            self.durable = self.end
            self._fd = os.open(self._segments[-1].path, os.O_WRONLY | os.O_APPEND)
            logger.info("node %s: router log holds %.1f MB after %s up to %s", self.node, self.size / 1e6,
                        format_lsn(self.since or 0), format_lsn(self.end))
        else:
            self._delete_all()
        id_file = self.directory / "log-id"  # names this directory's log on the node (router.service.logs)
        if not id_file.exists():
            self._write_meta(id_file, uuid.uuid4().hex.encode())
        self.log_id = id_file.read_text().strip()

    def _write_meta(self, path: Path, data: bytes) -> None:
        """Write a small file whole (replaced atomically); it is made durable by the next `sync` (in a
        thread: a start never waits on a disk busy with the nodes' writes), which the caller runs before
        anything relies on it (router.service.logs: before the log's name is recorded on the node)."""
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        self._pending_files.append(path)
        self.settled = False

    def _recover(self, path: Path) -> bool:
        """Read one segment; False when it ends torn (it is truncated there; later ones are dropped)."""
        data = path.read_bytes()
        seg = Segment(path, int(path.stem), 0)
        if len(data) < SEGMENT_HEADER.size:
            path.unlink()
            return False
        magic, since, crc = SEGMENT_HEADER.unpack_from(data)
        if magic != MAGIC or crc != zlib.crc32(data[:16]):
            path.unlink()
            return False
        if self.since is None:
            self.since = since
        elif since != self.since:  # another log's segment: an earlier one was not deleted whole
            path.unlink()
            return False
        pos = good = SEGMENT_HEADER.size
        first = last = 0
        open_txn = False
        while pos + RECORD.size <= len(data):
            length, crc, kind = RECORD.unpack_from(data, pos)
            body = data[pos + 8 : pos + 8 + length]
            if len(body) < length or zlib.crc32(body) != crc:
                break
            pos += 8 + length
            if kind == LINKED and not open_txn:
                linked = LINKED_DECODER.decode(meta_bytes(body))
                try:
                    seg.linked += (self.directory / linked.file).stat().st_size
                except FileNotFoundError:
                    pos -= 8 + length  # its file is gone: the log ends before it
                    break
                first = first or linked.meta.end_lsn
                last = linked.meta.end_lsn
                good = pos
            elif kind in (WHOLE, FINISH):
                end = (END.unpack_from(body, 1)[0] if kind == FINISH
                       else META_DECODER.decode(meta_bytes(body)).end_lsn)
                first = first or end
                last = end
                good = pos
                open_txn = False
            elif kind in (BEGIN, FRAMES):
                open_txn = True
            elif kind == RELATION and not open_txn:
                pass
            else:
                break
        torn = good < len(data)
        if torn:
            logger.warning("node %s: router log %s: %d bytes after %s cut off (a torn write or an unfinished"
                           " transaction)", self.node, path.name, len(data) - good, format_lsn(last))
            with open(path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        seg.size, seg.first, seg.last = good, first, last
        self._segments.append(seg)
        self.end = max(self.end, last)
        return not torn

    # ------------------------------------------------------------ writing

    def activate(self, since: int, targets: Iterable[str]) -> None:
        """Start a log continuous after `since` for `targets` (the caller appends every transaction one of
        them needs after it)."""
        if self.since is not None:
            raise PgmeshError("the router log is already active", node=self.node)
        self.targets = frozenset(targets)
        self._write_meta(self.directory / "targets", json.dumps(sorted(self.targets)).encode())
        self.since = since
        self.end = max(self.end, since)
        self.durable = since
        self._floor = self.end
        self.appending = True
        self._limit = None
        self._roll()
        logger.info("node %s: router log started after %s in %s", self.node, format_lsn(since),
                    self.directory)

    def stop_appending(self, position: int) -> None:
        """Nothing more is appended (it reached its cap, or nobody needs it): `durable` stops at
        `position`, the source position passed when it stopped."""
        self.appending = False
        self._limit = position

    def append(self, txn: Transaction) -> None:
        """Append a committed transaction (its whole changes, spilled part included).

        It is only held here (see `forget`; a spilled one keeps its spill file alive meanwhile, one
        holder more); one whose spilled part is not in a file of its own is written at once, after every
        one held before it."""
        if not self._pending:
            self._floor = self.end
        self.end = txn.end_lsn
        self.appended += 1
        if txn.spilled and not isinstance(txn.spill, SpillFile):
            self._encode_pending(len(self._pending))
            if not self._dirty.is_set():
                self._dirty.set()
            self._encode(txn)
            return
        if txn.spilled:
            cast(SpillFile, txn.spill).acquire()
        self._pending.append(txn)
        self._pending_bytes += _held_bytes(txn)
        if self._pending_bytes > self.hold_bytes:
            self._encode_pending(len(self._pending) // 2 + 1)
        if self.eager and self._behind:
            self._encode_pending(len(self._pending))

    def forget(self, flushed: int, *, behind: bool = False) -> None:
        """At each progress tick: forget the held transactions that every link's target has flushed
        (`flushed`: the least of their positions; nobody can need them from the log); then encode every
        one still held if a link is `behind` (down, held, detached or reading the log: it needs them from
        the log), else those held for `hold_ticks` releases."""
        self._behind = behind
        pending = self._pending
        while pending and pending[0].end_lsn <= flushed:
            self._let_go(pending.popleft())
        ticks = self._ticks
        ticks.append(self.appended)
        if behind:
            self._encode_pending(len(pending))
        elif len(ticks) == ticks.maxlen:  # appended before the oldest release remembered: held long enough
            self._encode_pending(ticks[0] - (self.appended - len(pending)))

    def _let_go(self, txn: Transaction) -> None:
        """A held transaction is encoded or no longer needed."""
        self._floor = txn.end_lsn
        self._pending_bytes -= _held_bytes(txn)
        if txn.spilled:
            cast(SpillFile, txn.spill).drop_ref()

    def _encode_pending(self, count: int) -> None:
        """Encode the `count` oldest held transactions."""
        pending = self._pending
        count = min(count, len(pending))
        if count <= 0:
            return
        if not self._dirty.is_set():
            self._dirty.set()
        for _ in range(count):  # (taken off first: encoding may roll a segment, which writes)
            txn = pending.popleft()
            try:
                self._encode(txn)
            finally:
                self._let_go(txn)

    def _encode(self, txn: Transaction) -> None:
        described = self._described
        for relid, relation in txn.relations.items():
            if described.get(relid) is not relation:  # (the source hands out one object until it changes)
                described[relid] = relation
                self._record(RELATION, b"", ENCODER.encode(relation))
        described_meta = Meta(
            txn.xid, txn.commit_lsn, txn.end_lsn, txn.commit_time, txn.nbytes, txn.row_count, txn.streamed,
            txn.seen, list(txn.relations),
        )
        frames = self._frames
        frames.clear()
        if not txn.spilled and len(txn.changes) <= BIG_CHANGES:
            self._whole(described_meta, txn.changes)
        elif txn.spilled and self._link(txn, frames):
            pass  # its spill file is in the log's directory now: no copy
        else:
            self._record(BEGIN, ENCODER.encode(described_meta), b"")
            for chunk in iter_raw_chunks(txn, BIG_CHANGES):
                frames.clear()
                encode_changes(chunk, frames)
                self._record(FRAMES, b"", frames)
                if len(self._buf) >= 1 << 20:
                    self._write()  # (no reader runs before the whole transaction is written)
            self._record(FINISH, b"", END.pack(txn.end_lsn))
        seg = self._segments[-1]
        seg.first = seg.first or txn.end_lsn
        seg.last = txn.end_lsn
        if len(self._buf) >= 1 << 20:
            self._write()
        if seg.size + len(self._buf) >= self.segment_bytes:
            self._roll()

    def _whole(self, meta: Meta, changes: list[Change]) -> None:
        """A `T` record, encoded in place at the end of the buffer (the hot path: one-row transactions)."""
        buf = self._buf
        start = len(buf)
        buf += _T_PLACEHOLDER  # length, CRC, kind, the description's length: filled in below
        ENCODER.encode_into(meta, buf, -1)
        LENGTH.pack_into(buf, start + 9, len(buf) - start - 13)
        encode_changes(changes, buf)
        end = len(buf)
        with memoryview(buf) as view:
            crc = zlib.crc32(view[start + 8 : end])
        _HEAD.pack_into(buf, start, end - start - 8, crc)
        self.bytes_appended += end - start

    def _link(self, txn: Transaction, frames: bytearray) -> bool:
        """Link a spilled transaction's file into the log's directory and append an `S` record naming it
        (its in-memory tail with it); False when the file cannot be linked (another file system)."""
        spill = txn.spill
        if not isinstance(spill, SpillFile) or spill.deleted:
            return False
        seg = self._segments[-1]
        name = f"{seg.seq:010d}-{txn.xid}-{self.appended}.spill"
        try:
            os.link(spill.path, self.directory / name)
        except OSError:
            return False
        self._pending_files.append(self.directory / name)
        seg.linked += spill.size
        self._disk += spill.size
        meta = Meta(txn.xid, txn.commit_lsn, txn.end_lsn, txn.commit_time, txn.nbytes, txn.row_count,
                     txn.streamed, txn.seen, list(txn.relations))
        head = ENCODER.encode(
            Linked(meta, name, txn.spilled, spill.nbytes, txn.aborted_subxids, tuple(sorted(txn.prefixes)))
        )
        encode_changes(txn.changes, frames)
        self._record(LINKED, LENGTH.pack(len(head)) + head, frames)
        return True

    def _record(self, kind: bytes, head: bytes, body: bytes | bytearray) -> None:
        crc = zlib.crc32(body, zlib.crc32(head, zlib.crc32(kind)))
        self._buf += RECORD.pack(1 + len(head) + len(body), crc, kind)
        self._buf += head
        self._buf += body
        self.bytes_appended += 9 + len(head) + len(body)

    def _write(self) -> None:
        """Hand the buffer to the OS (no fsync): readers and the next fsync see it."""
        if self._buf and self._fd is not None:
            with memoryview(self._buf) as view:
                done = 0
                while done < len(view):
                    done += os.write(self._fd, view[done:])
            self._segments[-1].size += len(self._buf)
            self._disk += len(self._buf)
            self._buf.clear()

    def _roll(self) -> None:
        """Start a new segment (the current one is fsynced and closed by the next group fsync)."""
        self._write()
        if self._fd is not None:
            self._pending_sync.append(self._fd)
        seq = self._segments[-1].seq + 1 if self._segments else 1
        path = self.directory / f"{seq:010d}.seg"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        if failpoints.ARMED and self._fd is not None:  # a test's: a switch, its new segment still empty
            failpoints.hit_now("log.segment_switch")
        header = bytearray(SEGMENT_HEADER.pack(MAGIC, self.since or 0, 0))
        struct.pack_into(">I", header, 16, zlib.crc32(header[:16]))
        os.write(fd, header)
        self._fd = fd
        self._described = {}  # every segment describes the relations it uses: a reader starts at one
        self._segments.append(Segment(path, seq, len(header)))
        self._disk += len(header)
        self._pending_sync.append(-1)  # the directory: the new file's name must be durable too

    async def run(self) -> None:
        """Group fsync: after each batch of appends (at most every `fsync_ms`), make them durable."""
        while True:
            await self._dirty.wait()
            await asyncio.sleep(self.fsync_s)
            await self.sync()

    async def sync(self) -> None:
        """Make everything encoded so far durable; then `durable` moves to the position passed (or to
        the first transaction still held)."""
        self._dirty.clear()
        mark = self._mark()
        self._write()
        pending, self._pending_sync = self._pending_sync, []
        files, self._pending_files = self._pending_files, []
        fd = self._fd
        settled = self.settled
        self._syncing = True
        try:
            await asyncio.to_thread(fsync_all, pending, fd, self.directory, files)
        except OSError:
            self._pending_files[:0] = files  # (tried again at the next sync)
            raise
        finally:
            self._syncing = False
        if not settled and not self._pending_files:
            self.settled = True
        self._advance(mark)

    def _mark(self) -> int:
        """Where `durable` may go once what is encoded now is on disk: the position passed, but not past
        a transaction still held."""
        position = self._position()
        return min(position, self._floor) if self._pending else position

    def idle(self) -> None:
        """Nothing encoded waits to be made durable: `durable` follows the position passed (transactions
        nobody needs, echoes, held ones flushed everywhere), else a source that stops writing data would
        never be confirmed past its last."""
        if (not self._dirty.is_set() and not self._syncing and not self._buf and not self._pending_sync
                and not self._pending_files):
            self._advance(self._mark())

    def _advance(self, mark: int) -> None:
        if self._limit is not None:
            mark = min(mark, self._limit)
        if self.since is not None and mark > self.durable:
            self.durable = mark
            if self.on_durable is not None:
                self.on_durable()

    # ------------------------------------------------------------ reading and truncation

    def reader(self, after: int) -> LogReader:
        """Read back every logged transaction ending after `after`, in order."""
        return LogReader(self, after)

    def truncate_before(self, lsn: int) -> int:
        """Delete every segment (not the one being written) whose transactions all end at or before
        `lsn`; returns the bytes freed."""
        freed = 0
        while len(self._segments) > 1 and self._segments[0].last <= lsn:
            seg = self._segments.pop(0)
            freed += seg.size + seg.linked
            self._disk -= seg.size + seg.linked
            seg.path.unlink(missing_ok=True)
            for linked in self.directory.glob(f"{seg.seq:010d}-*.spill"):
                linked.unlink(missing_ok=True)
        return freed

    def reset(self) -> None:
        """The log is no longer needed by anyone: delete it whole."""
        logger.info("node %s: router log up to %s no longer needed: deleted (%.1f MB)", self.node,
                    format_lsn(self.end), self.size / 1e6)
        self._delete_all()

    def _delete_all(self) -> None:
        self._close_fd()
        for seg in self._segments:
            seg.path.unlink(missing_ok=True)
        for path in [*self.directory.glob("*.seg"), *self.directory.glob("*.spill")]:
            path.unlink(missing_ok=True)
        self._segments = []
        self._disk = 0
        self._buf.clear()
        while self._pending:
            self._let_go(self._pending.popleft())
        self._pending_bytes = 0
        self._ticks.clear()
        self.since = None
        self.appending = False

    def _close_fd(self) -> None:
        for fd in [*self._pending_sync, self._fd]:
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._pending_sync = []
        self._fd = None

    def close(self) -> None:
        """Write what is buffered and close (no fsync: what was not synced was not confirmed either; what
        is held was not either: it is let go)."""
        self._write()
        while self._pending:
            self._let_go(self._pending.popleft())
        self._close_fd()

    def segments(self) -> list[Segment]:
        """The segments, oldest first (the list itself: a reader walks it)."""
        return self._segments

    @property
    def buffered(self) -> int:
        """Bytes (and transactions not encoded yet) appended and not written to the file: 0 when none."""
        return len(self._buf) + len(self._pending)

    def write_buffer(self) -> None:
        """Encode what is held and write what is buffered to the file (no fsync): a reader reads it from
        there."""
        self._encode_pending(len(self._pending))
        self._write()


def _held_bytes(txn: Transaction) -> int:
    """Memory a held transaction keeps (its spilled part is on disk)."""
    if txn.spilled:
        return _HELD_OVERHEAD + 64 * len(txn.changes)
    return _HELD_OVERHEAD + txn.nbytes
