"""The assembler's memory bound: a transaction over `spill_bytes` comes out in `Spill` pieces.

Fed the streams captured from a real PostgreSQL 15 (plain and proto_version 2 streamed transactions,
an aborted streamed transaction, a streamed one with a subtransaction rolled back), the spilled pieces
plus the in-memory tail must be exactly the transaction assembled without a bound; also when, as the
router's source does, every insert is fed undecoded (`RawInsert`) and a transaction that spilled gives
its in-memory tail as one last Spill just before its commit (`spill_tail`).
"""

from __future__ import annotations

import struct
from collections import defaultdict

import pytest

from protocol.errors import ProtocolError
from protocol.messages import (
    Begin,
    Column,
    Commit,
    Delete,
    Insert,
    Message,
    RawInsert,
    Relation,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Update,
)
from protocol.pgoutput import Decoder, decode_raw_insert, raw_insert, raw_insert_run
from protocol.transactions import Change, Spill, SpillDropped, Transaction, TransactionAssembler
from tests.unit.protocol.captured import CAPTURES, assembled, load, messages

BOUNDS = (0, 1, 200, 1_000, 5_000, 20_000, 100_000)
_ROW_CHANGES = (Insert, Update, Delete, Truncate, Message)


def reassemble(
    capture: str, bound: int | None, raw: bool = False, tail: bool = False
) -> tuple[list[Transaction | Message], dict[int, list[Spill]], list[SpillDropped]]:
    """Feed a capture with a bound: what comes out, the Spills by xid, the SpillDropped. With `raw`,
    inserts go in as RawInsert; with `tail`, a spilled transaction's tail is spilled before its commit."""
    asm = TransactionAssembler(bound)
    largest = max(len(f.payload) for f in load(capture).frames)
    out: list[Transaction | Message] = []
    spills: dict[int, list[Spill]] = defaultdict(list)
    dropped: list[SpillDropped] = []
    decoder = Decoder()
    for frame, message in zip(load(capture).frames, messages(capture), strict=True):
        in_stream = decoder.in_stream
        decoder.decode(frame.payload)
        fed: object = message
        if raw and isinstance(message, Insert):
            fed = raw_insert(frame.payload, 0, streaming=in_stream)
            assert decode_raw_insert(fed) == message
        if tail and isinstance(message, (Commit, StreamCommit)):
            last = asm.spill_tail(message)
            if last is not None:
                spills[last.xid].append(last)
        done = asm.feed(fed, frame.wal_start, len(frame.payload))  # type: ignore[arg-type]
        if isinstance(done, Spill):
            assert bound is not None and done.nbytes <= bound + largest  # never more than one message over
            spills[done.xid].append(done)
        elif isinstance(done, SpillDropped):
            dropped.append(done)
        elif done is not None:
            out.append(done)
        held = [b.nbytes for b in (asm._current, *asm._streams.values()) if b is not None]
        assert asm.buffered_bytes == sum(held)
        assert bound is None or all(n <= bound for n in held)  # each open transaction within the bound
    assert asm.idle
    return out, spills, dropped


def whole(txn: Transaction, spills: list[Spill]) -> list[Change]:
    """What a reader of the spilled part and the tail sees."""
    aborted = set(txn.aborted_subxids)
    spilled = [decode_raw_insert(c) if isinstance(c, RawInsert) else c for s in spills for c in s.changes]
    assert len(spilled) == txn.spilled
    kept = [c for c in spilled if not (isinstance(c, _ROW_CHANGES) and c.xid in aborted)]
    return kept + txn.changes


@pytest.mark.parametrize("capture", CAPTURES)
def test_without_a_bound_nothing_changes(capture: str) -> None:
    out, spills, dropped = reassemble(capture, None)
    assert out == list(assembled(capture))
    assert not spills and not dropped
    assert all(t.spilled == 0 and t.aborted_subxids == () and t.spill is None
               for t in out if isinstance(t, Transaction))


@pytest.mark.parametrize(("raw", "tail"), [(False, False), (True, False), (True, True)],
                         ids=["decoded", "raw", "raw-tail"])
