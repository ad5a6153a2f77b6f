"""The source layer without a server: frames captured from a real PostgreSQL 15 fed to `feed`.

`router.stream.connection` reads batches of XLogData CopyData bodies off the socket; the source above
it (`ReplicationSource.feed`) turns them into transactions. Here the batches are built from the
captured pgoutput payloads (tests/unit/protocol/data/: 'w', WAL start, WAL end, send time, message),
so assembly, positions, echo skipping, resends after a reconnect and spilling are checked from bytes.
Also the source's state table and its one setter.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from protocol.errors import ProtocolError
from protocol.messages import Delete, Insert, Message, Update
from protocol.transactions import Transaction
from router.errors import SourceError
from router.stream.fanout import SourcePump
from router.stream.items import EarlyStream, SourceOptions
from router.stream.source import ReplicationSource
from router.stream.spool import Spool, iter_chunks, let_go
from router.stream.state import TRANSITIONS, Lifecycle, SourceState, SourceStats
from tests.unit.protocol.captured import CAPTURES, Frame, assembled, load

BATCH = 7  # a batch boundary falls inside most transactions


def xlog(frame: Frame, wal_end: int | None = None) -> memoryview:
    """The CopyData body the server sends for one pgoutput message (XLogData)."""
    end = frame.wal_start if wal_end is None else wal_end
    return memoryview(b"w" + struct.pack(">QQQ", frame.wal_start, end, 0) + frame.payload)


def frames_of(capture: str) -> list[memoryview]:
    return [xlog(f) for f in load(capture).frames]


def feed_all(source: ReplicationSource, frames: list[memoryview], batch: int = BATCH) -> list[object]:
    out: list[object] = []
    for i in range(0, len(frames), batch):
        out += source.feed(frames[i : i + batch])
    return out


def new_source(**options: object) -> ReplicationSource:
    """A source that never connects: nothing here opens its connection."""
    return ReplicationSource("a", "dbname=unused", "slot_a", ["pub"], options=SourceOptions(**options))  # type: ignore[arg-type]


def end_of(item: object) -> int:
    if isinstance(item, Transaction):
        return item.end_lsn
    assert isinstance(item, Message)
    return item.lsn  # the end of its record (a commit right after it starts there)


@pytest.mark.parametrize("capture", CAPTURES)
def test_batches_of_captured_frames_come_out_as_the_captured_transactions(capture: str) -> None:
    source = new_source()
    out = feed_all(source, frames_of(capture))
    expected = assembled(capture)
    assert out == list(expected)  # in commit order, every change decoded as the protocol layer does
    transactions = [t for t in out if isinstance(t, Transaction)]
    assert source.stats.transactions_out == len(transactions)
    assert source.delivered_lsn == end_of(out[-1])
    assert source.received_lsn == max(f.wal_start for f in load(capture).frames)
    assert source.stats.raw_inserts > 0  # inserts came in undecoded and were decoded at their commit


def test_the_rows_of_an_echo_are_skipped_and_the_echo_still_handed_out() -> None:
    source = new_source(skip_echo_rows=True)
    out = feed_all(source, frames_of("binary_v1"))
    expected = assembled("binary_v1")
    echoes = [t for t in out if isinstance(t, Transaction) and t.origin is not None]
    (echo,) = echoes
    (captured_echo,) = [t for t in expected if isinstance(t, Transaction) and t.origin is not None]
    rows = [c for c in captured_echo.changes if isinstance(c, Insert | Update | Delete)]
    assert rows and (echo.xid, echo.commit_lsn, echo.end_lsn) == (
        captured_echo.xid, captured_echo.commit_lsn, captured_echo.end_lsn
    )
    assert echo.origin == "pgmesh_capture_origin"
    assert not [c for c in echo.changes if isinstance(c, Insert | Update | Delete)]
    assert source.stats.echo_rows_skipped == len(rows)
    others = [t for t in out if not (isinstance(t, Transaction) and t.origin is not None)]
    assert others == [t for t in expected if not (isinstance(t, Transaction) and t.origin is not None)]


@pytest.mark.parametrize("capture", ["text_v1", "binary_v2_stream"])
def test_what_the_server_sends_again_after_a_reconnect_is_not_handed_out_twice(capture: str) -> None:
    frames = frames_of(capture)
    source = new_source()
    first = feed_all(source, frames[: len(frames) // 2])
    assert 0 < len(first) < len(assembled(capture))
    source.restart()  # a new connection: the server resends from the slot's confirmed position (here: all)
    rest = feed_all(source, frames, batch=11)
    assert first + rest == list(assembled(capture))
    source.restart()
    assert feed_all(source, frames) == []


def test_a_new_source_starts_after_its_start_position() -> None:
    expected = assembled("text_v1")
    start = end_of(expected[5])
    source = ReplicationSource("a", "dbname=unused", "slot_a", ["pub"], start_lsn=start)
    assert feed_all(source, frames_of("text_v1")) == list(expected[6:])


def test_a_batch_with_a_bad_frame_counts_as_not_handed_out() -> None:
    frames = frames_of("text_v1")
    source = new_source()
    good = source.feed(frames[:40])
    assert new_source().feed(frames[:60])[len(good) :]  # frames 40-59 complete transactions
    handed, transactions = source.delivered_lsn, source.stats.transactions_out
    cut = memoryview(bytes(frames[60])[:27])  # a message cut short
    with pytest.raises(ProtocolError):
        source.feed([*frames[40:60], cut])
    assert (source.delivered_lsn, source.stats.transactions_out) == (handed, transactions)
    source.restart()
    assert good + feed_all(source, frames) == list(assembled("text_v1"))


def test_the_idle_position_is_reported_once_everything_handed_out_is_confirmed() -> None:
    source = new_source()
    out = feed_all(source, frames_of("text_v1"))
    idle = source.delivered_lsn + 1000
    source.on_keepalive(idle)
    assert source.received_lsn == idle
    assert source.flush_position() == 0  # nothing confirmed yet
    source.confirm(end_of(out[3]))
    assert source.flush_position() == end_of(out[3])
    source.confirm(source.delivered_lsn)
    assert source.flush_position() == idle
    assert new_source(advance_when_idle=False).flush_position() == 0


@pytest.mark.parametrize("capture", ["text_v1", "binary_v2_stream"])
def test_big_transactions_spill_and_read_back_as_captured(capture: str, tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    source = ReplicationSource("a", "dbname=unused", "slot_a", ["pub"],
                               options=SourceOptions(spill_bytes=4096), spool=spool)
    out = feed_all(source, frames_of(capture))
    expected = assembled(capture)
    assert len(out) == len(expected)
    spilled = 0
    for got, want in zip(out, expected, strict=True):
        if isinstance(got, Transaction) and got.spill is not None:
            assert isinstance(want, Transaction)
            spilled += 1
            assert (got.xid, got.commit_lsn, got.end_lsn) == (want.xid, want.commit_lsn, want.end_lsn)
            assert [c for part in iter_chunks(got) for c in part] == want.changes
            let_go(got)  # nobody else holds it: the file goes
        else:
            assert got == want
    assert spilled >= 3  # the 8 kB row and the bulk loads
    assert source.stats.spills >= spilled and source.stats.spilled_changes > 4000
    assert source.stats.spill_peak_bytes >= 4096
    assert spool.files == 0


def test_a_streamed_transaction_is_announced_at_its_first_spill(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    options = SourceOptions(spill_bytes=4096, early_streamed=True)
    source = ReplicationSource("a", "dbname=unused", "slot_a", ["pub"], options=options, spool=spool)
    out = feed_all(source, frames_of("binary_v2_stream"))
    announced = [item for item in out if isinstance(item, EarlyStream)]
    assert announced and source.stats.early_streams == len(announced)
    committed = 0
    for item in announced:
        finals = [t for t in out if isinstance(t, Transaction) and t.xid == item.txn.xid]
        if not finals:  # it aborted: its file is given up (readers roll back)
            assert item.spill.abandoned and item.spill.deleted
            continue
        (final,) = finals
        committed += 1
        assert out.index(item) < out.index(final)  # announced before its commit is handed out
        assert final.spill is item.spill and item.spill.final == final
    assert committed >= 1
    handed = [(t.xid, t.end_lsn) for t in out if isinstance(t, Transaction)]
    assert handed == [(t.xid, t.end_lsn) for t in assembled("binary_v2_stream") if isinstance(t, Transaction)]


# ------------------------------------------------------------------------------------ state, stats


def test_every_state_reads_as_the_text_status_shows() -> None:
    assert [s.value for s in SourceState] == [
        "idle", "connecting", "streaming", "reconnecting", "failed", "stopped", "error"
    ]
    text: str = "reconnecting"
    assert text == SourceState.RECONNECTING and f"{SourceState.FAILED}" == "failed"
    assert set(TRANSITIONS) == set(SourceState)
    assert all(SourceState.ERROR in allowed for allowed in TRANSITIONS.values())  # the router may say so


def test_the_setter_checks_records_the_error_and_keeps_it() -> None:
    life = Lifecycle("a")
    life.to(SourceState.CONNECTING)
    life.to(SourceState.STREAMING)
    life.to(SourceState.RECONNECTING, error="connection lost")
    assert (life.state, life.last_error) == (SourceState.RECONNECTING, "connection lost")
    life.to(SourceState.CONNECTING)
    life.to(SourceState.FAILED, error="slot is gone")
    with pytest.raises(SourceError, match="from failed to streaming"):
        life.to(SourceState.STREAMING)
    assert (life.state, life.last_error) == (SourceState.FAILED, "slot is gone")
    life.to(SourceState.FAILED)  # the same state again: nothing changes
    assert life.last_error == "slot is gone"


async def test_close_stops_a_source_but_keeps_a_failed_one_failed() -> None:
    source = new_source()
    assert source.state == "idle"
    await source.close()
    assert source.state is SourceState.STOPPED
    source.mark_error("fan-out stopped")
    assert (source.state, source.last_error) == ("error", "fan-out stopped")


def test_the_source_and_its_fan_out_count_into_one_stats_struct() -> None:
    source = new_source(skip_echo_rows=True)
    feed_all(source, frames_of("text_v1"))
    pump = SourcePump(source, None, {})  # type: ignore[arg-type]  # counters only
    assert pump.stats is source.stats and isinstance(source.stats, SourceStats)
    source.stats.echoes += 2
    assert (pump.stats.echoes, pump.stats.transactions, source.stats.echo_rows_skipped) == (2, 0, 1)


def _frame(wal_start: int, payload: bytes) -> memoryview:
    return memoryview(b"w" + struct.pack(">QQQ", wal_start, wal_start, 0) + payload)


def test_a_commit_right_after_a_non_transactional_message_is_handed_out() -> None:
    """A non-transactional message carries the end of its WAL record; a commit record written right after
    it has that LSN as its commit LSN. The transaction comes after the message and is handed out (it was
    taken for one sent again: a pgmesh.applied note on a PostgreSQL 16+ node lost the next commit), and
    the message itself, sent again after a reconnect, is not handed out twice."""
    end = 0x1B5D528
    frames = [
        _frame(end - 0x80, b"B" + struct.pack(">QqI", end, 1000, 800)),  # its commit record starts at `end`
        _frame(end, b"M" + struct.pack(">BQ", 0, end) + b"pgmesh.applied\x00" + struct.pack(">I", 3)
               + b"a|1"),
        _frame(end, b"C" + struct.pack(">BQQq", 0, end, end + 0x30, 1000)),
    ]
    source = new_source()
    out = source.feed(frames)
    assert [type(item) for item in out] == [Message, Transaction]
    assert isinstance(out[1], Transaction) and out[1].xid == 800 and out[1].commit_lsn == end
    assert source.delivered_lsn == end + 0x30
    assert source.feed(frames) == []  # sent again: both handed out already
    again = new_source()
    assert again.feed(frames[1:2]) == [out[0]] and again.feed(frames[1:2]) == []
