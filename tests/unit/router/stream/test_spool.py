"""The spool: spilled changes to disk and back, file lifetimes, and the fan-out's references.

Every protocol message type that can be part of a transaction goes through the on-disk encoding, taken
from the streams captured from a real PostgreSQL 15 and built by hand for the corners (memoryview
values, every cell kind). Files live in pytest's tmp_path.
"""

from __future__ import annotations

import asyncio
import os
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from protocol.messages import (
    UNCHANGED_TOAST,
    Begin,
    Column,
    Commit,
    Delete,
    Insert,
    Message,
    RawInsert,
    Relation,
    Truncate,
    TupleData,
    Type,
    Update,
)
from protocol.transactions import Change, Spill, SpilledChange, Transaction, TransactionAssembler
from router.ddl.messages import DDL_PREFIX, has_ddl
from router.errors import PgmeshError
from router.progress.positions import LinkProgress, SourceProgress
from router.stream.fanout import SourcePump
from router.stream.linkqueue import LinkQueue
from router.stream.source import ReplicationSource
from router.stream.spool import (
    FRAME_CHANGES,
    SpillFile,
    Spool,
    decode_frame,
    encode_changes,
    iter_chunks,
    iter_raw_chunks,
    let_go,
    materialize,
)
from tests.unit.protocol.captured import CAPTURES, load, messages

CHANGE_TYPES = (Insert, Update, Delete, Truncate, Message, Relation, Type)
REL = Relation(16384, "public", "t", "d", (Column("id", 23, -1, True), Column("v", 25, -1, False)), 77)


def frames_of(data: bytes | bytearray) -> list[list[Change]]:
    out = []
    pos = 0
    while pos < len(data):
        (size,) = struct.unpack_from(">I", data, pos)
        out.append(decode_frame(memoryview(data)[pos + 4 : pos + 4 + size]))
        pos += 4 + size
    assert pos == len(data)
    return out


def round_trip(changes: list[Change]) -> list[Change]:
    buf = bytearray()
    encode_changes(changes, buf)
    return [c for frame in frames_of(buf) for c in frame]


def assert_same(got: list[Change], want: list[Change]) -> None:
    assert got == want
    for g, w in zip(got, want, strict=True):
        assert type(g) is type(w)
        for image in ("new", "old"):
            t = getattr(g, image, None)
            if isinstance(t, TupleData):
                assert type(t.kinds) is bytes
                for kind, value in zip(t.kinds, t.values, strict=True):
                    expected = {ord("n"): type(None), ord("u"): type(UNCHANGED_TOAST)}.get(kind, bytes)
                    assert type(value) is expected


@pytest.mark.parametrize("capture", CAPTURES)
def test_every_captured_change_round_trips(capture: str) -> None:
    changes: list[Change] = [m for m in messages(capture) if isinstance(m, CHANGE_TYPES)]
    assert set(type(c) for c in changes) == set(CHANGE_TYPES)
    kinds = Counter(k for c in changes for t in (getattr(c, "new", None), getattr(c, "old", None))
                    if isinstance(t, TupleData) for k in t.kinds)
    assert set(kinds) == set(b"nut" if not load(capture).binary else b"nub")
    assert_same(round_trip(changes), changes)


def test_hand_built_corners_round_trip() -> None:
    views = (memoryview(b"text"), memoryview(bytearray(b"\x00\x01")))  # decoded as bytes
    cells = TupleData(b"ntbu", (None, *views, UNCHANGED_TOAST))  # type: ignore[arg-type]
    changes: list[Change] = [
        REL,
        Type(16500, "", "mood", 77),
        Insert(REL.relid, cells, 77),
        Insert(REL.relid, TupleData(b"", ()), None),
        Update(REL.relid, cells, TupleData(b"t", (b"k",)), "K", 78),
        Update(REL.relid, cells),
        Update(REL.relid, TupleData(b"t", (b"",)), cells, "O"),
        Delete(REL.relid, TupleData(b"tn", (b"1", None)), "O", 79),
        Truncate((1, 2, 3), True, True, 80),
        Truncate((), False, False),
        Message(True, 0x1234, "pgmesh.ddl", b"\x00\xff", 81),
        Message(True, 0, "", memoryview(b"content")),  # type: ignore[arg-type]
    ]
    got = round_trip(changes)
    assert_same(got, changes)
    assert type(got[-1].content) is bytes  # type: ignore[union-attr]


