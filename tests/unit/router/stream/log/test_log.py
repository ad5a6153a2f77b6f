"""The router's log of a source (router.stream.log.store): append, read back, group fsync, truncation,
recovery.

Files live in pytest's tmp_path; transactions are built by hand (one-row ones, and one big enough to be
logged in pieces and read back through the spool).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from protocol.messages import Column, Insert, Message, Relation, TupleData, Update
from protocol.transactions import Change, Spill, Transaction
from router.errors import PgmeshError
from router.stream.log.format import LINKED_DECODER, Linked, Meta
from router.stream.log.store import SourceLog
from router.stream.spool import SpillFile, Spool, iter_chunks, let_go

REL = Relation(16384, "public", "t", "d", (Column("id", 23, -1, True), Column("v", 25, -1, False)), 77)


def row(i: int, v: str = "x") -> TupleData:
    return TupleData(b"tt", (str(i).encode(), v.encode()))


def txn(end: int, rows: int = 1, *, seen: tuple[tuple[str, int], ...] = ()) -> Transaction:
    changes: list[Change] = [Insert(REL.relid, row(end * 100_000 + i)) for i in range(rows)]
    if rows:
        changes.append(Update(REL.relid, row(end, "y"), None, None))
    return Transaction(end, end - 1, end, 1_000 + end, changes, {REL.relid: REL}, seen=seen)


def make(tmp_path: Path, **kw: object) -> SourceLog:
    """A log that holds nothing back (`hold_bytes` 0: each small transaction is encoded as appended),
    unless the test says otherwise."""
    kw.setdefault("hold_bytes", 0)
    log = SourceLog(tmp_path / "log", "a", identity="7001", spool=Spool(tmp_path / "spool"), **kw)  # type: ignore[arg-type]
    log.open()
    return log


def read_all(log: SourceLog, after: int) -> list[Transaction]:
    reader = log.reader(after)
    out = []
    while (t := reader.next()) is not None:
        out.append(t)
    return out


def changes_of(t: Transaction) -> list[Change]:
    return [c for chunk in iter_chunks(t) for c in chunk]


def test_transactions_come_back_as_appended_after_a_position(tmp_path: Path) -> None:
    log = make(tmp_path)
    assert not log.active
    log.activate(100, ["t"])
    sent = [txn(end, seen=(("b", end),)) for end in range(101, 111)]
    for t in sent:
        log.append(t)
    got = read_all(log, 104)
    assert [t.end_lsn for t in got] == list(range(105, 111))
    for t, want in zip(got, sent[4:], strict=True):
        assert t.changes == want.changes and t.relations == want.relations and t.seen == want.seen
        assert (t.xid, t.commit_lsn, t.commit_time, t.row_count) == (want.xid, want.commit_lsn,
                                                                      want.commit_time, want.row_count)
        assert t.origin is None


def test_a_big_transaction_is_logged_in_pieces_and_read_back_through_the_spool(tmp_path: Path) -> None:
    log = make(tmp_path)
    log.activate(0, ["t"])
    big = txn(5, rows=20_000)
    log.append(txn(4))
    log.append(big)
    log.append(txn(6))
    got = read_all(log, 4)
    assert [t.end_lsn for t in got] == [5, 6]
    assert got[0].spilled == len(big.changes) and got[0].changes == []
    assert changes_of(got[0]) == big.changes
    let_go(got[0])
    assert not list((tmp_path / "spool").rglob("*.spill"))  # its file went with the last reference


def test_a_reader_that_caught_up_sees_what_is_appended_later(tmp_path: Path) -> None:
    log = make(tmp_path, segment_bytes=4096)
    log.activate(0, ["t"])
    reader = log.reader(0)
    assert reader.next() is None
    for end in range(1, 200):  # several segments
        log.append(txn(end))
        got = reader.next()
        assert got is not None and got.end_lsn == end
        assert reader.next() is None
    assert len(log.segments()) > 3


def test_segments_every_link_passed_are_deleted_not_the_one_being_written(tmp_path: Path) -> None:
    log = make(tmp_path, segment_bytes=4096)
    log.activate(0, ["t"])
    for end in range(1, 300):
        log.append(txn(end))
    log.write_buffer()  # (small transactions are encoded at the next fsync, or when read)
    segments = list(log.segments())
    before = log.size
    freed = log.truncate_before(segments[2].last)
    assert freed > 0 and log.size == before - freed
    assert log.segments()[0].seq == segments[3].seq
    assert log.first == segments[3].first
    assert read_all(log, 0)[0].end_lsn == segments[3].first  # a reader starts at what is left
    log.truncate_before(10**9)
    assert len(log.segments()) == 1  # the one being written stays


def test_durable_moves_only_after_the_group_fsync_and_stops_where_appending_stopped(tmp_path: Path) -> None:
    passed = [0]
    log = make(tmp_path, position=lambda: passed[0])
    log.activate(10, ["t"])
    log.append(txn(11))
    passed[0] = 12
    assert log.durable == 10
    asyncio.run(log.sync())
    assert log.durable == 12
    log.stop_appending(15)
    passed[0] = 20
    asyncio.run(log.sync())
    assert log.durable == 15 and not log.appending


def test_reopened_it_goes_on_from_where_it_was(tmp_path: Path) -> None:
    log = make(tmp_path, segment_bytes=4096)
    log.activate(50, ["t"])
    for end in range(51, 151):
        log.append(txn(end))
    asyncio.run(log.sync())
    log.close()
    again = make(tmp_path, segment_bytes=4096)
    assert again.active and again.appending
    assert (again.since, again.end, again.first) == (50, 150, 51)
    again.append(txn(151))
    assert [t.end_lsn for t in read_all(again, 148)] == [149, 150, 151]


@pytest.mark.parametrize("cut", [1, 5, 9, 30])
def test_a_torn_tail_is_cut_off_at_the_last_whole_transaction(tmp_path: Path, cut: int) -> None:
    log = make(tmp_path)
    log.activate(0, ["t"])
    for end in range(1, 11):
        log.append(txn(end))
    log.close()
    path = log.segments()[-1].path
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - cut)  # the last record written in part (a crash mid-write)
    again = make(tmp_path)
    assert again.end == 9
    assert [t.end_lsn for t in read_all(again, 0)] == list(range(1, 10))
    assert path.stat().st_size < size - cut


def test_a_record_that_fails_its_checksum_ends_the_log_there(tmp_path: Path) -> None:
    log = make(tmp_path, segment_bytes=4096)
    log.activate(0, ["t"])
    for end in range(1, 200):
        log.append(txn(end))
    log.close()
    segments = list(log.segments())
    victim = segments[1]
    data = bytearray(victim.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.path.write_bytes(bytes(data))
    again = make(tmp_path, segment_bytes=4096)
    assert again.end < victim.last
    assert len(again.segments()) == 2  # the later segments follow a hole: gone
    assert [t.end_lsn for t in read_all(again, 0)] == list(range(1, again.end + 1))


def test_an_unfinished_big_transaction_at_the_tail_is_cut_off(tmp_path: Path) -> None:
    log = make(tmp_path)
    log.activate(0, ["t"])
    log.append(txn(1))
    log.append(txn(2, rows=10_000))
    log.close()
    path = log.segments()[-1].path
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 13)  # its end record lost
    again = make(tmp_path)
    assert again.end == 1
    assert [t.end_lsn for t in read_all(again, 0)] == [1]


def test_a_log_of_another_server_is_refused(tmp_path: Path) -> None:
    make(tmp_path).activate(0, ["t"])
    other = SourceLog(tmp_path / "log", "a", identity="7002", spool=Spool(tmp_path / "spool"))
    with pytest.raises(PgmeshError, match="belongs to another server"):
        other.open()


def test_reset_deletes_it_whole(tmp_path: Path) -> None:
    log = make(tmp_path, segment_bytes=4096)
    log.activate(0, ["t"])
    for end in range(1, 100):
        log.append(txn(end))
    log.reset()
    assert not log.active and log.size == 0
    assert not list((tmp_path / "log").glob("*.seg"))
    log.activate(500, ["t"])
    log.append(txn(501))
    assert [t.end_lsn for t in read_all(log, 0)] == [501]


def spilled_setup(tmp_path: Path, **kw: int) -> tuple[SourceLog, Spool, list[Insert], SpillFile, Transaction]:
    """An active log, and a transaction of 3000 rows whose first 2500 are in a spill file (one holder)."""
    spool = Spool(tmp_path / "spool")
    log = SourceLog(tmp_path / "log", "a", identity="7001", spool=spool, **kw)
    log.open()
    log.activate(0, ["t"])
    rows = [Insert(REL.relid, row(i)) for i in range(3000)]
    spool.write("a", Spill(9, rows[:2500], nbytes=1234))
    handle = spool.finish("a", 9)
    assert handle is not None
    handle.acquire()
    big = Transaction(9, 99, 100, 5, rows[2500:], {REL.relid: REL}, spilled=2500, spill=handle)
    return log, spool, rows, handle, big


def test_a_spilled_transaction_is_linked_not_copied_and_outlives_its_spool_file(tmp_path: Path) -> None:
    log, spool, rows, handle, big = spilled_setup(tmp_path, hold_bytes=0)
    log.append(txn(98))
    log.append(big)
    copied = log.bytes_appended
    assert copied < 100_000  # the file's 2500 rows were not copied into a segment
    assert len(list((tmp_path / "log").glob("*.spill"))) == 1
    let_go(big)  # the source's file goes: the log's link stays
    assert not handle.path.exists()
    asyncio.run(log.sync())
    log.close()
    again = SourceLog(tmp_path / "log", "a", identity="7001", spool=spool)
    again.open()
    assert again.end == 100
    (got,) = read_all(again, 98)
    assert got.spilled == 2500 and changes_of(got) == rows
    let_go(got)
    again._roll()  # (a new segment: the old one, its linked file with it, can go)
    again.append(txn(101))
    again.truncate_before(100)
    assert not list((tmp_path / "log").glob("*.spill"))


def test_small_transactions_wait_to_be_encoded_in_order_with_a_big_one(tmp_path: Path) -> None:
    log = make(tmp_path, hold_bytes=1 << 20)
    log.activate(0, ["t"])
    log.append(txn(1))
    log.append(txn(2))
    assert log.end == 2 and log.buffered  # held: encoded at a release or when a reader gets there
    log.append(txn(3, rows=10_000))  # written at once, after the two before it
    log.append(txn(4))
    assert [t.end_lsn for t in read_all(log, 0)] == [1, 2, 3, 4]
    passed = log.end
    asyncio.run(log.sync())
    assert not log.buffered and log.durable == passed


def test_held_transactions_every_target_flushed_are_never_written(tmp_path: Path) -> None:
    passed = [0]
    log = make(tmp_path, hold_bytes=1 << 20, hold_ticks=2, position=lambda: passed[0])
    log.activate(0, ["t"])
    for end in (1, 2, 3):
        log.append(txn(end))
    passed[0] = 3
    asyncio.run(log.sync())
    assert log.durable == 0  # held, not on disk: the slot may not count on them
    log.forget(2)  # every target flushed 1 and 2: forgotten
    log.idle()
    assert log.durable == 2 and log.bytes_appended == 0
    log.append(txn(4))
    passed[0] = 4
    log.forget(2)  # 3 was appended before the release two releases ago: held long enough, written
    asyncio.run(log.sync())
    assert log.durable == 3
    log.forget(4)  # 4 flushed everywhere meanwhile
    log.idle()
    assert log.durable == 4
    assert [t.end_lsn for t in read_all(log, 0)] == [3]
    log.close()
    assert [t.end_lsn for t in read_all(make(tmp_path), 0)] == [3]  # and so after a restart


def test_held_transactions_are_written_at_once_when_a_link_is_behind(tmp_path: Path) -> None:
    passed = [0]
    log = make(tmp_path, hold_bytes=1 << 20, hold_ticks=100, position=lambda: passed[0])
    log.activate(0, ["t"])
    for end in (1, 2, 3):
        log.append(txn(end))
    passed[0] = 3
    log.forget(1)
    assert log.buffered == 2  # 2 and 3 still held: every link keeps up
    log.forget(1, behind=True)  # one stopped applying: it will need them from the log
    asyncio.run(log.sync())
    assert log.durable == 3
    assert [t.end_lsn for t in read_all(log, 0)] == [2, 3]


def test_an_eager_log_encodes_at_append_while_a_link_is_behind_and_says_when_durable(tmp_path: Path) -> None:
    """A synchronous source's log (docs/synchronous.md): no waiting for the next tick to encode."""
    passed = [0]
    moved: list[int] = []
    log = make(tmp_path, hold_bytes=1 << 20, hold_ticks=100, position=lambda: passed[0])
    log.eager = True
    log.on_durable = lambda: moved.append(log.durable)
    log.activate(0, ["t"])
    log.append(txn(1))
    assert log.buffered == 1  # every link keeps up: held
    log.forget(0, behind=True)
    log.write_buffer()
    log.append(txn(2))
    passed[0] = 2
    assert log.buffered > 1  # a link is behind: encoded as appended (bytes in the write buffer)
    log.write_buffer()
    assert log.buffered == 0
    asyncio.run(log.sync())
    assert log.durable == 2 and moved == [2]
    assert [t.end_lsn for t in read_all(log, 0)] == [1, 2]


