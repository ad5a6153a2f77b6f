"""Spilled transactions on disk: where the pieces of a huge transaction wait until every link applied it.

A source's `TransactionAssembler` hands out a transaction that outgrows its memory bound as `Spill`
pieces; the source appends each to this spool (`Spool.write`: one file per open transaction, keyed by
source node and xid), closes the file at the commit (`Spool.finish`) and attaches the returned
`SpillFile` to the `Transaction` (`Transaction.spill`). Readers walk a transaction, spilled part then
in-memory tail, with `iter_chunks`, or load it whole with `materialize` (a fallback for rare paths). What
a reader asks of the spilled part without reading it back stays in memory with the transaction: its
change and row counts, and the prefixes of its logical messages (`Transaction.prefixes`, kept by the
assembler as they arrive: whether it carries DDL is a set lookup).

A file lives as long as somebody may read it: the fan-out `acquire`s one reference per link it hands
the transaction to, each applier calls `let_go(txn)` once the transaction is applied or dropped, and
the last release deletes the file. A transaction aborted after spilling (`Spool.drop`), and the
unfinished files of a source that reconnects or rewinds (`Spool.discard_open`: the server sends those
transactions again from their start) are deleted at once; `Spool.close` removes the whole directory.

On disk: frames of a 4-byte big-endian length and a msgpack array of at most FRAME_CHANGES changes,
each msgspec's tagged encoding of the protocol message (an unchanged-TOAST cell is stored as nil: its
kind byte `u` says what it was). An insert the source left undecoded (`RawInsert`: the server's bytes
of the row) is stored as it is; readers get it decoded, unless they ask for it raw (`iter_raw_chunks`,
`SpillFile.read_frames(raw=True)`) to copy it through to COPY.

Must not: decide what is applied, talk to a database or keep the spilled changes in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import itertools
import logging
import os
import re
import shutil
import struct
import tempfile
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, Final, cast

import msgspec

from protocol.messages import (
    UNCHANGED_TOAST,
    Cell,
    Delete,
    Insert,
    Message,
    RawInsert,
    Relation,
    Truncate,
    TupleData,
    Type,
    Update,
)
from protocol.pgoutput import decode_raw_insert
from protocol.transactions import Change, Spill, SpilledChange, Transaction
from router.errors import PgmeshError

__all__ = [
    "FRAME_CHANGES",
    "SpillFile",
    "Spool",
    "decode_frame",
    "encode_changes",
    "iter_chunks",
    "iter_raw_chunks",
    "let_go",
    "materialize",
    "process_alive",
]

logger = logging.getLogger(__name__)

FRAME_CHANGES: Final = 1024  # changes per frame: the unit read back at once
_WRITE_CHANGES: Final = 8 * FRAME_CHANGES  # changes encoded before one write() (about a MB or less)
_LENGTH: Final = struct.Struct(">I")
_KIND_UNCHANGED: Final = 0x75  # 'u'
_UNSAFE: Final = re.compile(r"[^A-Za-z0-9_.-]")
_ROW_CHANGES: Final = (Insert, RawInsert, Update, Delete, Truncate, Message)  # a subtransaction abort drops


# ------------------------------------------------------------------------------------------ encoding
# The protocol types encode as they are. msgspec cannot decode a union with a marker class (`Cell`), so
# the three row messages decode into twins whose cells are bytes or nil, then are rebuilt.


def _enc_hook(obj: Any) -> Any:
    if obj is UNCHANGED_TOAST:
        return None
    raise NotImplementedError(f"cannot spill a {type(obj).__name__}")


class _Tuple(msgspec.Struct, frozen=True, gc=False):
    kinds: bytes
    values: tuple[bytes | None, ...]


class _Insert(msgspec.Struct, frozen=True, gc=False, tag="I"):
    relid: int
    new: _Tuple
    xid: int | None = None


class _Update(msgspec.Struct, frozen=True, gc=False, tag="U"):
    relid: int
    new: _Tuple
    old: _Tuple | None = None
    old_kind: str | None = None
    xid: int | None = None


class _Delete(msgspec.Struct, frozen=True, gc=False, tag="D"):
    relid: int
    old: _Tuple
    old_kind: str
    xid: int | None = None


_Wire = _Insert | RawInsert | _Update | _Delete | Truncate | Message | Relation | Type

_ENCODER: Final = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER: Final = msgspec.msgpack.Decoder(list[_Wire])


def _row(t: _Tuple) -> TupleData:
    values: tuple[Cell, ...] = t.values
    if _KIND_UNCHANGED in t.kinds:
        cells = zip(t.kinds, values, strict=True)
        values = tuple(UNCHANGED_TOAST if k == _KIND_UNCHANGED else v for k, v in cells)
    return TupleData(t.kinds, values)


def _insert(w: _Insert) -> Change:
    return Insert(w.relid, _row(w.new), w.xid)


def _update(w: _Update) -> Change:
    return Update(w.relid, _row(w.new), None if w.old is None else _row(w.old), w.old_kind, w.xid)


def _delete(w: _Delete) -> Change:
    return Delete(w.relid, _row(w.old), w.old_kind, w.xid)


# Twins rebuilt; with `raw`, a RawInsert (an Insert the source left undecoded) stays as it is.
_FROM_WIRE_RAW: Final[dict[type, Callable[[Any], SpilledChange]]] = {
    _Insert: _insert, _Update: _update, _Delete: _delete,
}
_FROM_WIRE: Final[dict[type, Callable[[Any], SpilledChange]]] = {
    **_FROM_WIRE_RAW, RawInsert: decode_raw_insert,
}


def encode_changes(changes: list[Change] | list[SpilledChange], out: bytearray) -> None:
    """Append `changes` to `out` as frames (length + msgpack array of at most FRAME_CHANGES)."""
    encode_into = _ENCODER.encode_into
    pack_into = _LENGTH.pack_into
    for i in range(0, len(changes), FRAME_CHANGES):
        at = len(out)
        out += b"\0\0\0\0"
        encode_into(changes[i : i + FRAME_CHANGES], out, -1)
        pack_into(out, at, len(out) - at - 4)


def decode_frame(data: bytes | memoryview) -> list[Change]:
    """One frame's msgpack body back into protocol messages."""
    return cast("list[Change]", _decode_frame(data, raw=False))