def test_frames_hold_at_most_frame_changes() -> None:
    changes: list[Change] = [Insert(1, TupleData(b"t", (b"%d" % i,))) for i in range(2 * FRAME_CHANGES + 5)]
    buf = bytearray()
    encode_changes(changes, buf)
    assert [len(f) for f in frames_of(buf)] == [FRAME_CHANGES, FRAME_CHANGES, 5]


# ------------------------------------------------------------------------------------ files


def insert(i: int, xid: int | None = None) -> Insert:
    return Insert(REL.relid, TupleData(b"bt", (struct.pack(">i", i), f"row {i}".encode())), xid)


def spilled_transaction(spool: Spool, node: str, n: int, bound: int = 200, row_size: int = 10,
                        ) -> tuple[Transaction, list[Change]]:
    """A plain transaction of n inserts through an assembler with `bound`, spilled into `spool`."""
    asm = TransactionAssembler(bound)
    asm.feed(Begin(0x1000, 1, 42))
    asm.feed(REL)
    for i in range(n):
        out = asm.feed(insert(i), None, row_size)
        if isinstance(out, Spill):
            spool.write(node, out)
    txn = asm.feed(Commit(0, 0x1000, 0x1010, 2))
    assert isinstance(txn, Transaction)
    handle = spool.finish(node, 42)
    if handle is not None:
        txn = msgspec.structs.replace(txn, spill=handle)
    return txn, [REL, *(insert(i) for i in range(n))]


def test_iter_chunks_reads_the_spilled_part_then_the_tail(tmp_path: Path) -> None:
    spool = Spool(tmp_path, cluster="c1")
    txn, want = spilled_transaction(spool, "n1", 10_000)
    assert txn.spilled > 2 * FRAME_CHANGES and txn.changes and isinstance(txn.spill, SpillFile)
    assert spool.path.parent == tmp_path and spool.path.name.startswith("pgmesh-spool-c1-")
    assert spool.files == 1 and txn.spill.path.exists()
    for size in (1, 7, FRAME_CHANGES, 3000, 10_001, 1 << 20):
        chunks = list(iter_chunks(txn, max_changes=size))
        assert all(0 < len(c) <= size for c in chunks)
        assert all(len(c) == size for c in chunks[:-1])
        assert [c for chunk in chunks for c in chunk] == want
    whole = materialize(txn)
    assert whole.changes == want and whole.spilled == 0 and whole.spill is None
    assert whole.row_count == txn.row_count == 10_000
    assert whole.nbytes == 10 * 10_000
    assert materialize(whole) is whole
    spool.close()
    assert not spool.path.parent.joinpath(txn.spill.path.parent.name).exists()


