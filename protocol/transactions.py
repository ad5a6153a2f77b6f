"""The transaction assembler: messages in, whole committed transactions out.

Fed the decoded messages of one replication stream in order, it hands out a `Transaction` only when
its Commit (or, for a proto_version 2 streamed transaction, its Stream Commit) arrives, and a
non-transactional logical message as soon as it arrives. Aborted streamed transactions and aborted
subtransactions of them are dropped here. It keeps the relation cache, so every row change it accepts
names a relation it knows.

Memory: with `spill_bytes` set, a transaction whose buffered payload grows past it is handed out in
pieces: `feed` returns a `Spill` (the changes taken out of the transaction, in stream order) for the
caller to put somewhere, and the final `Transaction` says how many changes went that way (`spilled`)
before its in-memory tail. A streamed transaction that had spilled and is then aborted comes out as
`SpillDropped`. The caller may feed inserts undecoded (`RawInsert`): a Spill may hold them, a
Transaction never does (those still in memory are decoded at the commit). Before feeding the Commit (or
Stream Commit) of a transaction that has spilled, the caller may take its in-memory tail as one last
Spill (`spill_tail`), so that all of it is on disk and none of it is decoded here. It does no I/O itself:
where spilled changes go, and how they are read back, is the caller's business (the router's
`router/stream/spool.py`). What it keeps of a spilled part is what a reader asks of a transaction without
reading it back: how many changes and rows went, and the prefixes of its logical messages
(`Transaction.prefixes`: whether it carries a DDL command is a set lookup, spilled or not).
"""

from __future__ import annotations

import sys
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from itertools import accumulate
from operator import attrgetter
from typing import Any, Final

import msgspec

from protocol.changes import Change, SpilledChange, prefixes_of
from protocol.errors import MalformedMessage, WrongState
from protocol.messages import (
    Begin,
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
    Type,
    Update,
)
from protocol.pgoutput import decode_raw_insert
from protocol.relations import RelationCache

__all__ = ["Change", "Spill", "SpillDropped", "SpilledChange", "Transaction", "TransactionAssembler"]

# Change, SpilledChange (an Insert fed undecoded, decoded at the commit if it is still in memory): the
# kinds of change a transaction holds (protocol.changes)
_ROW_CHANGES: Final = (Insert, RawInsert, Update, Delete, Truncate, Message)
_ROWS: Final = (Insert, RawInsert, Update, Delete)
_ROW_TYPES: Final = frozenset(_ROWS)  # `feed` handles these itself
_XID: Final = attrgetter("xid")
_NO_PREFIXES: Final[frozenset[str]] = frozenset()
# `Transaction.prefixes` not given (a transaction built by hand): collected from its changes at construction
_COLLECT: Final[frozenset[str]] = frozenset({"(collected from the changes)"})


class Transaction(msgspec.Struct, frozen=True, gc=False):
    """One committed source transaction, whole, in the source's order.

    `changes` holds the row changes, transactional logical messages and any Relation / Type message
    that arrived inside the transaction, in stream order. `relations` maps every relation id the
    changes use to its description as of its first use here; a consumer that walks `changes` and
    replaces its entry on each inline Relation always holds the description each change was sent with.
    `row_count` is the number of Insert / Update / Delete changes: the assembler counts them as they
    arrive; a Transaction built by hand without it (-1) counts its `changes` when constructed.

    A transaction that outgrew the assembler's `spill_bytes` was handed out in `Spill` pieces first:
    its first `spilled` changes are wherever the caller put them (`spill`: the caller's handle, never
    looked at here), `changes` is only the tail still in memory and `nbytes` only the tail's size;
    `row_count` still counts every row. Changes of the subtransactions in `aborted_subxids` (aborted
    after part of the transaction had spilled) must be dropped from the spilled part when reading it
    back; the tail is already without them.

    `seen` is set by the router, never by the decoder (the assembler leaves it `()`): the versions the
    source node had already applied from each other node when this transaction committed there, as
    (node name, newest commit time of that node's transactions applied on the source so far, in µs since
    2000-01-01 like `commit_time`) pairs sorted by node name. `()` means nothing is known (a router
    restart starts it empty), never "saw nothing": every version of another node then counts as
    concurrent. Its fan-out sets it (router.stream.seen); router.conflicts.causality reads it.

    `prefixes`: the prefixes of the transactional logical messages it holds, its spilled part included
    (so `"pgmesh.ddl" in txn.prefixes` tells whether it carries a DDL command without reading a spill
    back); a subtransaction aborted after part of it spilled leaves those of its own spilled messages.
    The assembler records them as the messages arrive; for a transaction handed out before its commit
    (`open_transaction`, `open_stream`) it is the assembler's own set, which keeps growing (the finished
    Transaction carries the same set). A Transaction built by hand without them collects them from its
    `changes` when constructed.
    """

    xid: int
    commit_lsn: int
    end_lsn: int
    commit_time: int
    changes: list[Change]
    relations: dict[int, Relation]
    origin: str | None = None
    origin_lsn: int | None = None
    streamed: bool = False
    nbytes: int = 0
    row_count: int = -1
    spilled: int = 0
    aborted_subxids: tuple[int, ...] = ()
    spill: Any = None
    seen: tuple[tuple[str, int], ...] = ()
    prefixes: AbstractSet[str] = _COLLECT

    def __post_init__(self) -> None:
        if self.row_count < 0:
            msgspec.structs.force_setattr(self, "row_count", _count_rows(self.changes))
        if self.prefixes is _COLLECT:
            msgspec.structs.force_setattr(self, "prefixes", frozenset(prefixes_of(self.changes)))