def test_held_transactions_are_bounded_in_bytes(tmp_path: Path) -> None:
    log = make(tmp_path, hold_bytes=64 << 10)
    log.activate(0, ["t"])
    for end in range(1, 1001):
        log.append(txn(end))
    assert log.bytes_appended > 0  # the oldest were encoded to stay under the bound
    assert log._pending_bytes <= 64 << 10
    assert [t.end_lsn for t in read_all(log, 0)] == list(range(1, 1001))  # in order, none lost


def test_a_held_spilled_transaction_keeps_its_file_and_is_never_linked_once_flushed_everywhere(
    tmp_path: Path,
) -> None:
    log, _, _, handle, big = spilled_setup(tmp_path)
    log.append(big)
    let_go(big)  # its link applied it: the log's hold keeps the file
    assert handle.path.exists() and log.bytes_appended == 0
    log.forget(100)  # flushed everywhere: let go, never written
    assert not handle.path.exists() and log.bytes_appended == 0
    assert not list((tmp_path / "log").glob("*.spill"))


def test_a_log_read_back_covers_only_the_targets_it_was_started_for(tmp_path: Path) -> None:
    """A node that joined after the log started may lack transactions every target then had (the log let
    go of them): the log, read back by the next run, never counts for it."""
    log = make(tmp_path)
    log.activate(10, ["b", "c"])
    for end in range(11, 20):
        log.append(txn(end))
    log.close()
    again = make(tmp_path)
    assert again.targets == {"b", "c"}
    assert again.covers(12, "b") and again.covers(12, "c")
    assert not again.covers(12, "d") and not again.covers(9, "b")


