"""Decoder of pgoutput's binary messages (PostgreSQL 15, proto_version 1 and 2).

`decode(payload)` turns the bytes of one XLogData payload into one message from `protocol.messages`,
through a table from tag byte to one small function per message. In a proto_version 2 stream the row,
schema and logical messages between Stream Start and Stream Stop carry a leading xid: `Decoder` tracks
that state; `decode(..., streaming=True)` is the stateless form. Any input that is not exactly one
well-formed message raises `ProtocolError` (with the LSN when the caller gives it), never anything else.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final

from protocol.errors import MalformedMessage, ProtocolError, TruncatedMessage, UnknownMessage, WrongState
from protocol.messages import (
    UNCHANGED_TOAST,
    Begin,
    Cell,
    Column,
    Commit,
    Delete,
    Insert,
    Message,
    Origin,
    PgOutputMessage,
    Relation,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Type,
    Update,
)

__all__ = ["Decoder", "decode"]

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_U64 = struct.Struct(">Q")
_BEGIN = struct.Struct(">QqI")
_COMMIT = struct.Struct(">BQQq")
_STREAM_COMMIT = struct.Struct(">IBQQq")
_STREAM_ABORT = struct.Struct(">II")
_STREAM_START = struct.Struct(">IB")
_COLUMN_TAIL = struct.Struct(">Ii")
_MESSAGE_HEAD = struct.Struct(">BQ")
_TRUNCATE_HEAD = struct.Struct(">iB")

_N: Final = 0x6E
_U: Final = 0x75
_T: Final = 0x74
_B: Final = 0x62
_TRUNCATE_CASCADE: Final = 1
_TRUNCATE_RESTART_IDENTITY: Final = 2
_MESSAGE_TRANSACTIONAL: Final = 1
_REPLICA_IDENTITIES: Final = frozenset("dnfi")

_Reader = Callable[[bytes, int, bool], tuple[PgOutputMessage, int]]


def _cstring(buf: bytes, pos: int) -> tuple[str, int]:
    end = buf.find(b"\x00", pos)
    if end < 0:
        raise TruncatedMessage("unterminated string")
    return buf[pos:end].decode("utf-8"), end + 1


def _xid(buf: bytes, pos: int, streaming: bool) -> tuple[int | None, int]:
    if not streaming:
        return None, pos
    return _U32.unpack_from(buf, pos)[0], pos + 4


def _tuple(buf: bytes, pos: int) -> tuple[TupleData, int]:
    """TupleData: Int16 column count, then per column a kind byte and, for 't'/'b', Int32 length + bytes."""
    natts = _I16.unpack_from(buf, pos)[0]
    if natts < 0:
        raise MalformedMessage(f"negative column count {natts}")
    pos += 2
    size = len(buf)
    kinds = bytearray(natts)
    values: list[Cell] = [None] * natts
    unpack_len = _I32.unpack_from
    for i in range(natts):
        if pos >= size:
            raise TruncatedMessage(f"tuple ends before column {i + 1} of {natts}")
        kind = buf[pos]
        kinds[i] = kind
        if kind in (_T, _B):
            length = unpack_len(buf, pos + 1)[0]
            start = pos + 5
            pos = start + length
            if length < 0 or pos > size:
                raise TruncatedMessage(f"column {i + 1} value of {length} bytes does not fit")
            values[i] = buf[start:pos]
        elif kind == _N:
            pos += 1
        elif kind == _U:
            values[i] = UNCHANGED_TOAST
            pos += 1
        else:
            raise MalformedMessage(f"column {i + 1} has unknown kind byte {kind:#04x}")
    return TupleData(bytes(kinds), tuple(values)), pos


def _begin(buf: bytes, pos: int, streaming: bool) -> tuple[PgOutputMessage, int]:
    final_lsn, commit_time, xid = _BEGIN.unpack_from(buf, pos)
    return Begin(final_lsn, commit_time, xid), pos + _BEGIN.size


def _commit(buf: bytes, pos: int, streaming: bool) -> tuple[PgOutputMessage, int]:
    flags, commit_lsn, end_lsn, commit_time = _COMMIT.unpack_from(buf, pos)
    return Commit(flags, commit_lsn, end_lsn, commit_time), pos + _COMMIT.size


def _origin(buf: bytes, pos: int, streaming: bool) -> tuple[PgOutputMessage, int]:
    commit_lsn = _U64.unpack_from(buf, pos)[0]
    name, pos = _cstring(buf, pos + 8)
    return Origin(commit_lsn, name), pos


def _relation(buf: bytes, pos: int, streaming: bool) -> tuple[PgOutputMessage, int]:
    xid, pos = _xid(buf, pos, streaming)
    relid = _U32.unpack_from(buf, pos)[0]
    namespace, pos = _cstring(buf, pos + 4)
    name, pos = _cstring(buf, pos)
    if pos >= len(buf):
        raise TruncatedMessage("relation ends before its replica identity")
    identity = chr(buf[pos])
    if identity not in _REPLICA_IDENTITIES:
        raise MalformedMessage(f"unknown replica identity {identity!r} for relation {namespace}.{name}")
    natts = _I16.unpack_from(buf, pos + 1)[0]
    if natts < 0:
        raise MalformedMessage(f"negative column count {natts}")
    pos += 3
    columns = []
    for _ in range(natts):
        if pos >= len(buf):
            raise TruncatedMessage(f"relation {namespace}.{name} ends before all {natts} columns")
        flags = buf[pos]
        colname, pos = _cstring(buf, pos + 1)
        type_oid, typmod = _COLUMN_TAIL.unpack_from(buf, pos)
        pos += _COLUMN_TAIL.size
        columns.append(Column(colname, type_oid, typmod, bool(flags & 1)))
    return Relation(relid, namespace, name, identity, tuple(columns), xid), pos


def _type(buf: bytes, pos: int, streaming: bool) -> tuple[PgOutputMessage, int]:
    xid, pos = _xid(buf, pos, streaming)
    oid = _U32.unpack_from(buf, pos)[0]
    namespace, pos = _cstring(buf, pos + 4)
    name, pos = _cstring(buf, pos)
    return Type(oid, namespace, name, xid), pos


def _insert(buf: bytes, pos: int, streaming: bool) -> tuple[PgOutputMessage, int]:
    xid, pos = _xid(buf, pos, streaming)
    relid = _U32.unpack_from(buf, pos)[0]
    if buf[pos + 4] != 0x4E:  # 'N'
        raise MalformedMessage(f"insert: expected 'N' before the new tuple, got {buf[pos + 4]:#04x}")
    new, pos = _tuple(buf, pos + 5)
    return Insert(relid, new, xid), pos


def _update(buf: bytes, pos: int, streaming: bool) -> tuple[PgOutputMessage, int]:
    xid, pos = _xid(buf, pos, streaming)
    relid = _U32.unpack_from(buf, pos)[0]
    pos += 4
    marker = buf[pos]
    old: TupleData | None = None
    old_kind: str | None = None
    if marker == 0x4B or marker == 0x4F:  # 'K' old key, 'O' old row
        old_kind = chr(marker)
        old, pos = _tuple(buf, pos + 1)
        marker = buf[pos]
    if marker != 0x4E:
        raise MalformedMessage(f"update: expected 'N' before the new tuple, got {marker:#04x}")
    new, pos = _tuple(buf, pos + 1)
    return Update(relid, new, old, old_kind, xid), pos


def _delete(buf: bytes, pos: int, streaming: bool) -> tuple[PgOutputMessage, int]:
    xid, pos = _xid(buf, pos, streaming)
    relid = _U32.unpack_from(buf, pos)[0]
    marker = buf[pos + 4]
    if marker != 0x4B and marker != 0x4F:
        raise MalformedMessage(f"delete: expected 'K' or 'O' before the old tuple, got {marker:#04x}")
    old, pos = _tuple(buf, pos + 5)
    return Delete(relid, old, chr(marker), xid), pos


def _truncate(buf: bytes, pos: int, streaming: bool) -> tuple[PgOutputMessage, int]:
    xid, pos = _xid(buf, pos, streaming)
    nrelids, options = _TRUNCATE_HEAD.unpack_from(buf, pos)
    pos += _TRUNCATE_HEAD.size
    if nrelids < 0 or pos + 4 * nrelids > len(buf):
        raise TruncatedMessage(f"truncate of {nrelids} relations does not fit")
    if options & ~(_TRUNCATE_CASCADE | _TRUNCATE_RESTART_IDENTITY):
        raise MalformedMessage(f"truncate: unknown option bits {options:#04x}")
    relids = struct.unpack_from(f">{nrelids}I", buf, pos)
    pos += 4 * nrelids
    cascade = bool(options & _TRUNCATE_CASCADE)
    restart = bool(options & _TRUNCATE_RESTART_IDENTITY)
    return Truncate(relids, cascade, restart, xid), pos


def _message(buf: bytes, pos: int, streaming: bool) -> tuple[PgOutputMessage, int]:
    xid, pos = _xid(buf, pos, streaming)
    flags, lsn = _MESSAGE_HEAD.unpack_from(buf, pos)
    if flags & ~_MESSAGE_TRANSACTIONAL:
        raise MalformedMessage(f"message: unknown flag bits {flags:#04x}")
    prefix, pos = _cstring(buf, pos + _MESSAGE_HEAD.size)
    length = _I32.unpack_from(buf, pos)[0]
    start = pos + 4
    pos = start + length
    if length < 0 or pos > len(buf):
        raise TruncatedMessage(f"message content of {length} bytes does not fit")
    return Message(bool(flags & _MESSAGE_TRANSACTIONAL), lsn, prefix, buf[start:pos], xid), pos


def _stream_start(buf: bytes, pos: int, streaming: bool) -> tuple[PgOutputMessage, int]:
    xid, first = _STREAM_START.unpack_from(buf, pos)
    if first > 1:
        raise MalformedMessage(f"stream start: first-segment flag {first}")
    return StreamStart(xid, first == 1), pos + _STREAM_START.size


def _stream_stop(buf: bytes, pos: int, streaming: bool) -> tuple[PgOutputMessage, int]:
    return StreamStop(), pos


def _stream_commit(buf: bytes, pos: int, streaming: bool) -> tuple[PgOutputMessage, int]:
    xid, flags, commit_lsn, end_lsn, commit_time = _STREAM_COMMIT.unpack_from(buf, pos)
    return StreamCommit(xid, flags, commit_lsn, end_lsn, commit_time), pos + _STREAM_COMMIT.size


def _stream_abort(buf: bytes, pos: int, streaming: bool) -> tuple[PgOutputMessage, int]:
    xid, subxid = _STREAM_ABORT.unpack_from(buf, pos)
    return StreamAbort(xid, subxid), pos + _STREAM_ABORT.size


_READERS: Final[dict[int, _Reader]] = {
    ord("B"): _begin,
    ord("C"): _commit,
    ord("O"): _origin,
    ord("R"): _relation,
    ord("Y"): _type,
    ord("I"): _insert,
    ord("U"): _update,
    ord("D"): _delete,
    ord("T"): _truncate,
    ord("M"): _message,
    ord("S"): _stream_start,
    ord("E"): _stream_stop,
    ord("c"): _stream_commit,
    ord("A"): _stream_abort,
}


def decode(payload: bytes | bytearray | memoryview, *, lsn: int | None = None, streaming: bool = False) -> (
    PgOutputMessage
):
    """Decode exactly one pgoutput message. `streaming`: inside a Stream Start/Stop block (xid prefix)."""
    buf = payload if isinstance(payload, bytes) else bytes(payload)
    if not buf:
        raise TruncatedMessage("empty message", lsn=lsn)
    tag = buf[0]
    reader = _READERS.get(tag)
    if reader is None:
        raise UnknownMessage(f"unknown pgoutput message tag {tag:#04x}", lsn=lsn, tag=chr(tag))
    try:
        message, end = reader(buf, 1, streaming)
    except ProtocolError as exc:
        raise type(exc)(exc.detail, lsn=lsn, tag=chr(tag)) from None
    except (struct.error, IndexError) as exc:
        raise TruncatedMessage(f"message ends early ({exc})", lsn=lsn, tag=chr(tag)) from None
    except UnicodeDecodeError as exc:
        raise MalformedMessage(f"name is not valid UTF-8 ({exc.reason})", lsn=lsn, tag=chr(tag)) from None
    if end != len(buf):
        raise MalformedMessage(f"{len(buf) - end} unexpected bytes after the message", lsn=lsn, tag=chr(tag))
    return message


class Decoder:
    """Stateful front of `decode`: knows whether a proto_version 2 stream block is open."""

    __slots__ = ("in_stream",)

    def __init__(self) -> None:
        self.in_stream = False

    def reset(self) -> None:
        """Forget stream state (after a reconnect the server starts every block afresh)."""
        self.in_stream = False

    def decode(self, payload: bytes | bytearray | memoryview, lsn: int | None = None) -> PgOutputMessage:
        message = decode(payload, lsn=lsn, streaming=self.in_stream)
        kind = type(message)
        if kind is StreamStart:
            if self.in_stream:
                raise WrongState("Stream Start inside an open stream block", lsn=lsn, tag="S")
            self.in_stream = True
        elif kind is StreamStop:
            if not self.in_stream:
                raise WrongState("Stream Stop outside a stream block", lsn=lsn, tag="E")
            self.in_stream = False
        return message