def _decode_frame(data: bytes | memoryview, *, raw: bool) -> list[SpilledChange]:
    """`decode_frame`; with `raw`, RawInserts stay undecoded."""
    table = _FROM_WIRE_RAW if raw else _FROM_WIRE
    items = _DECODER.decode(data)
    if table.keys().isdisjoint(map(type, items)):  # nothing to rebuild (checked in C): a frame of raw rows
        return items  # type: ignore[return-value]  # no twin among them: each is a SpilledChange
    convert = table.get
    out: list[SpilledChange] = []
    append = out.append
    for w in items:
        rebuild = convert(type(w))
        append(w if rebuild is None else rebuild(w))  # type: ignore[arg-type]  # not a twin: a Change
    return out


# ------------------------------------------------------------------------------------------ one file


class SpillFile:
    """The spilled part of one transaction, on disk; shared by the links it went to.

    `acquire(n)` when handing the transaction to n holders; each calls `drop_ref()` once done (or when
    it drops the transaction); the last release deletes the file. `discard()` deletes it now. The spool
    that made it writes it (`append`, then `seal` at the commit) and is told when it is deleted.
    """

    __slots__ = (
        "_file", "_forget", "abandoned", "changed", "changes", "deleted", "early", "final", "handed", "live",
        "nbytes", "node", "path", "pinned", "refs", "size", "xid",
    )

    def __init__(
        self, node: str, xid: int, path: Path, *, forget: Callable[[SpillFile], None], written: bool = False
    ) -> None:
        """`forget`: called once when the file is deleted (its spool stops tracking it). `written`: the
        file exists, whole (`Spool.adopt`), and is only read."""
        self._forget = forget
        self.node = node
        self.xid = xid
        self.path = path
        self._file: IO[bytes] | None = None if written else open(path, "wb")  # noqa: SIM115  # closed by finish / discard
        self.changes = 0  # changes written
        self.nbytes = 0  # their payload bytes as they came from the server
        self.size = 0  # bytes on disk
        self.refs = 0
        self.deleted = False
        # Read before its commit (`live`, see `grow`): `changed` is set at every write, at the commit
        # (`final`: the whole Transaction) and when it is `abandoned` (aborted, or the source reconnected
        # before the commit: the server sends it again, whole). A plain transaction is also handed out
        # at its first spill (`early`; `handed`: the links it went to); a streamed one is only announced
        # (router.stream.items.EarlyStream) and its commit is handed out as usual, the source's reference
        # held (`pinned`) until then.
        self.live = False
        self.early = False
        self.pinned = False
        self.final: Transaction | None = None
        self.abandoned = False
        self.changed: asyncio.Event | None = None
        self.handed: set[str] = set()

    def __repr__(self) -> str:
        state = "deleted" if self.deleted else f"refs={self.refs}"
        return f"<SpillFile {self.path.name} changes={self.changes} size={self.size} {state}>"

    def acquire(self, n: int = 1) -> None:
        """`n` more holders will each call `drop_ref()`."""
        if n < 0:
            raise ValueError(f"acquire({n})")
        self.refs += n

    def drop_ref(self) -> None:
        """One holder is done with it; the last one deletes the file."""
        self.refs -= 1
        if self.refs <= 0:
            self.discard()

    def grow(self, *, early: bool = True) -> None:
        """Readers may start before the commit: flush every write and tell them (`changed`). `early`:
        the transaction is handed out now, before its commit (a plain one; see the fields above)."""
        self.live = True
        self.early = early
        self.changed = asyncio.Event()
        if self._file is not None:
            self._file.flush()

    def complete(self, final: Transaction) -> None:
        """The commit arrived: `final` is the whole transaction (this file attached)."""
        self.final = final
        if self.changed is not None:
            self.changed.set()

    def abandon(self) -> None:
        """The commit will not come on this stream (the transaction is sent again, whole)."""
        self.abandoned = True
        if self.changed is not None:
            self.changed.set()

    def read_frames(
        self, pos: int, max_changes: int, *, raw: bool = False
    ) -> tuple[list[SpilledChange], int]:
        """The changes written from byte `pos` on, whole frames only, up to about `max_changes`
        (stops after the frame that reaches it), and where the next read starts. Works while the
        file is still being written (`grow`) and after it was closed. With `raw`, inserts the
        source left undecoded come as `RawInsert` (else every change is a `Change`)."""
        out: list[SpilledChange] = []
        try:
            f = open(self.path, "rb")  # noqa: SIM115  # closed below
        except FileNotFoundError:
            raise PgmeshError(f"the spilled part of transaction {self.xid} is gone ({self.path})",
                              node=self.node) from None
        with f:
            f.seek(pos)
            while len(out) < max_changes:
                header = f.read(4)
                if len(header) < 4:
                    break
                size = _LENGTH.unpack(header)[0]
                data = f.read(size)
                if len(data) < size:
                    break  # a frame still being written
                out += _decode_frame(data, raw=raw)
                pos += 4 + size
        return out, pos

    def discard(self) -> None:
        """Delete the file now, whoever holds it (an aborted or resent transaction, a reset, close)."""
        if self.deleted:
            return
        if self.live:
            self.abandon()  # whoever still reads it rolls back: the transaction comes again
        self.deleted = True
        self.seal()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._forget(self)

    def frames(self, *, raw: bool = False) -> Iterator[list[SpilledChange]]:
        """The spilled changes, frame by frame, as written (aborted subtransactions included); `raw`
        as for `read_frames`."""
        if self._file is not None:
            # Only a transaction whose commit arrived is read whole; one handed out before it (`live`) is
            # read as it grows (`read_frames`), and its whole self is `final`, once that is set.
            raise PgmeshError(
                f"transaction {self.xid} was read whole before its commit arrived (spill file {self.path}"
                " still being written): an internal error in pgmesh, please report it", node=self.node,
            )
        try:
            f = open(self.path, "rb")  # noqa: SIM115  # closed below, also when the reader stops early
        except FileNotFoundError:
            raise PgmeshError(
                f"the spilled part of transaction {self.xid} is gone ({self.path}): released too early"
                " or the spool was closed", node=self.node,
            ) from None
        with f:
            read = f.read
            while header := read(4):
                size = _LENGTH.unpack(header)[0] if len(header) == 4 else -1
                data = read(size) if size >= 0 else b""
                if len(data) != size:
                    raise PgmeshError(f"spill file {self.path} (xid {self.xid}) is cut short", node=self.node)
                yield _decode_frame(data, raw=raw)

    def append(self, changes: list[SpilledChange], nbytes: int, buf: bytearray) -> None:
        """Write `changes` (`nbytes` of payload as the server sent them) at the end, encoded through
        `buf`; readers of a live file are told (`changed`). The spool's side: see `Spool.write`."""
        f = self._file
        if f is None:
            raise PgmeshError(f"spill file {self.path} of xid {self.xid} is closed", node=self.node)
        for i in range(0, len(changes), _WRITE_CHANGES):
            buf.clear()
            encode_changes(changes[i : i + _WRITE_CHANGES], buf)
            f.write(buf)
            self.size += len(buf)
        if self.live:
            f.flush()
            if self.changed is not None:
                self.changed.set()
        self.changes += len(changes)
        self.nbytes += nbytes

    def seal(self) -> None:
        """Nothing more is written: close the file (it stays on disk for its readers)."""
        f, self._file = self._file, None
        if f is not None:
            f.close()


