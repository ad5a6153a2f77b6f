"""Framing and robustness: split input, truncated input, fuzzed input -> only ProtocolError."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import MalformedMessage, ProtocolError, TruncatedMessage, UnknownMessage, WrongState
from protocol.messages import Begin, Commit, Insert, StreamStart
from protocol.pgoutput import Decoder, decode
from protocol.replication import (
    CopyDataFramer,
    PrimaryKeepalive,
    XLogData,
    copy_data,
    parse_copy_data,
    standby_status_update,
)
from protocol.transactions import TransactionAssembler
from tests.unit.protocol.captured import CAPTURES, load, messages


def distinct_frames(capture: str) -> list[bytes]:
    """One payload per (tag, size class): every message shape without thousands of identical inserts."""
    frames = load(capture).frames
    return [frames[i].payload for i in shape_indexes(capture)]


def xlog(wal_start: int, payload: bytes) -> bytes:
    return b"w" + struct.pack(">QQq", wal_start, wal_start, 0) + payload


def shape_indexes(capture: str) -> list[int]:
    """Index of the first frame of every (tag, size class): every message shape of the capture."""
    seen: dict[tuple[int, int], int] = {}
    for i, frame in enumerate(load(capture).frames):
        seen.setdefault((frame.payload[0], min(len(frame.payload), 200)), i)
    return sorted(seen.values())


@pytest.mark.parametrize("capture", CAPTURES)
def test_every_message_split_at_every_byte_boundary(capture: str) -> None:
    data = load(capture)
    expected = messages(capture)
    decoder = Decoder()
    for i in shape_indexes(capture):
        frame = data.frames[i]
        wire = copy_data(xlog(frame.wal_start, frame.payload))
        decoder.in_stream = _in_stream(capture, frame.payload)
        for cut in range(1, len(wire)):
            framer = CopyDataFramer()
            assert framer.feed(wire[:cut]) == []
            (body,) = framer.feed(wire[cut:])
            assert framer.pending == 0
            parsed = parse_copy_data(body)
            assert isinstance(parsed, XLogData) and parsed.wal_start == frame.wal_start
            in_stream = decoder.in_stream
            assert decoder.decode(parsed.payload, parsed.wal_start) == expected[i]
            decoder.in_stream = in_stream


@pytest.mark.parametrize("capture", CAPTURES)
def test_whole_stream_fed_in_odd_chunks_gives_same_messages(capture: str) -> None:
    data = load(capture)
    wire = b"".join(copy_data(xlog(f.wal_start, f.payload)) for f in data.frames) + b"c\x00\x00\x00\x04"
    for chunk in (1, 7, 4093):
        framer = CopyDataFramer()
        decoder = Decoder()
        out = []
        for i in range(0, len(wire), chunk):
            for body in framer.feed(wire[i : i + chunk]):
                frame = parse_copy_data(body)
                assert isinstance(frame, XLogData)
                out.append(decoder.decode(frame.payload, frame.wal_start))
        assert framer.done
        assert tuple(out) == messages(capture)


@pytest.mark.parametrize("capture", ["text_v1", "binary_v2_stream"])
def test_every_truncation_raises_protocol_error(capture: str) -> None:
    streaming_tags = {ord(c) for c in "RYIUDTM"}
    for payload in distinct_frames(capture):
        streaming = load(capture).streaming and payload[0] in streaming_tags and _in_stream(capture, payload)
        decode(payload, streaming=streaming)  # the whole message decodes
        for cut in range(len(payload)):
            with pytest.raises(ProtocolError) as info:
                decode(payload[:cut], lsn=0x10, streaming=streaming)
            assert info.value.lsn == 0x10
        with pytest.raises(MalformedMessage):
            decode(payload + b"\x00", streaming=streaming)


def _in_stream(capture: str, payload: bytes) -> bool:
    decoder = Decoder()
    for frame in load(capture).frames:
        before = decoder.in_stream
        decoder.decode(frame.payload)
        if frame.payload == payload:
            return before
    raise AssertionError("payload not in capture")


def test_errors_name_lsn_and_tag() -> None:
    with pytest.raises(UnknownMessage) as info:
        decode(b"Zabc", lsn=(1 << 32) | 0x10)
    assert "LSN 1/10" in str(info.value) and info.value.tag == "Z"
    with pytest.raises(TruncatedMessage):
        decode(b"", lsn=5)
    bad_kind = b"I" + struct.pack(">I", 1) + b"N" + struct.pack(">h", 1) + b"x"
    with pytest.raises(MalformedMessage, match="unknown kind byte"):
        decode(bad_kind)


def test_keepalive_and_status_update() -> None:
    body = b"k" + struct.pack(">Qq", 0x1234, 99) + b"\x01"
    assert parse_copy_data(body) == PrimaryKeepalive(0x1234, 99, True)
    with pytest.raises(TruncatedMessage):
        parse_copy_data(body[:-1])
    with pytest.raises(UnknownMessage):
        parse_copy_data(b"q")
    update = standby_status_update(10, 9, 8, 7, True)
    assert update == b"r" + struct.pack(">QQQq", 10, 9, 8, 7) + b"\x01"


def test_framer_rejects_other_backend_messages() -> None:
    framer = CopyDataFramer()
    with pytest.raises(UnknownMessage):
        framer.feed(b"E\x00\x00\x00\x05x")
    with pytest.raises(MalformedMessage):
        CopyDataFramer().feed(b"d\x00\x00\x00\x01")


def test_assembler_state_errors() -> None:
    asm = TransactionAssembler()
    with pytest.raises(WrongState):
        asm.feed(Commit(0, 1, 2, 3))
    asm.feed(Begin(5, 1, 9))
    with pytest.raises(WrongState):
        asm.feed(Begin(6, 1, 10))
    with pytest.raises(ProtocolError) as info:
        asm.feed(Insert(42, decode(b"I" + struct.pack(">I", 42) + b"N\x00\x00").new), lsn=77)  # type: ignore[union-attr]
    assert info.value.lsn == 77 and "relation id 42" in str(info.value)
    with pytest.raises(MalformedMessage):
        asm.feed(Commit(0, 6, 7, 3))  # commit LSN differs from Begin's final LSN
    decoder = Decoder()
    decoder.decode(b"S" + struct.pack(">IB", 1, 1))
    with pytest.raises(WrongState):
        decoder.decode(b"S" + struct.pack(">IB", 1, 1))
    assert isinstance(decode(b"S" + struct.pack(">IB", 1, 0)), StreamStart)


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=64), st.booleans())
def test_fuzz_random_bytes_only_raise_protocol_error(payload: bytes, streaming: bool) -> None:
    try:
        decode(payload, streaming=streaming)
    except ProtocolError:
        pass
    try:
        parse_copy_data(payload)
    except ProtocolError:
        pass
    try:
        CopyDataFramer().feed(payload)
    except ProtocolError:
        pass


FUZZ_SEEDS = [p for c in ("text_v1", "binary_v2_stream") for p in distinct_frames(c)]


@settings(max_examples=3000, deadline=None)
@given(
    st.sampled_from(FUZZ_SEEDS),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4),
    st.integers(0, 10_000),
    st.booleans(),
)
def test_fuzz_mutated_captures_only_raise_protocol_error(
    payload: bytes, flips: list[tuple[int, int]], cut: int, streaming: bool
) -> None:
    mutated = bytearray(payload)
    for pos, value in flips:
        mutated[pos % len(mutated)] = value
    data = bytes(mutated[: max(1, cut % (len(mutated) + 1))])
    try:
        message = decode(data, streaming=streaming)
    except ProtocolError:
        return
    asm = TransactionAssembler()
    try:
        asm.feed(message)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FUZZ_SEEDS), min_size=1, max_size=30))
def test_fuzz_message_sequences_only_raise_protocol_error(payloads: list[bytes]) -> None:
    decoder = Decoder()
    asm = TransactionAssembler()
    for payload in payloads:
        try:
            asm.feed(decoder.decode(payload))
        except ProtocolError:
            pass