def test_a_linked_transaction_read_back_knows_the_prefixes_of_its_file_and_an_old_record_still_reads(
    tmp_path: Path,
) -> None:
    """The file of a linked transaction is not read back: the prefixes of its logical messages are in its
    `S` record (a record written before they were, without them, still reads: only the tail's are known)."""
    spool = Spool(tmp_path / "spool")
    log = SourceLog(tmp_path / "log", "a", identity="7001", spool=spool, hold_bytes=0)
    log.open()
    log.activate(0, ["t"])
    ddl = Message(True, 5, "pgmesh.ddl", b"{}")
    spilled: list[Change] = [ddl, *(Insert(REL.relid, row(i)) for i in range(100))]
    spool.write("a", Spill(9, spilled, nbytes=1234))
    handle = spool.finish("a", 9)
    assert handle is not None
    handle.acquire()
    tail: list[Change] = [Insert(REL.relid, row(100)), Message(True, 6, "mine", b"")]
    big = Transaction(9, 99, 100, 5, tail, {REL.relid: REL}, row_count=101, spilled=101, spill=handle,
                      prefixes=frozenset({"pgmesh.ddl", "mine"}))
    log.append(big)
    assert len(list((tmp_path / "log").glob("*.spill"))) == 1  # linked, not copied
    (got,) = read_all(log, 0)
    assert got.prefixes == {"pgmesh.ddl", "mine"} and changes_of(got) == spilled + tail
    let_go(got)
    let_go(big)
    meta = Meta(9, 99, 100, 5, 0, 101, False, (), [REL.relid])
    before = msgspec.msgpack.encode([msgspec.to_builtins(meta), "f.spill", 101, 1234, []])  # 5 fields
    old = LINKED_DECODER.decode(before)
    assert old == Linked(meta, "f.spill", 101, 1234, ()) and old.prefixes == ()
