"""proto_version 4 against bytes captured from a real PostgreSQL 18 (`capture.py v4`).

Both captures read the same streamed transactions (one committed, one aborted whole after it was
streamed, one with a streamed subtransaction rolled back), once with streaming 'parallel' and once with
'on'. pgoutput's only difference between the two is Stream Abort: under 'parallel' it also carries the
abort record's LSN and the abort time; the decoder must be told which (the bytes do not say).
"""

from __future__ import annotations

import pytest

from protocol.errors import MalformedMessage, ProtocolError, TruncatedMessage
from protocol.messages import Insert, StreamAbort, StreamCommit, StreamStart
from protocol.pgoutput import Decoder, decode
from protocol.transactions import Transaction
from tests.unit.protocol.captured import V4_CAPTURES, Frame, assembled, load, messages

PARALLEL, ON = V4_CAPTURES


def aborts(capture: str) -> list[tuple[Frame, StreamAbort]]:
    pairs = zip(load(capture).frames, messages(capture), strict=True)
    return [(f, m) for f, m in pairs if isinstance(m, StreamAbort)]


def test_captures_are_proto_4_from_postgresql_16_or_later() -> None:
    for name in V4_CAPTURES:
        capture = load(name)
        assert capture.proto_version == 4 and capture.streaming and not capture.binary
        assert int(capture.server_version.split(".")[0]) >= 16
    assert load(PARALLEL).abort_info and not load(ON).abort_info


def test_parallel_stream_abort_carries_the_abort_lsn_and_time() -> None:
    found = aborts(PARALLEL)
    whole = [(f, a) for f, a in found if a.subxid == a.xid]
    sub = [(f, a) for f, a in found if a.subxid != a.xid]
    assert len(whole) == 1 and len(sub) == 1  # the capture's two aborts
    commits = [m for m in messages(PARALLEL) if isinstance(m, StreamCommit)]
    first_commit, last_commit = commits[0].commit_time, commits[-1].commit_time
    for frame, abort in found:
        assert abort.abort_lsn == frame.wal_start  # the walsender sends it at the abort record
        assert abort.abort_time is not None and first_commit < abort.abort_time < last_commit
    # the whole abort came after its transaction was streamed (PostgreSQL 18 skips one known aborted)
    streamed = {m.xid for m in messages(PARALLEL) if isinstance(m, StreamStart)}
    assert whole[0][1].xid in streamed


def test_stream_abort_under_on_has_no_abort_fields() -> None:
    found = aborts(ON)
    assert len(found) == 2
    assert all(a.abort_lsn is None and a.abort_time is None for _, a in found)
    assert [(a.xid, a.subxid) for _, a in found] == [(a.xid, a.subxid) for _, a in aborts(PARALLEL)]


def test_parallel_changes_nothing_but_stream_abort() -> None:
    """What the server sends, and when it opens stream blocks, is the same under 'parallel' and 'on'."""
    parallel, on = load(PARALLEL).frames, load(ON).frames
    assert len(parallel) == len(on)
    differ = [(p, o) for p, o in zip(parallel, on, strict=True) if p != o]
    assert len(differ) == 2
    for p, o in differ:
        assert p.wal_start == o.wal_start and p.payload[:1] == b"A"
        assert p.payload[:9] == o.payload and len(p.payload) == 9 + 16  # + Int64 LSN, Int64 time


def test_both_assemble_the_same_transactions() -> None:
    txns = [t for t in assembled(PARALLEL) if isinstance(t, Transaction)]
    assert txns == [t for t in assembled(ON) if isinstance(t, Transaction)]
    assert len(txns) == 2  # the one aborted whole never comes out
    first, second = txns
    assert all(t.streamed for t in txns)
    assert sum(isinstance(c, Insert) for c in first.changes) == 1500
    names = {c.new.values[1] for c in second.changes if isinstance(c, Insert)}
    assert names == {b"kept-a", b"kept-b"}  # the rolled-back subtransaction's rows are gone
    assert sum(isinstance(c, Insert) for c in second.changes) == 1010


@pytest.mark.parametrize(
    ("capture", "told", "error"), [(PARALLEL, False, MalformedMessage), (ON, True, TruncatedMessage)]
)
def test_a_decoder_told_wrong_fails_at_the_abort_with_its_lsn(
    capture: str, told: bool, error: type[ProtocolError]
) -> None:
    decoder = Decoder(abort_info=told)
    frame, _ = aborts(capture)[0]
    with pytest.raises(error) as raised:
        for f in load(capture).frames:
            decoder.decode(f.payload, f.wal_start)
    assert raised.value.lsn == frame.wal_start and raised.value.tag == "A"


def test_stateless_decode_and_reset_follow_abort_info() -> None:
    (frame, expected), _ = aborts(PARALLEL)
    assert decode(frame.payload, lsn=frame.wal_start, abort_info=True) == expected
    with pytest.raises(MalformedMessage):
        decode(frame.payload, lsn=frame.wal_start)
    decoder = Decoder()
    decoder.reset(abort_info=True)
    assert decoder.decode(frame.payload, frame.wal_start) == expected
    decoder.reset()  # keeps what it was told
    assert decoder.abort_info and decoder.decode(frame.payload, frame.wal_start) == expected
    with pytest.raises(TruncatedMessage):
        decoder.decode(frame.payload[:-3], frame.wal_start)
