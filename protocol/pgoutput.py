"""Decoder of pgoutput's binary messages (PostgreSQL 15-18, proto_version 1 to 4).

`decode(payload)` turns the bytes of one XLogData payload into one message from `protocol.messages`,
through a table from tag byte to one small function per message. In a proto_version 2+ stream the row,
schema and logical messages between Stream Start and Stream Stop carry a leading xid: `Decoder` tracks
that state; `decode(..., streaming=True)` is the stateless form. Any input that is not exactly one
well-formed message raises `ProtocolError` (with the LSN when the caller gives it), never anything else.

What the versions change, as far as pgmesh asks for it: 2 adds streaming of in-progress transactions;
3 adds the two-phase messages (Begin Prepare, Prepare, Commit / Rollback Prepared, Stream Prepare), sent
only with `two_phase 'on'`, which pgmesh never asks for (a prepared transaction then arrives whole at
COMMIT PREPARED, like any other): they are not decoded (UnknownMessage); 4 (PostgreSQL 16+) allows
streaming 'parallel', under which, and only then, Stream Abort also carries the abort's LSN and time.
The bytes do not say which: the caller does (`abort_info`, true exactly when it asked for 'parallel').

`raw_insert` splits an Insert without reading its row (`RawInsert`), for rows that are only copied
through; `decode_raw_insert` reads it later, exactly as `decode` would have.

This is the hot path of the router (every row change of every node passes here once), so it is written
for speed: separate reader tables in and out of stream blocks (no per-row xid test), the message read in
place from a whole XLogData body (`offset`), and row images read through compiled layouts (`_Shape`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any, Final

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
    RawInsert,
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

__all__ = [
    "Decoder", "decode", "decode_raw_insert", "raw_copy_text", "raw_insert", "raw_insert_run", "raw_tuple",
]

_I16: Final = struct.Struct(">h")
_I32: Final = struct.Struct(">i")
_U32: Final = struct.Struct(">I")
_I64: Final = struct.Struct(">q")
_U64: Final = struct.Struct(">Q")
_BEGIN: Final = struct.Struct(">QqI")
_COMMIT: Final = struct.Struct(">BQQq")
_STREAM_COMMIT: Final = struct.Struct(">IBQQq")
_STREAM_ABORT: Final = struct.Struct(">II")
_STREAM_ABORT_INFO: Final = struct.Struct(">IIQq")  # proto_version 4, streaming 'parallel': + abort LSN, time
_STREAM_START: Final = struct.Struct(">IB")
_COLUMN_TAIL: Final = struct.Struct(">Ii")
_MESSAGE_HEAD: Final = struct.Struct(">BQ")
_TRUNCATE_HEAD: Final = struct.Struct(">iB")
_ROW_HEAD: Final = struct.Struct(">IB")  # relation id, then the first tuple's marker byte

_TRUNCATE_CASCADE: Final = 1
_TRUNCATE_RESTART_IDENTITY: Final = 2
_MESSAGE_TRANSACTIONAL: Final = 1
_REPLICA_IDENTITIES: Final = frozenset("dnfi")

_Reader = Callable[[bytes, int], tuple[PgOutputMessage, int]]
_XidReader = Callable[[bytes, int, int | None], tuple[PgOutputMessage, int]]


def _cstring(buf: bytes, pos: int) -> tuple[str, int]:
    end = buf.find(b"\x00", pos)
    if end < 0:
        raise TruncatedMessage("unterminated string")
    return buf[pos:end].decode("utf-8"), end + 1


def _tuple(buf: bytes, pos: int) -> tuple[TupleData, int]:
    """TupleData: Int16 column count, then per column a kind byte and, for 't'/'b', Int32 length + bytes.

    Through a compiled layout when one is known for this many remaining bytes and matches, else column
    by column (see `_Shape`).
    """
    key = len(buf) - pos
    shape = _SHAPES.get(key)
    if isinstance(shape, tuple):
        unpack, header_of, header, values_of, kinds, size, _ = shape
        fields = unpack(buf, pos)  # size <= key: it was learned from a tuple just as far from the end
        if header_of(fields) == header:
            return TupleData(kinds, values_of(fields + _FILL)), pos + size
    data, end = _columns(buf, pos)
    if shape is None or isinstance(shape, tuple) or shape < _RELEARN_MAX:
        _learn(key, shape, data, end - pos)
    return data, end


def _columns(buf: bytes, pos: int) -> tuple[TupleData, int]:
    """`_tuple` column by column.

    The loop checks no bounds: reading past the end (IndexError / struct.error) and a value running
    past the end (a length that does not fit, or a negative one read as a huge unsigned one: slices stop
    at the end, and the final `pos > len(buf)` check catches it) both come out as TruncatedMessage.
    """
    natts = _I16.unpack_from(buf, pos)[0]
    if natts < 0:
        raise MalformedMessage(f"negative column count {natts}")
    pos += 2
    kinds = bytearray(natts)
    values: list[Cell] = [None] * natts
    unpack_len = _U32.unpack_from  # unsigned: a "negative" length runs past the end, caught below
    i = 0
    try:
        for i in range(natts):
            kind = buf[pos]
            kinds[i] = kind
            if kind == 0x62 or kind == 0x74:  # 'b', 't': Int32 length, then the value
                start = pos + 5
                pos = start + unpack_len(buf, pos + 1)[0]
                values[i] = buf[start:pos]
            elif kind == 0x6E:  # 'n'
                pos += 1
            elif kind == 0x75:  # 'u'
                values[i] = UNCHANGED_TOAST
                pos += 1
            else:
                raise MalformedMessage(f"column {i + 1} has unknown kind byte {kind:#04x}")
    except (IndexError, struct.error):
        if pos > len(buf):
            raise TruncatedMessage(f"column {i} value does not fit") from None
        raise TruncatedMessage(f"tuple ends before column {i + 1} of {natts}") from None
    if pos > len(buf):
        raise TruncatedMessage(f"column {natts} value does not fit")
    return TupleData(bytes(kinds), tuple(values)), pos


# A compiled tuple layout. The row images of a table tend to repeat one layout (column count, kind
# bytes, value lengths): fixed-width binary values, text of a steady width. A layout read twice at the
# same distance from the end of the message is compiled into one struct that reads the whole tuple in
# one call. Before its values are used, the header fields it read (column count, every kind byte, every
# length) are compared with the layout's, so a tuple decodes exactly as it would column by column; one
# that does not match is read column by column and may replace the layout, up to _RELEARN_MAX times.
#   (unpack_from, fields -> header fields, the layout's header fields, fields + _FILL -> values,
#    kind bytes, bytes read, times relearned)
_Fields = tuple[Any, ...]
_Shape = tuple[
    Callable[[bytes, int], _Fields], Callable[[_Fields], _Fields], _Fields, Callable[[_Fields], _Fields],
    bytes, int, int,
]
# Remaining bytes at the tuple -> its layout, or how many times one was (re)learned there so far.
_SHAPES: Final[dict[int, _Shape | int]] = {}
_SHAPES_MAX: Final = 4096  # distinct remaining lengths remembered before all are forgotten
_SHAPE_MAX_BYTES: Final = 1 << 16
_RELEARN_MAX: Final = 8
_FILL: Final = (None, UNCHANGED_TOAST)  # what 'n' and 'u' columns pick


def _learn(key: int, state: _Shape | int | None, data: TupleData, size: int) -> None:
    """After a tuple was read column by column: remember its length, or compile its layout."""
    if state is None:  # first time this far from the end: compile only if it comes again
        if len(_SHAPES) >= _SHAPES_MAX:
            _SHAPES.clear()
        _SHAPES[key] = 0
        return
    learned = state[6] + 1 if isinstance(state, tuple) else state
    if learned >= _RELEARN_MAX or len(data.kinds) < 2 or size > _SHAPE_MAX_BYTES:
        _SHAPES[key] = _RELEARN_MAX  # not worth it here: column by column from now on
        return
    fmt = [">h"]
    header_at = [0]
    header: list[int] = [len(data.kinds)]
    value_at = []
    n = 1
    for kind, value in zip(data.kinds, data.values, strict=True):
        if isinstance(value, bytes):
            fmt.append(f"BI{len(value)}s")
            header_at += (n, n + 1)
            header += (kind, len(value))
            value_at.append(n + 2)
            n += 3
        else:
            fmt.append("B")
            header_at.append(n)
            header.append(kind)
            value_at.append(-2 if value is None else -1)  # into _FILL, after the n fields
            n += 1
    compiled = struct.Struct("".join(fmt))
    if compiled.size != size:  # cannot happen: the layout is what was just read
        raise AssertionError(f"tuple layout of {compiled.size} bytes for a tuple of {size}")
    pick_values = itemgetter(*[i if i >= 0 else n + 2 + i for i in value_at])
    _SHAPES[key] = (
        compiled.unpack_from, itemgetter(*header_at), tuple(header), pick_values, data.kinds, size, learned
    )


def _begin(buf: bytes, pos: int) -> tuple[PgOutputMessage, int]:
    final_lsn, commit_time, xid = _BEGIN.unpack_from(buf, pos)
    return Begin(final_lsn, commit_time, xid), pos + _BEGIN.size


def _commit(buf: bytes, pos: int) -> tuple[PgOutputMessage, int]:
    flags, commit_lsn, end_lsn, commit_time = _COMMIT.unpack_from(buf, pos)
    return Commit(flags, commit_lsn, end_lsn, commit_time), pos + _COMMIT.size


def _origin(buf: bytes, pos: int) -> tuple[PgOutputMessage, int]:
    commit_lsn = _U64.unpack_from(buf, pos)[0]
    name, pos = _cstring(buf, pos + 8)
    return Origin(commit_lsn, name), pos


# The readers of the messages that carry a leading xid inside a proto_version 2+ stream block take it as
# an argument: None outside a block (the plain table calls them with two arguments), read by `_in_block`.


def _relation(buf: bytes, pos: int, xid: int | None = None) -> tuple[PgOutputMessage, int]:
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


def _type(buf: bytes, pos: int, xid: int | None = None) -> tuple[PgOutputMessage, int]:
    oid = _U32.unpack_from(buf, pos)[0]
    namespace, pos = _cstring(buf, pos + 4)
    name, pos = _cstring(buf, pos)
    return Type(oid, namespace, name, xid), pos


def _insert(buf: bytes, pos: int, xid: int | None = None) -> tuple[PgOutputMessage, int]:
    relid, marker = _ROW_HEAD.unpack_from(buf, pos)
    if marker != 0x4E:  # 'N'
        raise MalformedMessage(f"insert: expected 'N' before the new tuple, got {marker:#04x}")
    new, pos = _tuple(buf, pos + 5)
    return Insert(relid, new, xid), pos


def raw_insert(
    buf: bytes | memoryview, offset: int, *, streaming: bool, lsn: int | None = None
) -> RawInsert:
    """The Insert message at `offset` (to the end of `buf`) with its row left undecoded (`RawInsert`);
    only the row's bytes are copied (a memoryview is read in place).

    Reads only the relation id (and, in a stream block, the xid): a row that is only going to be
    copied through (to a spill file, then into COPY) is decoded once, at the end, or never.
    """
    try:
        if buf[offset] != 0x49:  # 'I'
            raise MalformedMessage(f"not an insert: tag {buf[offset]:#04x}")
        pos = offset + 1
        xid = None
        if streaming:
            xid = _U32.unpack_from(buf, pos)[0]
            pos += 4
        relid, marker = _ROW_HEAD.unpack_from(buf, pos)
        if marker != 0x4E:  # 'N'
            raise MalformedMessage(f"insert: expected 'N' before the new tuple, got {marker:#04x}")
    except (ProtocolError, struct.error, IndexError) as exc:
        raise _located(exc, lsn, 0x49) from None
    return RawInsert(relid, bytes(buf[pos + 5 :]), xid)


def raw_insert_run(bufs: Sequence[bytes | memoryview], offset: int, *, streaming: bool) -> list[RawInsert]:
    """`raw_insert` of each of `bufs` (each an Insert message at `offset`), in one loop. Raises
    ProtocolError for the first that is not one (without its LSN: call `raw_insert` on it for that)."""
    unpack_head = _ROW_HEAD.unpack_from
    unpack_xid = _U32.unpack_from
    pos = offset + 5 if streaming else offset + 1
    out: list[RawInsert] = []
    append = out.append
    try:
        for buf in bufs:
            relid, marker = unpack_head(buf, pos)
            if buf[offset] != 0x49 or marker != 0x4E:  # 'I', then 'N' before the new tuple
                raise MalformedMessage("not an insert with a new tuple")
            xid = unpack_xid(buf, offset + 1)[0] if streaming else None
            append(RawInsert(relid, bytes(buf[pos + 5 :]), xid))
    except (ProtocolError, struct.error, IndexError) as exc:
        raise _located(exc, None, 0x49) from None
    return out


def raw_copy_text(rows: Sequence[RawInsert], width: int) -> bytes | None:
    """The rows of `rows` (each `width` text columns) as COPY text lines, without reading them one by
    one; None when that cannot be done safely (a NULL, a value of 64 kB or more, a value COPY would need
    escaped, a binary value: the caller reads them one by one).

    A text value never holds a zero byte (PostgreSQL's output functions write C strings), so the only
    places where b"t\\0\\0" occurs in a row are the heads of its text cells shorter than 64 kB ('t', then
    an Int32 length below 65,536): splitting there, and dropping the length's last two bytes from each
    piece, leaves the values. What is checked: as many pieces as cells, each row's column count, and
    that no value holds a tab, a newline, a carriage return or a backslash. The lengths themselves are
    not read (the server wrote them; `raw_tuple` reads them, for rows that take the slow way).
    """
    n = len(rows)
    if not n or not 0 < width < 256:
        return None
    head = _I16.pack(width)
    joined = b"".join([r.data for r in rows])
    pieces = joined.split(b"t\0\0")
    if len(pieces) != n * width + 1 or pieces[0] != head:
        return None
    del pieces[0]
    # Each row's column count (at the end of the piece before it) starts the next line.
    text = b"\t".join([p[2:] for p in pieces]).replace(head + b"\t", b"\n")
    if (
        text.count(b"\n") != n - 1
        or text.count(b"\t") != n * (width - 1)
        or b"\\" in text
        or b"\r" in text
        or b"\0" in text
    ):
        return None
    return text + b"\n"


def raw_tuple(raw: RawInsert) -> TupleData:
    """The row of a `RawInsert`, decoded (exactly as `decode` would have)."""
    try:
        new, end = _tuple(raw.data, 0)
    except (ProtocolError, struct.error, IndexError) as exc:
        raise _located(exc, None, 0x49) from None
    if end != len(raw.data):
        raise MalformedMessage(f"{len(raw.data) - end} unexpected bytes after the insert's row", tag="I")
    return new


def decode_raw_insert(raw: RawInsert) -> Insert:
    """The `Insert` a `RawInsert` stands for."""
    return Insert(raw.relid, raw_tuple(raw), raw.xid)


def _update(buf: bytes, pos: int, xid: int | None = None) -> tuple[PgOutputMessage, int]:
    relid, marker = _ROW_HEAD.unpack_from(buf, pos)
    if marker == 0x4E:  # 'N': no old tuple
        new, pos = _tuple(buf, pos + 5)
        return Update(relid, new, None, None, xid), pos
    if marker != 0x4B and marker != 0x4F:  # 'K' old key, 'O' old row
        raise MalformedMessage(f"update: expected 'N' before the new tuple, got {marker:#04x}")
    old, pos = _tuple(buf, pos + 5)
    if buf[pos] != 0x4E:
        raise MalformedMessage(f"update: expected 'N' before the new tuple, got {buf[pos]:#04x}")
    new, pos = _tuple(buf, pos + 1)
    return Update(relid, new, old, chr(marker), xid), pos


def _delete(buf: bytes, pos: int, xid: int | None = None) -> tuple[PgOutputMessage, int]:
    relid, marker = _ROW_HEAD.unpack_from(buf, pos)
    if marker != 0x4B and marker != 0x4F:
        raise MalformedMessage(f"delete: expected 'K' or 'O' before the old tuple, got {marker:#04x}")
    old, pos = _tuple(buf, pos + 5)
    return Delete(relid, old, chr(marker), xid), pos


def _truncate(buf: bytes, pos: int, xid: int | None = None) -> tuple[PgOutputMessage, int]:
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


def _message(buf: bytes, pos: int, xid: int | None = None) -> tuple[PgOutputMessage, int]:
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


def _in_block(reader: _XidReader) -> _Reader:
    """The form of `reader` for inside a stream block: an Int32 xid comes first."""

    def read(buf: bytes, pos: int) -> tuple[PgOutputMessage, int]:
        return reader(buf, pos + 4, _U32.unpack_from(buf, pos)[0])

    return read


def _stream_start(buf: bytes, pos: int) -> tuple[PgOutputMessage, int]:
    xid, first = _STREAM_START.unpack_from(buf, pos)
    if first > 1:
        raise MalformedMessage(f"stream start: first-segment flag {first}")
    return StreamStart(xid, first == 1), pos + _STREAM_START.size


def _stream_stop(buf: bytes, pos: int) -> tuple[PgOutputMessage, int]:
    return StreamStop(), pos


def _stream_commit(buf: bytes, pos: int) -> tuple[PgOutputMessage, int]:
    xid, flags, commit_lsn, end_lsn, commit_time = _STREAM_COMMIT.unpack_from(buf, pos)
    return StreamCommit(xid, flags, commit_lsn, end_lsn, commit_time), pos + _STREAM_COMMIT.size


def _stream_abort(buf: bytes, pos: int) -> tuple[PgOutputMessage, int]:
    xid, subxid = _STREAM_ABORT.unpack_from(buf, pos)
    return StreamAbort(xid, subxid), pos + _STREAM_ABORT.size


def _stream_abort_info(buf: bytes, pos: int) -> tuple[PgOutputMessage, int]:
    xid, subxid, abort_lsn, abort_time = _STREAM_ABORT_INFO.unpack_from(buf, pos)
    return StreamAbort(xid, subxid, abort_lsn, abort_time), pos + _STREAM_ABORT_INFO.size


# Outside a stream block (and always in proto_version 1).
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
_XID_READERS: Final[dict[int, _XidReader]] = {
    ord("R"): _relation,
    ord("Y"): _type,
    ord("I"): _insert,
    ord("U"): _update,
    ord("D"): _delete,
    ord("T"): _truncate,
    ord("M"): _message,
}
# Between Stream Start and Stream Stop.
_STREAM_READERS: Final[dict[int, _Reader]] = {
    **_READERS,
    **{tag: _in_block(reader) for tag, reader in _XID_READERS.items()},
}
# The same four tables when Stream Abort carries the abort's LSN and time (streaming 'parallel').
_READERS_ABORT_INFO: Final[dict[int, _Reader]] = {**_READERS, ord("A"): _stream_abort_info}
_STREAM_READERS_ABORT_INFO: Final[dict[int, _Reader]] = {**_STREAM_READERS, ord("A"): _stream_abort_info}
_TABLES: Final = {False: (_READERS, _STREAM_READERS), True: (_READERS_ABORT_INFO, _STREAM_READERS_ABORT_INFO)}
_STREAM_START_TAG: Final = 0x53  # 'S'
_STREAM_STOP_TAG: Final = 0x45  # 'E'


def _located(exc: Exception, lsn: int | None, tag: int) -> ProtocolError:
    """The ProtocolError for an exception out of a reader, naming the LSN and the message tag."""
    if isinstance(exc, ProtocolError):
        return type(exc)(exc.detail, lsn=lsn, tag=chr(tag))
    if isinstance(exc, UnicodeDecodeError):
        return MalformedMessage(f"name is not valid UTF-8 ({exc.reason})", lsn=lsn, tag=chr(tag))
    return TruncatedMessage(f"message ends early ({exc})", lsn=lsn, tag=chr(tag))  # struct.error, IndexError


def _not_one_message(buf: bytes, offset: int, lsn: int | None, end: int | None = None) -> ProtocolError:
    """The error for a `buf[offset:]` that is empty, of an unknown tag, or longer than its message."""
    if offset >= len(buf):
        return TruncatedMessage("empty message", lsn=lsn)
    tag = buf[offset]
    if end is not None:
        return MalformedMessage(f"{len(buf) - end} unexpected bytes after the message", lsn=lsn, tag=chr(tag))
    return UnknownMessage(f"unknown pgoutput message tag {tag:#04x}", lsn=lsn, tag=chr(tag))


def decode(
    payload: bytes | bytearray | memoryview,
    *,
    lsn: int | None = None,
    streaming: bool = False,
    offset: int = 0,
    abort_info: bool = False,
) -> PgOutputMessage:
    """Decode exactly one pgoutput message. `streaming`: inside a Stream Start/Stop block (xid prefix).

    `offset`: where the message starts in `payload` (it runs to the end), so that a caller holding a
    whole XLogData body need not copy the payload out of it. `abort_info`: the stream was started with
    proto_version 4 and streaming 'parallel' (Stream Abort carries the abort's LSN and time).
    """
    buf = payload if isinstance(payload, bytes) else bytes(payload)
    if offset < 0:
        raise ValueError(f"negative offset {offset}")
    tag = buf[offset] if offset < len(buf) else -1
    reader = _TABLES[abort_info][streaming].get(tag)
    if reader is None:
        raise _not_one_message(buf, offset, lsn)
    try:
        message, end = reader(buf, offset + 1)
    except (ProtocolError, struct.error, IndexError, UnicodeDecodeError) as exc:
        raise _located(exc, lsn, tag) from None
    if end != len(buf):
        raise _not_one_message(buf, offset, lsn, end)
    return message


class Decoder:
    """Stateful front of `decode`: knows whether a stream block is open, and whether Stream Abort
    carries the abort's LSN and time (`abort_info`: proto_version 4 with streaming 'parallel')."""

    __slots__ = ("_inside", "_outside", "abort_info", "in_stream")

    def __init__(self, *, abort_info: bool = False) -> None:
        self.in_stream = False
        self.abort_info = abort_info
        self._outside, self._inside = _TABLES[abort_info]

    def reset(self, *, abort_info: bool | None = None) -> None:
        """Forget stream state (after a reconnect the server starts every block afresh); `abort_info`:
        what the new stream was started with (None: as before)."""
        self.in_stream = False
        if abort_info is not None:
            self.abort_info = abort_info
            self._outside, self._inside = _TABLES[abort_info]

    def decode(
        self, payload: bytes | bytearray | memoryview, lsn: int | None = None, offset: int = 0
    ) -> PgOutputMessage:
        """Decode one message (from `offset` to the end of `payload`) and track Stream Start / Stop.

        The body of `decode()` again (this is the hot path: one call less per message).
        """
        buf = payload if isinstance(payload, bytes) else bytes(payload)
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        tag = buf[offset] if offset < len(buf) else -1
        reader = (self._inside if self.in_stream else self._outside).get(tag)
        if reader is None:
            raise _not_one_message(buf, offset, lsn)
        try:
            message, end = reader(buf, offset + 1)
        except (ProtocolError, struct.error, IndexError, UnicodeDecodeError) as exc:
            raise _located(exc, lsn, tag) from None
        if end != len(buf):
            raise _not_one_message(buf, offset, lsn, end)
        if tag in (0x53, 0x45):  # Stream Start, Stream Stop
            self._block(tag, lsn)
        return message

    def _block(self, tag: int, lsn: int | None) -> None:
        if tag == _STREAM_START_TAG:
            if self.in_stream:
                raise WrongState("Stream Start inside an open stream block", lsn=lsn, tag="S")
            self.in_stream = True
        else:
            if not self.in_stream:
                raise WrongState("Stream Stop outside a stream block", lsn=lsn, tag="E")
            self.in_stream = False
