"""`protocol.copyframes`: the replication socket's bytes, as pgmesh reads them past libpq, split into frames.

From bytes captured off a PostgreSQL 15 walsender (the answer to START_REPLICATION with the first frames,
and a START_REPLICATION refused), and streams built from the captured pgoutput payloads: every chunking,
the batch limit, a keepalive ending its batch, a message larger than a read, the stream's end, notices.
"""

from __future__ import annotations

import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.copyframes import (
    READ_BYTES,
    READ_BYTES_MAX,
    CopyEnd,
    CopyReader,
    error_fields,
    error_text,
    query,
)
from protocol.errors import MalformedMessage, ProtocolError, UnknownMessage
from protocol.replication import PrimaryKeepalive, XLogData, copy_data, parse_copy_data
from tests.unit.protocol.captured import CAPTURES, load

# Off the socket of a 15 walsender after START_REPLICATION (proto_version 1, text): CopyBothResponse, a
# keepalive, then Begin, Relation, two Inserts and Commit of `INSERT INTO t VALUES (1, 'one'), (2, 'two')`,
# then a keepalive.
STARTED = bytes.fromhex(
    "570000000700000064000000166b00000000019476d0000304f911585b0e0064000000327700000000019476d000000000"
    "019476d0000304f911585be4420000000001947830000304f9115856de000002d764000000457700000000000000000000"
    "000000000000000304f911585c3e52000040017075626c69630074006400020169640000000017ffffffff007600000000"
    "19ffffffff64000000337700000000019476d000000000019476d0000304f911585c5b49000040014e0002740000000131"
    "74000000036f6e6564000000337700000000019477b000000000019477b0000304f911585c6149000040014e0002740000"
    "000132740000000374776f64000000377700000000019478600000000001947860000304f911585c654300000000000194"
    "78300000000001947860000304f9115856de64000000166b0000000001947860000304f911585c7300"
)
# START_REPLICATION on a slot that does not exist: ErrorResponse, then ReadyForQuery.
REFUSED = bytes.fromhex(
    "450000006f534552524f5200564552524f5200433432373034004d7265706c69636174696f6e20736c6f7420226e6f5f7375"
    "63685f736c6f742220646f6573206e6f742065786973740046736c6f742e63004c34393900525265706c69636174696f6e"
    "536c6f744163717569726500005a0000000549"
)


def message(tag: bytes, body: bytes) -> bytes:
    return tag + struct.pack(">I", len(body) + 4) + body


def keepalive(wal_end: int, reply: bool = False) -> bytes:
    return b"k" + struct.pack(">QqB", wal_end, 0, reply)


def xlog(wal_start: int, payload: bytes) -> bytes:
    return b"w" + struct.pack(">QQq", wal_start, wal_start, 0) + payload


def bodies(capture: str) -> list[bytes]:
    """The CopyData bodies a walsender sends for a capture: its XLogData, a keepalive every 50 frames."""
    out: list[bytes] = []
    for i, frame in enumerate(load(capture).frames):
        out.append(xlog(frame.wal_start, frame.payload))
        if i % 50 == 49:
            out.append(keepalive(frame.wal_start))
    return out


def drain(reader: CopyReader, chunks: list[bytes], limit: int = 512) -> list[bytes]:
    """Feed `chunks` one by one, each once `split` finds no whole message (as the socket reader does)."""
    out: list[bytes] = []
    for chunk in chunks:
        reader.feed(chunk)
        while batch := reader.split(limit):
            assert len(batch) <= limit
            assert all(b[:1] == b"w" for b in batch[:-1]), "only the last of a batch may be a keepalive"
            out += batch
    return out


def chunked(data: bytes, sizes: list[int]) -> list[bytes]:
    chunks, pos, i = [], 0, 0
    while pos < len(data):
        size = sizes[i % len(sizes)] if sizes else len(data)
        chunks.append(data[pos : pos + size])
        pos += size
        i += 1
    return chunks


def test_captured_start_answer_then_frames() -> None:
    reader = CopyReader()
    reader.feed(STARTED)
    assert reader.split(1) == [] and reader.copying  # stops right after CopyBothResponse
    first = reader.split(512)
    assert len(first) == 1 and isinstance(parse_copy_data(first[0]), PrimaryKeepalive)
    frames = reader.split(512)
    kinds = [XLogData if f[:1] == b"w" else PrimaryKeepalive for f in frames]
    assert kinds == [XLogData] * 5 + [PrimaryKeepalive]
    assert [bytes([parse_copy_data(f).payload[0]]) for f in frames[:5]] == [b"B", b"R", b"I", b"I", b"C"]
    assert reader.split(512) == [] and reader.pending == 0 and reader.end is None
    assert reader.data_bytes == len(STARTED) - 8 - 5 * 7
    assert all(type(f) is bytes for f in frames)


def test_captured_refusal() -> None:
    reader = CopyReader()
    reader.feed(REFUSED)
    assert reader.split(1) == []
    assert not reader.copying and isinstance(reader.end, CopyEnd)
    assert reader.end.sqlstate == "42704"
    assert reader.end.text == 'ERROR:  replication slot "no_such_slot" does not exist'
    assert reader.split(1) == []  # nothing after the error is read (its ReadyForQuery stays)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("sizes", [[1], [7, 3], [4096], [READ_BYTES]])
