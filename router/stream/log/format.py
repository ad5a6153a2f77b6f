"""The router log's format on disk (router.stream.log.store writes it, router.stream.log.reader reads it).

A segment is a 20-byte header (magic, the log's `since`, CRC-32 of both) then records: 4-byte length of
kind + payload, 4-byte CRC-32 of kind + payload, a kind byte, the payload. Kinds: `R` a relation's
description (each segment describes the relations it uses before their first use: a reader starts at a
segment's start), `T` a whole transaction (its description `Meta`, then its changes as the spool's
frames), `S` a spilled transaction whose spill file was linked beside the segment (`Linked`, then its
in-memory tail), and `B`, `F` ... `E` a spilled transaction copied in pieces (another file system). A
transaction read back carries the prefixes of its logical messages (`Transaction.prefixes`): collected
from the changes read, and for a linked file, which is not read, written in its `Linked` (a log written
before they were has none there: only the tail's are known).

Must not: do I/O beyond reading one record from a file it is given.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import BinaryIO, Final

import msgspec

from protocol.changes import prefixes_of
from protocol.messages import Relation
from protocol.transactions import Change, Transaction
from router.errors import PgmeshError
from router.stream.spool import decode_frame

MAGIC: Final = b"PGMLOG01"
SEGMENT_HEADER: Final = struct.Struct(">8sQI")
RECORD: Final = struct.Struct(">IIc")  # length of kind + payload, CRC-32 of kind + payload, kind
LENGTH: Final = struct.Struct(">I")
END: Final = struct.Struct(">Q")
WHOLE, BEGIN, FRAMES, FINISH, RELATION, LINKED = b"T", b"B", b"F", b"E", b"R", b"S"
BIG_CHANGES: Final = 4096  # a transaction with more changes than this is logged (and read back) in pieces
READ_CHANGES: Final = 10_000  # changes per piece written to the spool when reading a big one back


class Meta(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A logged transaction's description (its changes follow)."""

    xid: int
    commit_lsn: int
    end_lsn: int
    commit_time: int
    nbytes: int
    row_count: int
    streamed: bool
    seen: tuple[tuple[str, int], ...]
    relids: list[int]  # its relations: each described by an `R` record earlier in the same segment


class Linked(msgspec.Struct, array_like=True, frozen=True):
    """A spilled transaction whose spill file was linked into the log's directory (its tail follows)."""

    meta: Meta
    file: str
    spilled: int  # changes in the file
    spilled_bytes: int
    aborted: tuple[int, ...]
    prefixes: tuple[str, ...] = ()  # of its logical messages, the file's included (older logs: ())


ENCODER: Final = msgspec.msgpack.Encoder()
LINKED_DECODER: Final = msgspec.msgpack.Decoder(Linked)
META_DECODER: Final = msgspec.msgpack.Decoder(Meta)
RELATION_DECODER: Final = msgspec.msgpack.Decoder(Relation)


class Segment:
    __slots__ = ("first", "last", "linked", "path", "seq", "size")

    def __init__(self, path: Path, seq: int, size: int) -> None:
        self.path = path
        self.seq = seq
        self.size = size  # bytes written to the file (the buffer not included)
        self.linked = 0  # bytes of the spill files linked beside it (`NNNNNNNNNN-*.spill`)
        self.first = 0  # end LSN of its first transaction (0: none yet)
        self.last = 0  # end LSN of its last transaction


def read_record(f: BinaryIO, seg: Segment) -> tuple[bytes, bytes]:
    read = f.read
    head = read(RECORD.size)
    if len(head) < RECORD.size:
        raise PgmeshError(f"router log {seg.path} ends inside a record")
    length, crc, kind = RECORD.unpack(head)
    body: bytes = read(length - 1)
    if len(body) != length - 1 or zlib.crc32(body, zlib.crc32(kind)) != crc:
        raise PgmeshError(f"router log {seg.path}: a record fails its checksum")
    return kind, body


def decode_frames(data: bytes | memoryview) -> list[Change]:
    """Every frame (length + msgpack) in `data`, decoded, in order."""
    out: list[Change] = []
    view = memoryview(data)
    pos = 0
    while pos < len(view):
        size = LENGTH.unpack_from(view, pos)[0]
        out += decode_frame(view[pos + 4 : pos + 4 + size])
        pos += 4 + size
    return out


def meta_bytes(body: bytes) -> bytes:
    """The description inside a record's body (a `T` body starts with its length, a `B` body is one)."""
    if body[:1] in (WHOLE, LINKED):
        size = LENGTH.unpack_from(body, 1)[0]
        return body[5 : 5 + size]
    return body[1:]


def transaction_from(
    meta: Meta, changes: list[Change], spilled: int, handle: object, relations: dict[int, Relation],
    prefixes: AbstractSet[str] | None = None,
) -> Transaction:
    """The transaction `meta` describes; `prefixes`: its logical messages' (None: those of `changes`)."""
    return Transaction(
        meta.xid, meta.commit_lsn, meta.end_lsn, meta.commit_time, changes,
        {relid: relations[relid] for relid in meta.relids}, None, None, meta.streamed, meta.nbytes,
        meta.row_count, spilled, (), handle, meta.seen,
        frozenset(prefixes_of(changes)) if prefixes is None else prefixes,
    )
