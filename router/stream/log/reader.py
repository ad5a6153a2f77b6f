"""Reading the router's log back (router.stream.log.store): a cursor from a position, for one link.

A `LogReader` walks the log's segments from the oldest left, skips what ends at or before its position,
and gives each later transaction as a `Transaction`: a whole one decoded, a spilled one with its file
linked (or its pieces written) into the spool, as the source hands out a spilled transaction. It reads
what is buffered too (the log writes its buffer out first), and says None when it has read everything
appended so far.

Must not: write the log, or hold more than one transaction's changes in memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Protocol, cast

import msgspec

from protocol.changes import prefixes_of
from protocol.messages import Relation
from protocol.transactions import Spill, SpilledChange, Transaction
from router.errors import PgmeshError
from router.stream.log.format import (
    BEGIN,
    FINISH,
    LENGTH,
    LINKED,
    LINKED_DECODER,
    META_DECODER,
    RELATION,
    RELATION_DECODER,
    SEGMENT_HEADER,
    WHOLE,
    Segment,
    decode_frames,
    read_record,
    transaction_from,
)
from router.stream.spool import Spool

__all__ = ["LogReader"]


class Source(Protocol):
    """What a reader needs of the log (router.stream.log.store.SourceLog)."""

    node: str
    directory: Path
    spool: Spool

    @property
    def buffered(self) -> int: ...

    def segments(self) -> list[Segment]: ...

    def write_buffer(self) -> None: ...


class LogReader:
    """A cursor over the log: `next()` gives the next transaction ending after its position, or None
    when it has read everything appended so far."""

    def __init__(self, log: Source, after: int) -> None:
        self.log = log
        self.after = after
        self._seq = 0
        self._pos = 0
        self._relations: dict[int, Relation] = {}  # as described so far in the segment being read
        self._file: tuple[int, BinaryIO] | None = None  # the segment open for reading (seq, file)

    def next(self) -> Transaction | None:
        log = self.log
        while True:
            seg = self._segment()
            if seg is None:
                return None
            if self._pos >= seg.size + (log.buffered if seg is log.segments()[-1] else 0):
                if seg is log.segments()[-1]:
                    return None
                self._seq, self._pos = seg.seq + 1, SEGMENT_HEADER.size
                self._relations = {}
                continue
            if seg is log.segments()[-1] and log.buffered:
                log.write_buffer()  # what is buffered is read from the file
            txn = self._read_txn(seg)
            if txn is not None and txn.end_lsn > self.after:
                self.after = txn.end_lsn
                return txn
            if txn is not None:
                _drop(txn)

    def _segment(self) -> Segment | None:
        segments = self.log.segments()
        if not segments:
            return None
        if self._seq < segments[0].seq:  # truncated under it (it was past them) or first use
            self._seq, self._pos = segments[0].seq, SEGMENT_HEADER.size
            self._relations = {}
        for seg in segments:
            if seg.seq == self._seq:
                return seg
        return None

    def _open(self, seg: Segment) -> BinaryIO:
        if self._file is not None and self._file[0] == seg.seq:
            return self._file[1]
        self.close()
        f = open(seg.path, "rb")  # noqa: SIM115  # kept while it reads this segment (close())
        self._file = (seg.seq, f)
        return f

    def close(self) -> None:
        if self._file is not None:
            self._file[1].close()
            self._file = None

    def _read_txn(self, seg: Segment) -> Transaction | None:
        f = self._open(seg)
        f.seek(self._pos)
        kind, body = read_record(f, seg)
        if kind == RELATION:
            self._pos = f.tell()
            relation = RELATION_DECODER.decode(body)
            self._relations[relation.relid] = relation
            return None
        if kind == LINKED:
            self._pos = f.tell()
            head_len = LENGTH.unpack_from(body)[0]
            linked = LINKED_DECODER.decode(body[4 : 4 + head_len])
            if linked.meta.end_lsn <= self.after:
                return None
            tail = decode_frames(memoryview(body)[4 + head_len :])
            adopted = self.log.spool.adopt(f"{self.log.node}.log", linked.meta.xid,
                                           self.log.directory / linked.file, linked.spilled,
                                           linked.spilled_bytes)
            adopted.acquire()  # the reader's: the one who takes the transaction releases it
            known = frozenset(linked.prefixes).union(prefixes_of(tail))  # (the file is not read)
            txn = transaction_from(linked.meta, tail, linked.spilled, adopted, self._relations, known)
            return msgspec.structs.replace(txn, aborted_subxids=linked.aborted)
        if kind == WHOLE:
            self._pos = f.tell()
            meta_len = LENGTH.unpack_from(body)[0]
            meta = META_DECODER.decode(body[4 : 4 + meta_len])
            if meta.end_lsn <= self.after:
                return None
            changes = decode_frames(memoryview(body)[4 + meta_len :])
            return transaction_from(meta, changes, 0, None, self._relations)
        if kind != BEGIN:
            raise PgmeshError(f"router log {seg.path}: a transaction's record at byte {self._pos} is"
                              f" out of place ({kind!r})", node=self.log.node)
        meta = META_DECODER.decode(body)
        skip = meta.end_lsn <= self.after
        spool, key = self.log.spool, f"{self.log.node}.log"
        count = 0
        handle = None
        prefixes: set[str] = set()
        while True:
            kind, body = read_record(f, seg)
            if kind == FINISH:
                break
            if skip:
                continue
            piece = cast("list[SpilledChange]", decode_frames(body))
            count += len(piece)
            prefixes.update(prefixes_of(piece))
            handle = spool.write(key, Spill(meta.xid, piece))
        self._pos = f.tell()
        if skip:
            return None
        handle = spool.finish(key, meta.xid)
        if handle is not None:
            handle.acquire()  # the reader's: the one who takes the transaction releases it
        return transaction_from(meta, [], count, handle, self._relations, frozenset(prefixes))


def _drop(txn: Transaction) -> None:
    handle = txn.spill
    if handle is not None:
        handle.drop_ref()