@pytest.mark.parametrize("bound", BOUNDS)
@pytest.mark.parametrize("capture", CAPTURES)
def test_spilled_pieces_and_tail_are_the_whole_transaction(
    capture: str, bound: int, raw: bool, tail: bool
) -> None:
    reference = list(assembled(capture))
    out, spills, dropped = reassemble(capture, bound, raw, tail)
    raw_spilled = sum(isinstance(c, RawInsert) for ps in spills.values() for s in ps for c in s.changes)
    assert len(out) == len(reference)
    spilled_any = False
    for got, want in zip(out, reference, strict=True):
        if isinstance(want, Message):
            assert got == want
            continue
        assert isinstance(got, Transaction)
        pieces = spills.pop(got.xid, [])
        spilled_any = spilled_any or bool(pieces)
        assert got.spilled == sum(len(s.changes) for s in pieces)
        assert whole(got, pieces) == want.changes
        assert got.row_count == want.row_count  # every row, spilled or not
        assert got.nbytes + sum(s.nbytes for s in pieces) == want.nbytes
        assert got.relations == want.relations
        assert (got.xid, got.commit_lsn, got.end_lsn, got.commit_time, got.origin, got.origin_lsn,
                got.streamed) == (want.xid, want.commit_lsn, want.end_lsn, want.commit_time, want.origin,
                                  want.origin_lsn, want.streamed)
    if bound <= 1_000:
        assert spilled_any
    if raw and bound <= 1_000:  # inserts went in raw, and reached the spills so
        assert raw_spilled
    if tail:  # a transaction that spilled did so whole: nothing of it left for its commit to decode
        assert all(not t.changes for t in out if isinstance(t, Transaction) and t.spilled)
    assert not any(isinstance(c, RawInsert) for t in out if isinstance(t, Transaction) for c in t.changes)
    # What remains spilled belongs to aborted streamed transactions, each announced once.
    assert sorted(spills) == sorted(d.xid for d in dropped)


@pytest.mark.parametrize("capture", ["text_v2_stream", "binary_v2_stream"])
def test_streamed_transactions_spill_and_a_subtransaction_aborted_after_a_spill(capture: str) -> None:
    out, spills, dropped = reassemble(capture, 1_000)
    streamed = [t for t in out if isinstance(t, Transaction) and t.streamed]
    assert streamed and all(t.spilled for t in streamed)
    with_abort = [t for t in streamed if t.aborted_subxids]
    assert len(with_abort) == 1  # ROLLBACK TO SAVEPOINT inside a streamed transaction
    txn = with_abort[0]
    spilled = [c for s in spills[txn.xid] for c in s.changes]
    dead = [c for c in spilled if isinstance(c, Insert) and c.xid in txn.aborted_subxids]
    assert dead  # rows of the aborted subtransaction did reach a Spill: the reader must drop them
    assert all(c.new.values[1] == b"rolled-back" for c in dead)
    assert not any(isinstance(c, Insert) and c.xid in txn.aborted_subxids for c in txn.changes)
    assert txn.row_count == len([c for c in whole(txn, spills[txn.xid]) if isinstance(c, Insert)])
    assert len(dropped) == 1  # the streamed transaction rolled back whole


# ------------------------------------------------------------------------------------ by hand

REL = Relation(16384, "public", "t", "d", (Column("id", 23, -1, True), Column("v", 25, -1, False)))


def row(i: int, xid: int | None = None) -> Insert:
    return Insert(REL.relid, TupleData(b"bt", (struct.pack(">i", i), f"v{i}".encode())), xid)


def test_plain_transaction_spills_past_the_bound_and_keeps_its_tail() -> None:
    asm = TransactionAssembler(spill_bytes=25)
    asm.feed(Begin(0x500, 1, 7))
    assert asm.feed(REL, 0x100, 30) is None  # schema messages do not count
    outs = [asm.feed(row(i), 0x101 + i, 10) for i in range(8)]
    spills = [o for o in outs if isinstance(o, Spill)]
    assert [len(s.changes) for s in spills] == [4, 3]  # REL + 3 rows (30 bytes > 25), then 3 rows
    assert spills[0].changes[0] == REL and spills[0].nbytes == 30
    assert asm.buffered_bytes == 20  # the two rows after the last spill
    txn = asm.feed(Commit(0, 0x500, 0x510, 2))
    assert isinstance(txn, Transaction)
    assert txn.spilled == 7 and txn.changes == [row(6), row(7)]
    assert txn.row_count == 8 and txn.nbytes == 20 and txn.relations == {REL.relid: REL}
    assert asm.buffered_bytes == 0 and asm.idle


