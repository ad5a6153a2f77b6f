"""The messages of pgoutput (PostgreSQL 15-18, proto_version 1 to 4; no two-phase) as frozen data.

Data only: no decoding, no state. Positions are ints (see `protocol.lsn` to print them) and times are
microseconds since 2000-01-01 UTC, exactly as they travel. A row is a `TupleData`: one kind byte per
column (`n` null, `u` unchanged TOAST, `t` text, `b` binary) and the matching values, where an unchanged
TOAST value is the `UNCHANGED_TOAST` marker, never None: the column keeps its current value.
"""

from __future__ import annotations

from datetime import datetime
from typing import Final

import msgspec

from protocol.lsn import pg_us_to_datetime

__all__ = [
    "UNCHANGED_TOAST",
    "Begin",
    "Cell",
    "Column",
    "Commit",
    "Delete",
    "Insert",
    "Message",
    "Origin",
    "PgOutputMessage",
    "RawInsert",
    "Relation",
    "StreamAbort",
    "StreamCommit",
    "StreamStart",
    "StreamStop",
    "Truncate",
    "TupleData",
    "Type",
    "UnchangedToast",
    "Update",
]


class UnchangedToast:
    """Marker for a TOASTed value the server did not send because the change left it as it was."""

    __slots__ = ()
    _instance: UnchangedToast | None = None

    def __new__(cls) -> UnchangedToast:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"

    def __reduce__(self) -> str:
        return "UNCHANGED_TOAST"


UNCHANGED_TOAST: Final = UnchangedToast()

Cell = bytes | None | UnchangedToast

KIND_NULL: Final = 0x6E  # 'n'
KIND_UNCHANGED: Final = 0x75  # 'u'
KIND_TEXT: Final = 0x74  # 't'
KIND_BINARY: Final = 0x62  # 'b'


class TupleData(msgspec.Struct, frozen=True, gc=False):
    """One row image: `kinds[i]` says how `values[i]` travelled."""

    kinds: bytes
    values: tuple[Cell, ...]

    def is_null(self, i: int) -> bool:
        return self.kinds[i] == KIND_NULL

    def is_unchanged(self, i: int) -> bool:
        return self.kinds[i] == KIND_UNCHANGED

    def is_binary(self, i: int) -> bool:
        return self.kinds[i] == KIND_BINARY

    def text(self, i: int) -> str | None:
        """Column i as text (text-mode cells only); None for NULL."""
        value = self.values[i]
        if value is None:
            return None
        if not isinstance(value, bytes) or self.kinds[i] != KIND_TEXT:
            raise ValueError(f"column {i} is not a text value (kind {chr(self.kinds[i])!r})")
        return value.decode()


class Column(msgspec.Struct, frozen=True, gc=False):
    name: str
    type_oid: int
    type_modifier: int
    key: bool


class Begin(msgspec.Struct, frozen=True, gc=False, tag="B"):
    final_lsn: int
    commit_time: int
    xid: int


class Commit(msgspec.Struct, frozen=True, gc=False, tag="C"):
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: int


class Origin(msgspec.Struct, frozen=True, gc=False, tag="O"):
    commit_lsn: int
    name: str


class Relation(msgspec.Struct, frozen=True, gc=False, tag="R"):
    relid: int
    namespace: str
    name: str
    replica_identity: str
    columns: tuple[Column, ...]
    xid: int | None = None

    @property
    def schema(self) -> str:
        """pgoutput sends an empty namespace for pg_catalog."""
        return self.namespace or "pg_catalog"

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def key_columns(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.key)


class Type(msgspec.Struct, frozen=True, gc=False, tag="Y"):
    oid: int
    namespace: str
    name: str
    xid: int | None = None


class Insert(msgspec.Struct, frozen=True, gc=False, tag="I"):
    relid: int
    new: TupleData
    xid: int | None = None


class RawInsert(msgspec.Struct, frozen=True, gc=False, tag="i"):
    """An Insert whose new row is still the server's bytes: `data` is pgoutput's TupleData (Int16 column
    count, then each column), not yet read. For transactions that spill, whose rows mostly go to disk
    and back into COPY: `protocol.pgoutput.decode_raw_insert` turns it into the `Insert`."""

    relid: int
    data: bytes
    xid: int | None = None


class Update(msgspec.Struct, frozen=True, gc=False, tag="U"):
    """`old_kind` is 'K' (old key: the key changed) or 'O' (old row: REPLICA IDENTITY FULL) or None."""

    relid: int
    new: TupleData
    old: TupleData | None = None
    old_kind: str | None = None
    xid: int | None = None


class Delete(msgspec.Struct, frozen=True, gc=False, tag="D"):
    relid: int
    old: TupleData
    old_kind: str
    xid: int | None = None


class Truncate(msgspec.Struct, frozen=True, gc=False, tag="T"):
    relids: tuple[int, ...]
    cascade: bool
    restart_identity: bool
    xid: int | None = None


class Message(msgspec.Struct, frozen=True, gc=False, tag="M"):
    """A logical decoding message (`pg_logical_emit_message`)."""

    transactional: bool
    lsn: int
    prefix: str
    content: bytes
    xid: int | None = None


class StreamStart(msgspec.Struct, frozen=True, gc=False, tag="S"):
    xid: int
    first_segment: bool


class StreamStop(msgspec.Struct, frozen=True, gc=False, tag="E"):
    pass


class StreamCommit(msgspec.Struct, frozen=True, gc=False, tag="c"):
    xid: int
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: int


class StreamAbort(msgspec.Struct, frozen=True, gc=False, tag="A"):
    """`subxid == xid`: the whole streamed transaction aborted; else that subtransaction only.

    `abort_lsn` (the abort record's LSN) and `abort_time` come only with proto_version 4 and streaming
    'parallel' (PostgreSQL 16+); None otherwise.
    """

    xid: int
    subxid: int
    abort_lsn: int | None = None
    abort_time: int | None = None


PgOutputMessage = (
    Begin
    | Commit
    | Origin
    | Relation
    | Type
    | Insert
    | Update
    | Delete
    | Truncate
    | Message
    | StreamStart
    | StreamStop
    | StreamCommit
    | StreamAbort
)


def commit_datetime(commit_time: int) -> datetime:
    """A message's `commit_time` as an aware UTC datetime."""
    return pg_us_to_datetime(commit_time)
