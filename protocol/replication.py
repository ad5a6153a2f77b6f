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
    "PrimaryKeepalive",
    "XLogData",
    "parse_copy_data",
    "standby_status_update",
]

_XLOG_HEAD: Final = struct.Struct(">QQq")
_KEEPALIVE: Final = struct.Struct(">QqB")
_STATUS: Final = struct.Struct(">cQQQqB")


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