class Spill(msgspec.Struct, frozen=True, gc=False):
    """Changes taken out of open transaction `xid` (top-level xid), in stream order, to keep elsewhere.

    Successive Spills of one transaction continue each other; its `Transaction` comes later with the
    rest. `nbytes`: the payload bytes these changes arrived in.
    """

    xid: int
    changes: list[SpilledChange]
    nbytes: int = 0


class SpillDropped(msgspec.Struct, frozen=True, gc=False):
    """Streamed transaction `xid`, part of which was spilled, was aborted: its spilled changes are void."""

    xid: int


def _count_rows(changes: list[Change] | list[SpilledChange]) -> int:
    return sum(1 for c in changes if isinstance(c, _ROWS))


class _Builder:
    """A transaction being received."""

    __slots__ = (
        "aborted", "changes", "commit_time", "final_lsn", "nbytes", "origin", "origin_lsn", "others",
        "prefixes", "relations", "rows_by_xid", "rows_spilled", "spilled", "spilled_prefixes", "xid",
    )

    def __init__(self, xid: int, final_lsn: int | None = None, commit_time: int = 0) -> None:
        self.xid = xid
        self.final_lsn = final_lsn  # None: a streamed transaction
        self.commit_time = commit_time  # from Begin (plain transactions only)
        self.changes: list[SpilledChange] = []
        self.relations: dict[int, Relation] = {}
        self.origin: str | None = None
        self.origin_lsn: int | None = None
        self.nbytes = 0
        # Changes that are not Insert / Update / Delete (rare), so the row count is len(changes) - others.
        self.others = 0
        # What was handed out in Spills: how many changes, how many of them rows, and (streamed only,
        # for aborts of subtransactions) the rows per xid; the subxids aborted after a spill.
        self.spilled = 0
        self.rows_spilled = 0
        self.rows_by_xid: Counter[int | None] | None = None
        self.aborted: list[int] | None = None
        # The prefixes of its logical messages, spilled ones included (None: none yet; made when the first
        # comes, or when a Transaction handed out before the commit shares it); of a streamed one, also
        # those of its spilled part alone (a subtransaction's abort takes only in-memory ones away).
        self.prefixes: set[str] | None = None
        self.spilled_prefixes: set[str] | None = None

    def shared_prefixes(self) -> set[str]:
        """`prefixes`, made now if need be: a Transaction handed out before the commit holds this set."""
        if self.prefixes is None:
            self.prefixes = set()
        return self.prefixes

    def spill(self) -> Spill:
        changes = self.changes
        rows = len(changes) - self.others
        if self.final_lsn is None:  # streamed: a subtransaction may still be aborted
            if self.rows_by_xid is None:
                self.rows_by_xid = Counter()
            if self.others:
                self.rows_by_xid.update(c.xid for c in changes if type(c) in _ROW_TYPES)
                if self.prefixes:
                    if self.spilled_prefixes is None:
                        self.spilled_prefixes = set()
                    self.spilled_prefixes.update(prefixes_of(changes))
            else:  # rows only (nearly always): their xids counted in C
                self.rows_by_xid.update(map(_XID, changes))
        out = Spill(self.xid, changes, self.nbytes)
        self.changes = []
        self.others = 0
        self.nbytes = 0
        self.spilled += len(changes)
        self.rows_spilled += rows
        return out

    def finish(self, commit_lsn: int, end_lsn: int, commit_time: int, streamed: bool) -> Transaction:
        rows = self.rows_spilled + len(self.changes) - self.others
        # Inserts fed undecoded and still in memory are decoded now: a Transaction holds none.
        tail: list[Change] = [decode_raw_insert(c) if isinstance(c, RawInsert) else c for c in self.changes]
        prefixes = _NO_PREFIXES if self.prefixes is None else self.prefixes
        if not self.spilled:
            return Transaction(
                self.xid, commit_lsn, end_lsn, commit_time, tail, self.relations, self.origin,
                self.origin_lsn, streamed, self.nbytes, rows, prefixes=prefixes,
            )
        return Transaction(
            self.xid, commit_lsn, end_lsn, commit_time, tail, self.relations,
            self.origin, self.origin_lsn, streamed, self.nbytes, rows, self.spilled,
            tuple(self.aborted or ()), prefixes=prefixes,
        )


