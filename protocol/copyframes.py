"""The backend messages of a replication connection read off its socket by pgmesh itself (sans-I/O).

`CopyReader` takes the chunks the caller reads off the socket (`feed`, as large as `read_size()`) and
`split` hands out the bodies of whole CopyData messages, in order, each as its own `bytes` (a slice of
the chunk: the decoder reads it without copying it again, and nobody's bytes change under them), a
message split across reads kept for the next (a large one gathered in pieces and joined once). It
also reads what the server sends around and inside COPY BOTH: the answer to START_REPLICATION
(CopyBothResponse `W`, or an ErrorResponse), NoticeResponse `N` (kept in `notices`), ParameterStatus
`S` (ignored), and the end of the stream (CopyDone `c`, or an ErrorResponse: `end`).

Also the frontend side the router writes on such a connection: the simple Query of START_REPLICATION
(`query`); CopyData is `protocol.replication.copy_data`.

Must not: touch a socket, or decide what an error means (the SQLSTATE is the caller's to read).
"""

from __future__ import annotations

import struct
from typing import Final

from protocol.errors import MalformedMessage, UnknownMessage

__all__ = ["READ_BYTES", "READ_BYTES_MAX", "CopyEnd", "CopyReader", "error_fields", "error_text", "query"]

_HEAD: Final = struct.Struct(">BI")  # tag, length (itself included, the tag not)
_FRAME: Final = struct.Struct(">BIB")  # tag, length, the body's first byte (CopyData: its kind)
_I32: Final = struct.Struct(">i")
_MAX_MESSAGE: Final = 1 << 30  # PostgreSQL's MaxAllocSize
_DATA: Final = 0x64  # 'd' CopyData
_DONE: Final = 0x63  # 'c' CopyDone
_XLOG: Final = 0x77  # 'w' XLogData, inside CopyData
_ERROR: Final = 0x45  # 'E' ErrorResponse
_NOTICE: Final = 0x4E  # 'N' NoticeResponse
_PARAMETER: Final = 0x53  # 'S' ParameterStatus
_COPY_BOTH: Final = 0x57  # 'W' CopyBothResponse
READ_BYTES: Final = 256 * 1024  # what one read asks for
READ_BYTES_MAX: Final = 8 << 20  # ... at most, while a large message is gathered


