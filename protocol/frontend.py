"""The frontend side of PostgreSQL's extended query protocol, for a pipeline of batches: the bytes of
Parse, Bind + Execute, Close (a statement) and Sync, and `Results`, which walks the server's answer to
one batch (up to its ReadyForQuery) out of a buffer.

Every parameter is text (format code 0 for all), None is NULL, no result format is asked for (text),
and no Describe is sent: Execute answers with its rows (DataRow) and CommandComplete, never with a
RowDescription. A Bind and its Execute are one bytes object (`bind_execute`), so a caller can build it
once and write it to several sessions that prepared the same name.

`Results` counts commands as a caller sent them: each Close (CloseComplete), Parse (ParseComplete) and
Execute (CommandComplete or EmptyQueryResponse) is one; a Bind is not. An ErrorResponse names the
command that failed (`failed_at`, then the server skips to the Sync) with its fields as asyncpg's
exceptions take them; `decided` says whether the last command returned a row.

Must not: touch a socket, or decide what an error means.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

__all__ = [
    "SYNC",
    "Results",
    "bind_body",
    "bind_execute",
    "bind_named",
    "close_statement",
    "parse",
]

_I32: Final = struct.Struct("!i")
_NULL: Final = b"\xff\xff\xff\xff"
_EXECUTE: Final = b"E\x00\x00\x00\x09\x00\x00\x00\x00\x00"  # the unnamed portal, every row
SYNC: Final = b"S\x00\x00\x00\x04"
_SHORT: Final = 4096  # a value's length up to this from a table, not packed (a Bind's main cost)
_LENGTHS: Final = tuple(_I32.pack(n) for n in range(_SHORT))
_MANY: Final = 1 << 10
_COUNTS: Final = tuple(struct.pack("!H", n) for n in range(_MANY))

# The fields of an ErrorResponse asyncpg's exceptions are made from (asyncpg.PostgresError.new).
ERROR_FIELDS: Final = frozenset(b"CMDHSWstcnd")


def parse(name: bytes, sql: bytes, types: Sequence[int] | None = None) -> bytes:
    """Parse: prepare `sql` as statement `name`, with these parameter type OIDs (0: the server infers)."""
    count = len(types) if types else 0
    body = b"".join((name, b"\x00", sql, b"\x00", struct.pack(f"!H{count}I", count, *(types or ()))))
    return b"P" + _I32.pack(len(body) + 4) + body


def bind_execute(name: bytes, params: Sequence[bytes | None] | None) -> bytes:
    """Bind statement `name` to the unnamed portal with text `params` (None: NULL), then Execute it."""
    return bind_named(name, bind_body(params))


def bind_body(params: Sequence[bytes | None] | None) -> bytes:
    """What a Bind carries after the statement's name: text `params` (None: NULL), text results."""
    lengths = _LENGTHS
    count = len(params) if params else 0
    parts = [b"\x00\x00", _COUNTS[count] if count < _MANY else struct.pack("!H", count)]
    if params:
        append = parts.append
        for value in params:
            if value is None:
                append(_NULL)
            else:
                size = len(value)
                append(lengths[size] if size < _SHORT else _I32.pack(size))
                append(value)
    parts.append(b"\x00\x00")  # no result format codes: all text
    return b"".join(parts)


def bind_named(name: bytes, body: bytes) -> bytes:
    """A Bind of statement `name` to the unnamed portal with `body` (`bind_body`), then its Execute."""
    return b"".join((b"B", _I32.pack(len(name) + len(body) + 6), b"\x00", name, b"\x00", body, _EXECUTE))


def close_statement(name: bytes) -> bytes:
    """Close the prepared statement `name` (closing one that is not there is no error)."""
    return b"C" + _I32.pack(len(name) + 6) + b"S" + name + b"\x00"


def error_fields(body: bytes | bytearray | memoryview) -> dict[str, str]:
    """An ErrorResponse's (or a NoticeResponse's) fields: code letter -> text, those asyncpg reads."""
    out: dict[str, str] = {}
    data = bytes(body)
    pos = 0
    end = len(data)
    while pos < end and data[pos]:
        code = data[pos]
        stop = data.index(b"\x00", pos + 1)
        if code in ERROR_FIELDS:
            out[chr(code)] = data[pos + 1:stop].decode(errors="replace")
        pos = stop + 1
    return out


_UNPACK: Final = struct.Struct("!I").unpack_from


class Results:
    """One batch's answer, read as it arrives (`feed`): the batch sent `commands` commands and a Sync.

    `failed_at` is the index of the command that failed (None: none), `error` its fields, `decided`
    whether the last command returned a row, `ready` whether the Sync's ReadyForQuery came (the batch
    is over; `status` is its transaction status: b"I" idle, b"T" in a transaction, b"E" failed)."""

    __slots__ = ("decided", "error", "failed_at", "index", "last", "ready", "status")

    def __init__(self, commands: int) -> None:
        self.last = commands - 1
        self.index = 0
        self.failed_at: int | None = None
        self.error: dict[str, str] | None = None
        self.decided = False
        self.ready = False
        self.status = b""

    def feed(self, buf: bytearray) -> bool:
        """Consume the whole messages at the start of `buf` (removed from it), up to the ReadyForQuery;
        returns `ready`. Any message not named here (a notice, a parameter status, a notification) is
        skipped."""
        pos = 0
        size = len(buf)
        index, last = self.index, self.last
        unpack = _UNPACK
        try:
            # byte values, the types as literals (a global's lookup per message is a tenth of the walk):
            # 50 '2' BindComplete, 67 'C' CommandComplete, 49 '1' ParseComplete, 51 '3' CloseComplete,
            # 73 'I' EmptyQueryResponse, 68 'D' DataRow, 69 'E' ErrorResponse, 90 'Z' ReadyForQuery
            while size - pos >= 5:
                code = buf[pos]
                if code == 50:  # (its length is always 4)
                    pos += 5
                    continue
                stop = pos + 1 + unpack(buf, pos + 1)[0]
                if stop > size:
                    break
                if code == 67 or code in (49, 51, 73):  # a command ended
                    index += 1
                elif code == 68:
                    if index == last:
                        self.decided = True
                elif code == 69:
                    if self.failed_at is None:
                        self.failed_at = index
                        self.error = error_fields(buf[pos + 5:stop])
                elif code == 90:
                    self.status = bytes(buf[pos + 5:stop])
                    self.ready = True
                    pos = stop
                    break
                pos = stop
        finally:
            self.index = index
            if pos:
                del buf[:pos]
        return self.ready