def test_every_chunking_gives_the_same_frames(capture: str, sizes: list[int]) -> None:
    sent = bodies(capture)
    if sizes == [1]:
        sent = sent[:40]
    data = b"".join(map(copy_data, sent))
    reader = CopyReader(copying=True)
    got = drain(reader, chunked(data, sizes))
    assert got == sent
    assert reader.data_bytes == sum(map(len, sent))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 700), min_size=1, max_size=20), st.integers(1, 40))
def test_random_chunkings_and_limits(sizes: list[int], limit: int) -> None:
    sent = bodies("text_v2_stream")[:400]
    reader = CopyReader(copying=True)
    assert drain(reader, chunked(b"".join(map(copy_data, sent)), sizes), limit) == sent


def test_a_keepalive_ends_its_batch() -> None:
    sent = [xlog(1, b"B"), xlog(2, b"I"), keepalive(2, reply=True), xlog(3, b"C")]
    reader = CopyReader(copying=True)
    reader.feed(b"".join(map(copy_data, sent)))
    assert reader.split(512) == sent[:3]
    assert reader.split(512) == sent[3:]


def test_a_message_larger_than_reads_is_gathered_and_joined_once() -> None:
    big = xlog(1, b"I" + bytes(range(256)) * 40_000)  # ~10 MB
    data = copy_data(big) + copy_data(keepalive(5))
    reader = CopyReader(copying=True)
    chunks = []
    pos = 0
    while pos < len(data):
        size = reader.read_size()
        assert READ_BYTES <= size <= READ_BYTES_MAX
        chunks.append(data[pos : pos + size])
        reader.feed(chunks[-1])
        pos += size
        if pos < len(big):
            assert reader.split(512) == []
    assert len(chunks) < 10  # reads grow while the message is gathered
    assert reader.split(512) == [big, keepalive(5)]
    assert reader.read_size() == READ_BYTES and reader.pending == 0


def test_end_of_copy_after_the_frames_before_it() -> None:
    frames = [xlog(1, b"B"), xlog(2, b"C")]
    error = message(b"E", b"SFATAL\0VFATAL\0C57P01\0Mterminating connection due to administrator command\0\0")
    reader = CopyReader(copying=True)
    reader.feed(b"".join(map(copy_data, frames)) + error + b"garbage after it")
    assert reader.split(512) == frames and reader.end is None
    assert reader.split(512) == [] and reader.end is not None
    assert reader.end.sqlstate == "57P01"
    assert reader.end.text == "FATAL:  terminating connection due to administrator command"
    assert reader.split(512) == []


def test_copy_done() -> None:
    reader = CopyReader(copying=True)
    reader.feed(copy_data(xlog(1, b"B")) + message(b"c", b""))
    assert reader.split(512) == [xlog(1, b"B")]
    assert reader.split(512) == [] and reader.end is not None and reader.end.fields is None


def test_notices_and_parameter_status_are_taken_in_passing() -> None:
    notice = message(b"N", b"SWARNING\0VWARNING\0C01000\0Mskipping\0Dthe detail\0Hthe hint\0\0")
    status = message(b"S", b"in_hot_standby\0off\0")
    reader = CopyReader(copying=True)
    reader.feed(copy_data(xlog(1, b"B")) + notice + status + copy_data(xlog(2, b"C")))
    assert reader.split(512) == [xlog(1, b"B"), xlog(2, b"C")]
    assert len(reader.notices) == 1
    assert error_text(reader.notices[0]) == "WARNING:  skipping\nDETAIL:  the detail\nHINT:  the hint"


@pytest.mark.parametrize(
    ("data", "copying", "error"),
    [
        (message(b"D", b"\0\0"), True, UnknownMessage),  # a DataRow inside COPY BOTH
        (copy_data(xlog(1, b"B")), False, UnknownMessage),  # CopyData before CopyBothResponse
        (b"d\0\0\0\2xxxx", True, MalformedMessage),  # a length under 4
        (b"d\x7f\xff\xff\xff", True, MalformedMessage),  # over 1 GB
    ],
)
def test_what_has_no_place_here(data: bytes, copying: bool, error: type[ProtocolError]) -> None:
    reader = CopyReader(copying=copying)
    with pytest.raises(error):
        reader.feed(data)
        reader.split(512)


def test_a_bad_message_after_frames_is_raised_at_the_next_split() -> None:
    reader = CopyReader(copying=True)
    reader.feed(copy_data(xlog(1, b"B")) + b"d\0\0\0\2xxxx")
    assert reader.split(512) == [xlog(1, b"B")]
    with pytest.raises(MalformedMessage):
        reader.split(512)


def test_fuzzed_input_raises_only_protocol_errors() -> None:
    rng = random.Random(39)
    base = STARTED[8:]
    for _ in range(500):
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        reader = CopyReader(copying=True)
        try:
            drain(reader, chunked(bytes(data), [rng.randint(1, 64)]))
        except ProtocolError:
            pass


def test_error_fields_and_query() -> None:
    assert error_fields(b"SERROR\0C42704\0Mgone\0\0") == {"S": "ERROR", "C": "42704", "M": "gone"}
    assert error_text({"S": "ERROR", "M": "gone", "W": "somewhere"}) == "ERROR:  gone\nCONTEXT:  somewhere"
    assert query(b"IDENTIFY_SYSTEM") == b"Q\0\0\0\x14IDENTIFY_SYSTEM\0"
    with pytest.raises(MalformedMessage):
        query(b"a\0b")