def test_transaction_that_did_not_spill(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    txn, want = spilled_transaction(spool, "n1", 5, bound=1_000)
    assert txn.spill is None and txn.spilled == 0
    assert list(iter_chunks(txn, max_changes=4)) == [want[:4], want[4:]]
    assert list(iter_chunks(Transaction(1, 2, 3, 4, [], {}))) == [[]]
    let_go(txn)  # nothing to release: fine
    assert not list(tmp_path.iterdir())  # nothing spilled: no directory either


def test_aborted_subtransactions_are_left_out_of_the_spilled_part(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spilled: list[Change] = [REL, insert(1, 5), insert(2, 6), insert(3, 6), insert(4, 5)]
    spool.write("n1", Spill(5, spilled, 40))
    handle = spool.finish("n1", 5)
    txn = Transaction(5, 1, 2, 3, [insert(9, 5)], {REL.relid: REL}, streamed=True, row_count=3,
                      spilled=5, aborted_subxids=(6,), spill=handle)
    kept = [REL, insert(1, 5), insert(4, 5), insert(9, 5)]
    assert [c for chunk in iter_chunks(txn, 2) for c in chunk] == kept
    assert materialize(txn).changes == kept


def raw(change: Insert) -> RawInsert:
    data = struct.pack(">h", 2) + b"b" + struct.pack(">I", 4) + change.new.values[0]  # type: ignore[operator]
    data += b"t" + struct.pack(">I", len(change.new.values[1])) + change.new.values[1]  # type: ignore[arg-type]
    return RawInsert(change.relid, data, change.xid)


def test_raw_inserts_are_kept_raw_on_disk_and_read_back_either_way(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spilled: list[SpilledChange] = [REL, insert(1, 5), raw(insert(2, 6)), raw(insert(3, 5)), insert(4, 5)]
    spool.write("n1", Spill(5, spilled, 40))
    handle = spool.finish("n1", 5)
    assert handle is not None
    txn = Transaction(5, 1, 2, 3, [insert(9, 5)], {REL.relid: REL}, streamed=True, row_count=4,
                      spilled=5, aborted_subxids=(6,), spill=handle)
    decoded = [REL, insert(1, 5), insert(3, 5), insert(4, 5), insert(9, 5)]
    assert [c for chunk in iter_chunks(txn, 2) for c in chunk] == decoded
    assert materialize(txn).changes == decoded
    as_is = [REL, insert(1, 5), raw(insert(3, 5)), insert(4, 5), insert(9, 5)]
    assert [c for chunk in iter_raw_chunks(txn, 2) for c in chunk] == as_is
    got, pos = handle.read_frames(0, 100, raw=True)
    assert got == spilled and pos == handle.size
    every = [REL, *(insert(i, x) for i, x in ((1, 5), (2, 6), (3, 5), (4, 5)))]
    assert handle.read_frames(0, 100)[0] == every


def test_references_delete_the_file_with_the_last_release(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    txn, _ = spilled_transaction(spool, "n1", 1000)
    handle = txn.spill
    assert isinstance(handle, SpillFile)
    handle.acquire(2)
    let_go(txn)
    assert handle.path.exists() and handle.refs == 1
    let_go(txn)
    assert not handle.path.exists() and handle.deleted and spool.files == 0
    let_go(txn)  # once too often: harmless
    with pytest.raises(PgmeshError, match="gone"):
        list(iter_chunks(txn))


def test_abort_and_reset_delete_unfinished_files(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    a = spool.write("n1", Spill(1, [insert(1)], 10))
    b = spool.write("n1", Spill(2, [insert(2)], 10))
    c = spool.write("n2", Spill(1, [insert(3)], 10))
    assert spool.files == 3 and spool.write("n1", Spill(1, [insert(4)], 10)) is a
    spool.drop("n1", 1)
    assert not a.path.exists() and b.path.exists()
    assert spool.discard_open("n1") == 1
    assert not b.path.exists() and c.path.exists()
    assert spool.finish("n1", 2) is None
    assert spool.finish("n2", 1) is c and c.changes == 1
    directory = spool.path
    spool.close()
    assert not directory.exists()


def test_damaged_files_are_reported(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    txn, _ = spilled_transaction(spool, "n1", 3000)
    assert isinstance(txn.spill, SpillFile)
    data = txn.spill.path.read_bytes()
    txn.spill.path.write_bytes(data[:-3])
    with pytest.raises(PgmeshError, match="cut short"):
        list(iter_chunks(txn))
    wrong = msgspec.structs.replace(txn, spilled=txn.spilled + 1)
    txn.spill.path.write_bytes(data)
    with pytest.raises(PgmeshError, match="holds"):
        list(iter_chunks(wrong))
    no_file = Transaction(1, 2, 3, 4, [], {}, spilled=3)
    with pytest.raises(PgmeshError, match="no spill file"):
        materialize(no_file)


# ------------------------------------------------------------------------------------ fan-out


def pump_with(spool: Spool, *, queue_max: int = 10) -> SourcePump:
    links = [LinkProgress("n1", "n2"), LinkProgress("n1", "n3")]
    source = ReplicationSource("n1", "dbname=unused", "slot", ["pub"], spool=spool)
    queues = {"n2": LinkQueue(queue_max), "n3": LinkQueue(queue_max)}
    return SourcePump(source, SourceProgress("n1", links), queues)


async def test_fanout_holds_one_reference_per_link(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    pump = pump_with(spool)
    txn, _ = spilled_transaction(spool, "n1", 1000)
    handle = txn.spill
    assert isinstance(handle, SpillFile)
    await pump._dispatch(txn)
    assert handle.refs == 2 and handle.path.exists()
    for queue in pump.queues.values():
        queued = await queue.get()
        assert queued is txn
        let_go(queued)  # what the applier does once applied
    assert handle.deleted and not handle.path.exists()


async def test_fanout_deletes_what_nobody_takes(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    pump = pump_with(spool)
    txn, _ = spilled_transaction(spool, "n1", 1000)
    echo = msgspec.structs.replace(txn, origin="pgmesh_n2")
    await pump._dispatch(echo)
    assert isinstance(txn.spill, SpillFile) and txn.spill.deleted and pump.stats.echoes == 1
    assert not any(len(q) for q in pump.queues.values())


async def test_fanout_releases_what_a_detached_link_loses(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    pump = pump_with(spool, queue_max=1)
    first, _ = spilled_transaction(spool, "n1", 1000)
    await pump._dispatch(first)
    assert isinstance(first.spill, SpillFile) and first.spill.refs == 2
    await pump.queues["n3"].get()
    let_go(first)  # n3 applied it; n2 is stuck with it
    second, _ = spilled_transaction(spool, "n1", 1000)
    second = msgspec.structs.replace(second, commit_lsn=0x2000, end_lsn=0x2010)
    await asyncio.wait_for(pump._dispatch(second), 5)
    assert pump.progress.links[0].detached  # n2 was full while n3 could take more
    assert first.spill.deleted  # dropped from n2's queue: released
    assert isinstance(second.spill, SpillFile) and second.spill.refs == 1  # only n3 holds it


def test_ddl_in_the_spilled_part_is_seen(tmp_path: Path) -> None:
    """As a source hands it out: the assembler's Spills written to the spool, the file attached at the
    commit; whether it carries DDL is known without reading the file back (`Transaction.prefixes`)."""
    spool = Spool(tmp_path)
    ddl = Message(True, 0x10, DDL_PREFIX, b'{"sql": "ALTER TABLE t ADD c int"}', None)

    def spilled(xid: int, fed: list[tuple[Change, int]]) -> Transaction:
        asm = TransactionAssembler(15)  # what is fed before the 2nd insert goes to the spool, the rest stays
        asm.feed(Begin(0x1000, 1, xid))
        for change, size in fed:
            out = asm.feed(change, None, size)
            if isinstance(out, Spill):
                spool.write("n1", out)
        txn = asm.feed(Commit(0, 0x1000, 0x1010, 3))
        assert isinstance(txn, Transaction) and txn.changes == [insert(2)]
        return msgspec.structs.replace(txn, spill=spool.finish("n1", xid))

    txn = spilled(5, [(REL, 0), (ddl, 10), (insert(1), 10), (insert(2), 10)])
    assert has_ddl(txn) and has_ddl(materialize(txn))
    rows = spilled(6, [(REL, 0), (insert(1), 20), (insert(2), 10)])
    assert not has_ddl(rows)


def test_a_killed_routers_spool_directories_are_removed_at_start(tmp_path: Path) -> None:
    """Only this cluster's directories whose router process is gone; never a live router's, another
    cluster's, or anything else in the directory."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead = int(gone.stdout)  # a process that has exited (its pid not reused this quickly)
    names = {
        "stale": f"pgmesh-spool-main-{dead}-ab_c1",
        "live": f"pgmesh-spool-main-{os.getpid()}-x9y",
        "other cluster": f"pgmesh-spool-main-2-{dead}-q1",
        "not ours": f"pgmesh-spool-main-{dead}",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "0.spill").write_bytes(b"x")
    spool = Spool(tmp_path, cluster="main")
    assert spool.remove_stale() == [tmp_path / names["stale"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in names.items() if k != "stale")