# ------------------------------------------------------------------------------------------ the spool


_SPOOL_TAIL: Final = re.compile(r"(\d+)-[A-Za-z0-9_]+")


def process_alive(pid: int) -> bool:
    """Whether a process `pid` exists (one owned by another user counts: it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Spool:
    """A private directory of spill files (created at the first spill), removed by `close()`.

    `directory`: where to create it ("" or None: the system's temporary directory); its name is
    pgmesh-spool-<cluster>-<pid>-<random>. One spool can serve every source of a router.
    """

    __slots__ = (
        "__weakref__", "_buf", "_finalizer", "_live", "_open", "_parent", "_path", "_prefix", "_seq",
        "bytes_written", "changes_written", "files_written",
    )

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, cluster: str = "pgmesh") -> None:
        self._parent = Path(directory) if directory else Path(tempfile.gettempdir())
        self._prefix = f"pgmesh-spool-{_UNSAFE.sub('_', cluster)}-{os.getpid()}-"
        self._path: Path | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._open: dict[tuple[str, int], SpillFile] = {}  # (node, xid) -> the file being written
        self._live: dict[Path, SpillFile] = {}  # every file not deleted yet, open or finished
        self._seq = itertools.count()
        self._buf = bytearray()
        self.files_written = 0
        self.changes_written = 0
        self.bytes_written = 0

    def remove_stale(self) -> list[Path]:
        """Remove the spool directories of this cluster's routers that are gone (killed before they could
        clean up: their process no longer exists) from the spool's parent; returns what was removed."""
        removed = []
        cluster_prefix = self._prefix.rsplit("-", 2)[0] + "-"  # pgmesh-spool-<cluster>-
        for path in self._parent.glob(f"{glob.escape(cluster_prefix)}*"):
            found = _SPOOL_TAIL.fullmatch(path.name[len(cluster_prefix):])  # <pid>-<mkdtemp's random>
            if not path.is_dir() or found is None or process_alive(int(found[1])):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            logger.info("removed the spool directory %s of a router that is gone", path)
        return removed

    @property
    def path(self) -> Path:
        """The spool's directory (created now if it does not exist yet)."""
        if self._path is None:
            self._parent.mkdir(parents=True, exist_ok=True)
            path = Path(tempfile.mkdtemp(prefix=self._prefix, dir=self._parent))
            self._finalizer = weakref.finalize(self, shutil.rmtree, path, True)
            self._path = path
            logger.info("spool directory %s", path)
        return self._path

    @property
    def files(self) -> int:
        """Spill files on disk now."""
        return len(self._live)

    @property
    def size(self) -> int:
        """Bytes on disk now."""
        return sum(f.size for f in self._live.values())

    def write(self, node: str, spill: Spill) -> SpillFile:
        """Append a Spill of `node`'s open transaction `spill.xid` to its file (created at the first)."""
        key = (node, spill.xid)
        handle = self._open.get(key)
        if handle is None:
            name = f"{_UNSAFE.sub('_', node)}-{spill.xid}-{next(self._seq)}.spill"
            handle = self._open[key] = SpillFile(node, spill.xid, self.path / name, forget=self._forget)
            self._live[handle.path] = handle
            self.files_written += 1
        before = handle.size
        try:
            handle.append(spill.changes, spill.nbytes, self._buf)
        finally:
            self._buf.clear()
        self.changes_written += len(spill.changes)
        self.bytes_written += handle.size - before
        return handle

    def adopt(self, node: str, xid: int, source: Path, changes: int, nbytes: int) -> SpillFile:
        """A finished spill file made elsewhere (the router's log keeps them: router.stream.log.store), as
        one of
        this spool's: linked into the spool (copied when it is on another file system). Nobody holds it."""
        path = self.path / f"{_UNSAFE.sub('_', node)}-{xid}-{next(self._seq)}.spill"
        try:
            os.link(source, path)
        except OSError:
            shutil.copyfile(source, path)
        handle = SpillFile(node, xid, path, forget=self._forget, written=True)
        handle.changes, handle.nbytes, handle.size = changes, nbytes, path.stat().st_size
        self._live[path] = handle
        return handle

    def finish(self, node: str, xid: int) -> SpillFile | None:
        """`node`'s transaction `xid` committed: its file, complete and closed (None if it never spilled).

        Nobody holds it yet: the caller `acquire`s for each holder (or `discard`s it).
        """
        handle = self._open.pop((node, xid), None)
        if handle is not None:
            handle.seal()
        return handle

    def drop(self, node: str, xid: int) -> None:
        """`node`'s open transaction `xid` was aborted: delete its file."""
        handle = self._open.pop((node, xid), None)
        if handle is not None:
            handle.discard()

    def discard_open(self, node: str) -> int:
        """Delete every unfinished file of `node` (its stream restarts); returns how many."""
        stale = [key for key in self._open if key[0] == node]
        for key in stale:
            self._open.pop(key).discard()
        if stale:
            logger.info("node %s: dropped %d unfinished spill file(s)", node, len(stale))
        return len(stale)

    def close(self) -> None:
        """Delete every file and the directory: a transaction still holding a SpillFile can no longer
        be read back."""
        for handle in list(self._live.values()):
            handle.discard()
        self._open.clear()
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._path = None

    def _forget(self, handle: SpillFile) -> None:
        self._live.pop(handle.path, None)
        if self._open.get((handle.node, handle.xid)) is handle:
            del self._open[(handle.node, handle.xid)]