def test_streamed_subtransaction_abort_after_a_spill() -> None:
    asm = TransactionAssembler(spill_bytes=45)
    asm.feed(StreamStart(9, True))
    asm.feed(REL)
    outs = [asm.feed(row(i, 9), None, 10) for i in range(2)]
    outs += [asm.feed(row(i, 11), None, 10) for i in range(2, 6)]  # subtransaction 11
    asm.feed(StreamStop())
    (spill,) = [o for o in outs if isinstance(o, Spill)]
    assert [c.xid for c in spill.changes[1:]] == [9, 9, 11, 11, 11]  # row 5 stays in memory
    asm.feed(StreamStart(9, False))
    asm.feed(row(6, 9), None, 10)
    asm.feed(StreamStop())
    assert asm.feed(StreamAbort(9, 11)) is None
    asm.feed(StreamStart(9, False))
    asm.feed(row(7, 12), None, 10)
    asm.feed(StreamStop())
    txn = asm.feed(StreamCommit(9, 0, 0x900, 0x910, 5))
    assert isinstance(txn, Transaction) and txn.streamed
    assert txn.aborted_subxids == (11,)
    assert txn.changes == [row(6, 9), row(7, 12)]  # 5 (subtransaction 11) gone from memory
    assert txn.spilled == 6
    assert txn.row_count == 4  # 0, 1, 6, 7: the spilled rows of 11 no longer count


def test_streamed_transaction_aborted_after_a_spill_is_dropped() -> None:
    asm = TransactionAssembler(spill_bytes=15)
    asm.feed(StreamStart(3, True))
    asm.feed(REL)
    assert isinstance(asm.feed(row(1, 3), None, 10), Spill) is False
    assert isinstance(asm.feed(row(2, 3), None, 10), Spill)
    asm.feed(row(3, 3), None, 10)
    asm.feed(StreamStop())
    assert asm.buffered_bytes == 10
    assert asm.feed(StreamAbort(3, 3)) == SpillDropped(3)
    assert asm.buffered_bytes == 0 and asm.idle
    # Never spilled: the abort says nothing, as without a bound.
    asm.feed(StreamStart(4, True))
    asm.feed(row(1, 4), None, 10)
    asm.feed(StreamStop())
    assert asm.feed(StreamAbort(4, 4)) is None


def test_truncate_and_messages_count_toward_the_bound() -> None:
    asm = TransactionAssembler(spill_bytes=50)
    asm.feed(Begin(0x10, 1, 2))
    asm.feed(REL)
    assert asm.feed(Message(True, 0x5, "p", b"x" * 40), None, 40) is None
    spill = asm.feed(Truncate((REL.relid,), False, False), None, 20)
    assert isinstance(spill, Spill) and len(spill.changes) == 3
    txn = asm.feed(Commit(0, 0x10, 0x20, 3))
    assert isinstance(txn, Transaction) and txn.changes == [] and txn.spilled == 3 and txn.row_count == 0


def test_reset_forgets_partly_spilled_transactions() -> None:
    asm = TransactionAssembler(spill_bytes=5)
    asm.feed(Begin(0x10, 1, 2))
    asm.feed(REL)
    assert isinstance(asm.feed(row(1), None, 10), Spill)
    asm.reset()
    assert asm.idle and asm.buffered_bytes == 0


def test_negative_bound_is_refused() -> None:
    with pytest.raises(ValueError):
        TransactionAssembler(-1)


def test_hand_built_transaction_defaults() -> None:
    txn = Transaction(1, 2, 3, 4, [row(1)], {REL.relid: REL})
    assert (txn.spilled, txn.aborted_subxids, txn.spill, txn.row_count) == (0, (), None, 1)


def test_spill_tail_takes_what_a_spilled_transaction_still_holds_before_its_commit() -> None:
    asm = TransactionAssembler(spill_bytes=25)
    asm.feed(Begin(0x500, 1, 7))
    asm.feed(REL, 0x100, 30)
    asm.feed(row(0), 0x101, 10)
    assert asm.spill_tail(Commit(0, 0x500, 0x510, 2)) is None  # not spilled yet (30 + 10 payload: no)
    outs = [asm.feed(row(i), 0x102 + i, 10) for i in range(1, 4)]
    assert any(isinstance(o, Spill) for o in outs)
    last = asm.spill_tail(Commit(0, 0x500, 0x510, 2))
    assert isinstance(last, Spill) and last.changes and asm.buffered_bytes == 0
    txn = asm.feed(Commit(0, 0x500, 0x510, 2))
    assert isinstance(txn, Transaction) and txn.changes == [] and txn.spilled == 5 and txn.row_count == 4
    assert asm.spill_tail(Commit(0, 0x500, 0x510, 2)) is None  # nothing open


