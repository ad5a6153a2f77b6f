"""The streaming replication CopyData framing (both directions).

Server to client, inside CopyData: XLogData (`w`: WAL start, WAL end, send time, payload) and the
primary keepalive (`k`: WAL end, send time, reply-requested flag). Client to server: the standby status
update (`r`: written, flushed and applied positions, client time, reply flag). Bytes in, structs out;
the caller supplies the clock.
"""

from __future__ import annotations

import struct
from typing import Final

import msgspec

from protocol.errors import MalformedMessage, TruncatedMessage, UnknownMessage

__all__ = [
    "CopyDataFramer",
    "PrimaryKeepalive",
    "XLogData",
    "copy_data",
    "parse_copy_data",
    "standby_status_update",
]

_XLOG_HEAD: Final = struct.Struct(">QQq")
_KEEPALIVE: Final = struct.Struct(">QqB")
_STATUS: Final = struct.Struct(">cQQQqB")
_BACKEND_HEAD: Final = struct.Struct(">cI")
_MAX_MESSAGE: Final = 1 << 30  # PostgreSQL's MaxAllocSize


class XLogData(msgspec.Struct, frozen=True, gc=False):
    wal_start: int
    wal_end: int
    send_time: int
    payload: bytes


class PrimaryKeepalive(msgspec.Struct, frozen=True, gc=False):
    wal_end: int
    send_time: int
    reply_requested: bool


def parse_copy_data(data: bytes | bytearray | memoryview) -> XLogData | PrimaryKeepalive:
    """One CopyData body from a walsender -> XLogData or PrimaryKeepalive."""
    if not data:
        raise TruncatedMessage("empty CopyData message")
    tag = data[0]
    if tag == 0x77:  # 'w'
        if len(data) < 1 + _XLOG_HEAD.size:
            raise TruncatedMessage("XLogData header ends early", tag="w")
        wal_start, wal_end, send_time = _XLOG_HEAD.unpack_from(data, 1)
        return XLogData(wal_start, wal_end, send_time, bytes(data[1 + _XLOG_HEAD.size :]))
    if tag == 0x6B:  # 'k'
        if len(data) != 1 + _KEEPALIVE.size:
            raise TruncatedMessage(f"keepalive of {len(data)} bytes, expected 18", tag="k")
        wal_end, send_time, reply = _KEEPALIVE.unpack_from(data, 1)
        if reply > 1:
            raise MalformedMessage(f"keepalive reply flag {reply}", lsn=wal_end, tag="k")
        return PrimaryKeepalive(wal_end, send_time, reply == 1)
    raise UnknownMessage(f"unknown CopyData message tag {tag:#04x}", tag=chr(tag))


def standby_status_update(write: int, flush: int, apply: int, now_us: int, reply: bool = False) -> bytes:
    """The `r` message: positions received, durably flushed, applied; time in PostgreSQL-epoch µs."""
    return _STATUS.pack(b"r", write, flush, apply, now_us, 1 if reply else 0)


class CopyDataFramer:
    """Splits a backend byte stream in COPY BOTH mode into CopyData bodies, whatever the chunking.

    Feed it bytes as they come off a socket (any split); it returns the bodies of the complete CopyData
    (`d`) messages. CopyDone (`c`) ends the stream (`done` becomes true); any other message is an error
    for the caller to read with libpq, so it raises. libpq frames the stream in the router; this framer
    serves captures, replays and tests that handle the wire bytes themselves.
    """

    __slots__ = ("_buffer", "done")

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.done = False

    def feed(self, chunk: bytes | bytearray | memoryview) -> list[bytes]:
        if self.done and chunk:
            raise MalformedMessage("bytes after CopyDone")
        self._buffer += chunk
        out: list[bytes] = []
        buf = self._buffer
        pos = 0
        while len(buf) - pos >= _BACKEND_HEAD.size:
            tag, length = _BACKEND_HEAD.unpack_from(buf, pos)
            if length < 4 or length > _MAX_MESSAGE:
                raise MalformedMessage(f"backend message length {length}")
            end = pos + 1 + length
            if end > len(buf):
                break
            if tag == b"d":
                out.append(bytes(buf[pos + 5 : end]))
            elif tag == b"c":
                self.done = True
            else:
                raise UnknownMessage(f"backend message {tag!r} inside COPY BOTH", tag=tag.decode("latin-1"))
            pos = end
        del buf[:pos]
        return out

    @property
    def pending(self) -> int:
        """Bytes of an incomplete message held back."""
        return len(self._buffer)


def copy_data(body: bytes) -> bytes:
    """Wrap a body as a CopyData message (`d`, Int32 length, body)."""
    return _BACKEND_HEAD.pack(b"d", len(body) + 4) + body