# ------------------------------------------------------------------------------------------ reading


def _spill_file(txn: Transaction) -> SpillFile:
    handle = txn.spill
    if not isinstance(handle, SpillFile):
        raise PgmeshError(f"transaction {txn.xid} spilled {txn.spilled} changes but carries no spill file",
                          lsn=txn.commit_lsn)
    return handle


def _parts(txn: Transaction, raw: bool = False) -> Iterator[list[SpilledChange]]:
    """A spilled transaction's frames (aborted subtransactions left out), then its tail."""
    handle = _spill_file(txn)
    aborted = frozenset(txn.aborted_subxids)
    read = 0
    for frame in handle.frames(raw=raw):
        read += len(frame)
        if aborted:
            frame = [c for c in frame if not (isinstance(c, _ROW_CHANGES) and c.xid in aborted)]
        yield frame
    if read != txn.spilled:
        raise PgmeshError(f"spill file {handle.path} holds {read} changes of transaction {txn.xid},"
                          f" not {txn.spilled}", node=handle.node, lsn=txn.commit_lsn)
    yield cast("list[SpilledChange]", txn.changes)  # read only


def iter_chunks(txn: Transaction, max_changes: int = 10_000) -> Iterator[list[Change]]:
    """Every change of `txn` in order, in lists of at most `max_changes`: the spilled part read back
    from disk (without the aborted subtransactions), then the in-memory tail. At least one list (an
    empty one for a transaction without changes). Does not release the file."""
    return cast("Iterator[list[Change]]", _chunks(txn, max_changes, raw=False))