def test_spill_tail_leaves_a_transaction_that_never_spilled_alone() -> None:
    asm = TransactionAssembler(spill_bytes=1_000)
    asm.feed(Begin(0x500, 1, 7))
    asm.feed(REL, 0x100, 30)
    asm.feed(row(0), 0x101, 10)
    assert asm.spill_tail(Commit(0, 0x500, 0x510, 2)) is None
    txn = asm.feed(Commit(0, 0x500, 0x510, 2))
    assert isinstance(txn, Transaction) and txn.changes == [REL, row(0)]


def test_spill_tail_of_a_streamed_transaction_and_raw_rows_decoded_at_a_commit_in_memory() -> None:
    asm = TransactionAssembler(spill_bytes=15)
    asm.feed(StreamStart(3, True))
    asm.feed(REL)
    asm.feed(row(1, 3), None, 10)
    assert isinstance(asm.feed(row(2, 3), None, 10), Spill)
    asm.feed(row(3, 3), None, 10)
    asm.feed(StreamStop())
    last = asm.spill_tail(StreamCommit(3, 0, 0x900, 0x910, 5))
    assert isinstance(last, Spill) and last.changes == [row(3, 3)]
    txn = asm.feed(StreamCommit(3, 0, 0x900, 0x910, 5))
    assert isinstance(txn, Transaction) and txn.changes == [] and txn.spilled == 4
    # A RawInsert still in memory at its commit comes out decoded.
    asm.feed(Begin(0x700, 1, 7))
    cells = b"b" + struct.pack(">i", 4) + struct.pack(">i", 5) + b"t" + struct.pack(">i", 2) + b"v5"
    message = b"I" + struct.pack(">I", REL.relid) + b"N" + struct.pack(">h", 2) + cells
    raw = raw_insert(message, 0, streaming=False)
    asm.feed(raw, 0x701, 10)
    txn = asm.feed(Commit(0, 0x700, 0x710, 2))
    assert isinstance(txn, Transaction) and txn.changes == [row(5)]


def _fed(capture: str) -> list[tuple[object, int, int]]:
    """What the source feeds for a capture: inserts raw, with their WAL start and payload size."""
    decoder = Decoder()
    out: list[tuple[object, int, int]] = []
    for frame in load(capture).frames:
        in_stream = decoder.in_stream
        message = decoder.decode(frame.payload)
        if isinstance(message, Insert):
            message = raw_insert(frame.payload, 0, streaming=in_stream)
        out.append((message, frame.wal_start, len(frame.payload)))
    return out


@pytest.mark.parametrize("bound", BOUNDS)
@pytest.mark.parametrize("capture", CAPTURES)
def test_runs_of_inserts_fed_at_once_give_what_feeding_one_by_one_gives(capture: str, bound: int) -> None:
    fed = _fed(capture)
    one, runs = TransactionAssembler(bound), TransactionAssembler(bound)
    by_one = [o for m, lsn, size in fed if (o := one.feed(m, lsn, size)) is not None]  # type: ignore[arg-type]
    by_run: list[object] = []
    i = 0
    while i < len(fed):
        j = i
        while j < len(fed) and isinstance(fed[j][0], RawInsert):
            j += 1
        if j > i:
            rows = [m for m, _, _ in fed[i:j]]
            by_run += runs.feed_rows(rows, [size for _, _, size in fed[i:j]], fed[i][1])  # type: ignore[arg-type]
            i = j
            continue
        o = runs.feed(*fed[i])  # type: ignore[arg-type]
        if o is not None:
            by_run.append(o)
        i += 1
    assert by_run == by_one
    assert runs.buffered_bytes == one.buffered_bytes == 0


def test_raw_insert_run_is_raw_insert_of_each_and_a_bad_one_raises() -> None:
    for capture in CAPTURES:
        decoder = Decoder()
        plain: list[bytes] = []
        streamed: list[bytes] = []
        for frame in load(capture).frames:
            in_stream = decoder.in_stream
            if isinstance(decoder.decode(frame.payload), Insert):
                (streamed if in_stream else plain).append(b"xx" + frame.payload)
        for bufs, streaming in ((plain, False), (streamed, True)):
            assert raw_insert_run(bufs, 2, streaming=streaming) == [
                raw_insert(b, 2, streaming=streaming) for b in bufs
            ]
            if bufs:
                with pytest.raises(ProtocolError):
                    raw_insert_run([*bufs, bufs[0][:6]], 2, streaming=streaming)  # no relation id
                with pytest.raises(ProtocolError):
                    raw_insert_run([b"xxU" + bufs[0][3:]], 2, streaming=streaming)