Output = Transaction | Message | Spill | SpillDropped | None


class TransactionAssembler:
    """Feed it every decoded message with its WAL position; it returns what is complete."""

    __slots__ = (
        "_current", "_handlers", "_in_stream", "_spill_at", "_streams", "buffered_bytes", "relations",
    )

    def __init__(self, spill_bytes: int | None = None) -> None:
        """`spill_bytes`: the most payload bytes one open transaction keeps before a `Spill` (None: no
        bound; everything stays in memory until its commit)."""
        if spill_bytes is not None and spill_bytes < 0:
            raise ValueError(f"spill_bytes must be >= 0 or None, not {spill_bytes}")
        self._spill_at = sys.maxsize if spill_bytes is None else spill_bytes
        self.relations = RelationCache()
        self._current: _Builder | None = None
        self._streams: dict[int, _Builder] = {}
        self._in_stream: _Builder | None = None
        self.buffered_bytes = 0
        # Every other message: dispatch on the exact type; each handler takes the type it is registered for.
        self._handlers: dict[type, Callable[[Any, int | None, int], Output]] = {
            Begin: self._begin,
            Commit: self._commit,
            Origin: self._origin,
            Relation: self._schema,
            Type: self._schema,
            Truncate: self._truncate,
            Message: self._message,
            StreamStart: self._stream_start,
            StreamStop: self._stream_stop,
            StreamCommit: self._stream_commit,
            StreamAbort: self._stream_abort,
        }

    def in_echo(self) -> bool:
        """Whether the open transaction carries a replication origin (its rows may go unread)."""
        builder = self._in_stream or self._current
        return builder is not None and builder.origin is not None

    def open_transaction(self) -> Transaction | None:
        """The plain (not streamed) transaction being received, as far as it came, or None.

        Its Begin already told its commit LSN (`commit_lsn`; `end_lsn` is unknown yet and set to the
        same) and commit time; `changes` is empty, `spilled` and `row_count` count what was handed out
        in Spills, and `relations` is the assembler's own dict for it, which keeps growing as later
        changes name more relations (the finished Transaction carries the same dict). A consumer may
        start on the spilled part before the Commit arrives: the server decoded it after the commit.
        """
        builder = self._current
        if builder is None or builder.final_lsn is None or self._in_stream is not None:
            return None
        return Transaction(
            builder.xid, builder.final_lsn, builder.final_lsn, builder.commit_time, [], builder.relations,
            builder.origin, builder.origin_lsn, False, 0, builder.rows_spilled, builder.spilled,
            prefixes=builder.shared_prefixes(),
        )

    def open_stream(self, xid: int) -> Transaction | None:
        """Streamed transaction `xid` (proto_version 2) as far as it came, or None when none is open.

        Like `open_transaction`, but nothing says yet whether it will commit, nor where or when:
        `commit_lsn`, `end_lsn` and `commit_time` are 0 and `streamed` is True. `relations` is the
        assembler's own dict for it (it keeps growing). Its changes name their own (sub)transaction's
        xid; a subtransaction's may still be aborted (`Transaction.aborted_subxids` at its commit).
        """
        builder = self._streams.get(xid)
        if builder is None:
            return None
        return Transaction(
            builder.xid, 0, 0, 0, [], builder.relations, builder.origin, builder.origin_lsn, True, 0,
            builder.rows_spilled, builder.spilled, prefixes=builder.shared_prefixes(),
        )

    def spill_tail(self, ending: Commit | StreamCommit) -> Spill | None:
        """What the transaction that `ending` (fed next) commits still holds in memory, as a Spill,
        when it has spilled before and holds anything; else None. Then all of it is on disk, and its
        commit decodes nothing (the Transaction's tail is empty). Raises nothing: a message that does
        not fit an open transaction is left for `feed` to report."""
        if isinstance(ending, StreamCommit):
            builder = self._streams.get(ending.xid)
        else:
            builder = None if self._in_stream is not None else self._current
        if builder is None or not builder.spilled or not builder.changes:
            return None
        return self._spill(builder)

    @property
    def spilling(self) -> bool:
        """True while a plain transaction that has spilled is still being received."""
        builder = self._current
        return builder is not None and builder.spilled > 0

    @property
    def idle(self) -> bool:
        """True when no transaction is partly received."""
        return self._current is None and not self._streams

    def reset(self) -> None:
        """Drop partial transactions (spilled parts included: they are void) and relations (the server
        resends all of them after a reconnect)."""
        self.relations.clear()
        self._current = None
        self._streams.clear()
        self._in_stream = None
        self.buffered_bytes = 0

    def feed(self, message: PgOutputMessage | RawInsert, lsn: int | None = None, size: int = 0) -> Output:
        """Take one message (`size`: its payload length, for memory accounting); an Insert may come
        undecoded (`RawInsert`)."""
        if type(message) not in _ROW_TYPES:
            return self._handlers[type(message)](message, lsn, size)
        # Insert / Update / Delete, nearly every message: handled here, without the handler call.
        builder = self._in_stream or self._current
        if builder is None:
            raise WrongState("row change outside any transaction", lsn=lsn, tag=_tag(message))
        relid = message.relid  # type: ignore[union-attr]  # one of the _ROW_TYPES
        known = builder.relations
        if relid not in known:
            known[relid] = self.relations.get(relid, lsn=lsn, tag=_tag(message))
        builder.changes.append(message)  # type: ignore[arg-type]  # Change includes the _ROW_TYPES
        held = builder.nbytes = builder.nbytes + size
        self.buffered_bytes += size
        if held > self._spill_at:
            return self._spill(builder)
        return None

    def feed_rows(self, rows: list[RawInsert], sizes: list[int], lsn: int | None = None) -> list[Spill]:
        """`feed` each of `rows` (inserts of one open transaction, `sizes` their payload lengths), in
        one call; the Spills they cause, in order (the same as feeding them one by one)."""
        builder = self._in_stream or self._current
        if builder is None:
            raise WrongState("row change outside any transaction", lsn=lsn, tag="i")
        known = builder.relations
        for relid in {r.relid for r in rows}.difference(known):
            known[relid] = self.relations.get(relid, lsn=lsn, tag="i")
        spills: list[Spill] = []
        limit = self._spill_at
        while rows:
            held = list(accumulate(sizes, initial=builder.nbytes))
            cut = bisect_right(held, limit, 1)  # held[cut] is the first over the bound, if any
            if cut == len(held):  # all of them fit
                builder.changes += rows
                self.buffered_bytes += held[-1] - builder.nbytes
                builder.nbytes = held[-1]
                break
            builder.changes += rows[:cut]
            self.buffered_bytes += held[cut] - builder.nbytes
            builder.nbytes = held[cut]
            spills.append(self._spill(builder))
            rows, sizes = rows[cut:], sizes[cut:]
        return spills

    def _spill(self, builder: _Builder) -> Spill:
        self.buffered_bytes -= builder.nbytes
        return builder.spill()

    def _open(self, lsn: int | None, tag: str) -> _Builder:
        builder = self._in_stream or self._current
        if builder is None:
            raise WrongState("change outside any transaction", lsn=lsn, tag=tag)
        return builder

    def _begin(self, message: Begin, lsn: int | None, size: int) -> Output:
        if self._current is not None or self._in_stream is not None:
            raise WrongState("Begin while another transaction is open", lsn=lsn, tag="B")
        self._current = _Builder(message.xid, message.final_lsn, message.commit_time)
        return None

    def _commit(self, message: Commit, lsn: int | None, size: int) -> Output:
        builder = self._current
        if builder is None or self._in_stream is not None:
            raise WrongState("Commit without Begin", lsn=lsn, tag="C")
        if builder.final_lsn != message.commit_lsn:
            raise MalformedMessage(
                f"Commit at {message.commit_lsn:X} does not match Begin's final LSN {builder.final_lsn:X}",
                lsn=lsn, tag="C",
            )
        self._current = None
        self.buffered_bytes -= builder.nbytes
        return builder.finish(message.commit_lsn, message.end_lsn, message.commit_time, False)

    def _origin(self, message: Origin, lsn: int | None, size: int) -> Output:
        builder = self._open(lsn, "O")
        builder.origin = message.name
        builder.origin_lsn = message.commit_lsn
        return None

    def _schema(self, message: Relation | Type, lsn: int | None, size: int) -> Output:
        if isinstance(message, Relation):
            self.relations.put(message)
        else:
            self.relations.put_type(message)
        builder = self._in_stream or self._current
        if builder is not None:
            builder.changes.append(message)
            builder.others += 1
        return None

    def _truncate(self, message: Truncate, lsn: int | None, size: int) -> Output:
        builder = self._in_stream or self._current
        if builder is None:
            raise WrongState("row change outside any transaction", lsn=lsn, tag="T")
        known = builder.relations
        for relid in message.relids:
            if relid not in known:
                known[relid] = self.relations.get(relid, lsn=lsn, tag="T")
        builder.changes.append(message)
        builder.others += 1
        builder.nbytes += size
        self.buffered_bytes += size
        return self._spill(builder) if builder.nbytes > self._spill_at else None

    def _message(self, message: Message, lsn: int | None, size: int) -> Output:
        if not message.transactional:
            return message
        builder = self._open(lsn, "M")
        builder.changes.append(message)
        builder.shared_prefixes().add(message.prefix)
        builder.others += 1
        builder.nbytes += size
        self.buffered_bytes += size
        return self._spill(builder) if builder.nbytes > self._spill_at else None

    def _stream_start(self, message: StreamStart, lsn: int | None, size: int) -> Output:
        if self._in_stream is not None or self._current is not None:
            raise WrongState("Stream Start while a transaction or stream block is open", lsn=lsn, tag="S")
        builder = self._streams.get(message.xid)
        if message.first_segment:
            if builder is not None:
                raise WrongState(f"first segment of streamed xid {message.xid} seen twice", lsn=lsn, tag="S")
            builder = self._streams[message.xid] = _Builder(message.xid)
        elif builder is None:
            raise WrongState(f"later segment of unknown streamed xid {message.xid}", lsn=lsn, tag="S")
        self._in_stream = builder
        return None

    def _stream_stop(self, message: StreamStop, lsn: int | None, size: int) -> Output:
        if self._in_stream is None:
            raise WrongState("Stream Stop outside a stream block", lsn=lsn, tag="E")
        self._in_stream = None
        return None

    def _closed_stream(self, xid: int, lsn: int | None, tag: str) -> _Builder:
        if self._in_stream is not None or self._current is not None:
            raise WrongState("stream commit or abort inside an open block", lsn=lsn, tag=tag)
        builder = self._streams.get(xid)
        if builder is None:
            raise WrongState(f"streamed xid {xid} was never started", lsn=lsn, tag=tag)
        return builder

    def _stream_commit(self, message: StreamCommit, lsn: int | None, size: int) -> Output:
        builder = self._closed_stream(message.xid, lsn, "c")
        del self._streams[message.xid]
        self.buffered_bytes -= builder.nbytes
        return builder.finish(message.commit_lsn, message.end_lsn, message.commit_time, True)

    def _stream_abort(self, message: StreamAbort, lsn: int | None, size: int) -> Output:
        builder = self._closed_stream(message.xid, lsn, "A")
        if message.subxid == message.xid:
            del self._streams[message.xid]
            self.buffered_bytes -= builder.nbytes
            return SpillDropped(message.xid) if builder.spilled else None
        if message.subxid == 0:
            raise MalformedMessage("stream abort of subtransaction 0", lsn=lsn, tag="A")
        if builder.spilled:
            builder.aborted = [*(builder.aborted or ()), message.subxid]
            if builder.rows_by_xid is not None:
                builder.rows_spilled -= builder.rows_by_xid.pop(message.subxid, 0)
        kept: list[SpilledChange] = []
        for change in builder.changes:
            if isinstance(change, _ROW_CHANGES) and change.xid == message.subxid:
                continue
            kept.append(change)
        builder.changes = kept
        builder.others = len(kept) - _count_rows(kept)
        if builder.prefixes:  # in place: a Transaction handed out before the commit holds the set
            builder.prefixes.intersection_update(prefixes_of(kept) | (builder.spilled_prefixes or set()))
        return None


def _tag(message: PgOutputMessage | RawInsert) -> str:
    """A message's pgoutput tag letter (for errors)."""
    return str(message.__struct_config__.tag)