def iter_raw_chunks(txn: Transaction, max_changes: int = 10_000) -> Iterator[list[SpilledChange]]:
    """`iter_chunks`, where the inserts the source left undecoded stay `RawInsert`s (for a reader
    that copies them through to COPY: `router.apply.scripts` takes them)."""
    return _chunks(txn, max_changes, raw=True)


def _chunks(txn: Transaction, max_changes: int, *, raw: bool) -> Iterator[list[SpilledChange]]:
    if max_changes < 1:
        raise ValueError(f"max_changes must be >= 1, not {max_changes}")
    if not txn.spilled:
        tail = cast("list[SpilledChange]", txn.changes)
        for i in range(0, max(len(tail), 1), max_changes):
            yield tail[i : i + max_changes]
        return
    chunk: list[SpilledChange] = []
    empty = True
    for part in _parts(txn, raw):
        chunk += part
        if len(chunk) >= max_changes:
            full = len(chunk) - len(chunk) % max_changes
            for i in range(0, full, max_changes):
                yield chunk[i : i + max_changes]
            del chunk[:full]
            empty = False
    if chunk or empty:
        yield chunk


def materialize(txn: Transaction) -> Transaction:
    """`txn` with all its changes in memory (`spilled` 0, no spill handle); `txn` itself when it did not
    spill. Does not release the file: the caller still does, as for `txn`."""
    if not txn.spilled:
        return txn
    nbytes = txn.nbytes + _spill_file(txn).nbytes
    changes: list[Change] = []
    for part in _parts(txn):
        changes += cast("list[Change]", part)
    return msgspec.structs.replace(
        txn, changes=changes, spilled=0, aborted_subxids=(), spill=None, nbytes=nbytes
    )


def let_go(txn: Transaction) -> None:
    """The caller is done with `txn` (applied, or dropped): drop its spill file reference, if any."""
    handle = txn.spill
    if isinstance(handle, SpillFile):
        handle.drop_ref()