class CopyEnd:
    """What ended the stream: CopyDone (`fields` None) or an ErrorResponse's fields (code -> text)."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict[str, str] | None) -> None:
        self.fields = fields

    @property
    def sqlstate(self) -> str | None:
        return None if self.fields is None else self.fields.get("C")

    @property
    def text(self) -> str:
        return "the server ended the COPY stream" if self.fields is None else error_text(self.fields)


class CopyReader:
    """Backend messages out of the chunks read off a socket; see the module's docstring."""

    __slots__ = ("_buf", "_have", "_need", "_parts", "_pos", "copying", "data_bytes", "end", "notices")

    def __init__(self, *, copying: bool = False) -> None:
        """`copying`: the server is in COPY BOTH already (else `split` expects the answer to a query)."""
        self._buf = b""  # the last chunk (after what was left of the one before)
        self._pos = 0  # the first byte of `_buf` not handed out
        self._parts: list[bytes] | None = None  # a message larger than what was received, being gathered
        self._need = 0  # its size (with what follows it in `_parts`)
        self._have = 0  # bytes in `_parts`
        self.copying = copying  # CopyBothResponse received
        self.end: CopyEnd | None = None  # CopyDone or an ErrorResponse: nothing after it is read
        self.data_bytes = 0  # CopyData body bytes handed out, in all
        self.notices: list[dict[str, str]] = []  # NoticeResponse fields, for the caller to take

    @property
    def pending(self) -> int:
        """Bytes received and not yet handed out (part of a message, or messages past `split`'s limit)."""
        return len(self._buf) - self._pos + self._have

    def read_size(self) -> int:
        """How many bytes the next read may ask for: more while a large message is being gathered."""
        if self._parts is None:
            return READ_BYTES
        return min(max(READ_BYTES, self._need - self._have), READ_BYTES_MAX)

    def feed(self, chunk: bytes) -> None:
        """`chunk`, read off the socket. Read only once `split` found no whole message: what was left of
        the chunk before is copied in front of it (part of one message), or a large message gathered
        in pieces and joined once."""
        parts = self._parts
        if parts is not None:
            parts.append(chunk)
            self._have += len(chunk)
            if self._have >= self._need:
                self._buf, self._pos, self._parts, self._have = b"".join(parts), 0, None, 0
            return
        buf, pos = self._buf, self._pos
        left = len(buf) - pos
        if not left:
            self._buf, self._pos = chunk, 0
            return
        if left >= 5:
            need = _HEAD.unpack_from(buf, pos)[1] + 1
            if need > _MAX_MESSAGE + 1:
                raise MalformedMessage(f"backend message {chr(buf[pos])!r} of length {need - 1}")
            if left + len(chunk) < need:
                self._parts, self._need, self._have = [buf[pos:], chunk], need, left + len(chunk)
                self._buf, self._pos = b"", 0
                return
        self._buf, self._pos = buf[pos:] + chunk, 0

    def split(self, limit: int) -> list[bytes]:
        """The bodies of the whole CopyData messages received, in order: up to `limit` of them, and up to
        the first that is not XLogData (a keepalive: then it is the last one).

        Stops early at CopyBothResponse (`copying` becomes true) and at the end of the stream (`end`).
        Raises ProtocolError on a message that has no place here (after handing out what came before it).
        """
        out: list[bytes] = []
        if self.end is not None:
            return out
        buf, pos = self._buf, self._pos
        end = len(buf)
        while True:
            if self.copying:
                pos, full = self._take(out, pos, limit)
                if full:
                    break
            if end - pos < 5:
                break
            tag, length = _HEAD.unpack_from(buf, pos)
            stop = pos + 1 + length
            if length < 4 or length > _MAX_MESSAGE:
                if out:
                    break  # raised at the next call
                self._pos = pos
                raise MalformedMessage(f"backend message {chr(tag)!r} of length {length}")
            if stop > end:
                break
            if tag == _DATA and self.copying:  # empty, or the last bytes received: taken here
                out.append(buf[pos + 5 : stop])
                self.data_bytes += length - 4
                pos = stop
                if len(out) >= limit or length == 4 or buf[pos - length + 4] != _XLOG:
                    break
                continue
            if out and tag != _NOTICE and tag != _PARAMETER:
                break  # the stream's end (or a surprise) is for the next call
            self._pos = pos = stop
            if self._other(tag, buf[stop - length + 4 : stop]):
                break
        self._pos = pos
        return out

    def _take(self, out: list[bytes], pos: int, limit: int) -> tuple[int, bool]:
        """The whole CopyData messages from `pos` on, into `out`; the position after them, and whether
        `out` is complete (`limit` reached, or a message that is not XLogData taken)."""
        buf = self._buf
        end = len(buf)
        last = end - 6  # a message's head and its body's first byte must be there
        append = out.append
        unpack = _FRAME.unpack_from
        start, first = pos, len(out)
        full = True
        for _ in range(limit - first):
            if pos > last:
                full = False
                break
            tag, length, kind = unpack(buf, pos)
            stop = pos + 1 + length
            if tag != _DATA or stop > end or length < 5:
                full = False
                break
            append(buf[pos + 5 : stop])
            pos = stop
            if kind != _XLOG:
                break
        self.data_bytes += pos - start - 5 * (len(out) - first)
        return pos, full

    def _other(self, tag: int, body: bytes) -> bool:
        """A message that is not CopyData in COPY; True when splitting must stop after it."""
        if tag == _NOTICE:
            self.notices.append(error_fields(body))
            return False
        if tag == _PARAMETER:
            return False
        if tag == _ERROR:
            self.end = CopyEnd(error_fields(body))
            return True
        if self.copying:
            if tag == _DONE:
                self.end = CopyEnd(None)
                return True
        elif tag == _COPY_BOTH:
            self.copying = True
            return True
        state = "in COPY BOTH" if self.copying else "before COPY BOTH"
        raise UnknownMessage(f"backend message {chr(tag)!r} {state}", tag=chr(tag))


def error_fields(body: bytes) -> dict[str, str]:
    """The fields of an ErrorResponse or NoticeResponse body: code letter -> text."""
    out: dict[str, str] = {}
    for part in body.split(b"\x00"):
        if part:
            out[chr(part[0])] = part[1:].decode("utf-8", errors="replace")
    return out


def error_text(fields: dict[str, str]) -> str:
    """As libpq renders an error by default: severity and message, then detail, hint and context."""
    severity = fields.get("V") or fields.get("S") or "ERROR"
    lines = [f"{severity}:  {fields.get('M', '')}"]
    for code, label in (("D", "DETAIL"), ("H", "HINT"), ("W", "CONTEXT")):
        if code in fields:
            lines.append(f"{label}:  {fields[code]}")
    return "\n".join(lines)


def query(sql: bytes) -> bytes:
    """A simple Query message."""
    if b"\x00" in sql:
        raise MalformedMessage("a query cannot hold a zero byte")
    return b"Q" + _I32.pack(len(sql) + 5) + sql + b"\x00"
