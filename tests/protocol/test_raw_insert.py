"""Inserts left undecoded (`RawInsert`), from bytes captured from a real PostgreSQL 15.

The router's source feeds the inserts of a transaction that already spilled as `raw_insert(...)`: the
row stays the server's bytes until a reader decodes it (`decode_raw_insert`) or copies it through to
COPY. Decoded, it must be exactly what `decode` gives for the same bytes; cut short, it must raise a
ProtocolError, never anything else.
"""

from __future__ import annotations

import msgspec
import pytest

from protocol.errors import ProtocolError
from protocol.messages import Insert, RawInsert
from protocol.pgoutput import Decoder, decode_raw_insert, raw_insert, raw_tuple
from tests.protocol.captured import CAPTURES, load


def inserts(capture: str) -> list[tuple[bytes, bool, Insert]]:
    """Every Insert frame of a capture: payload, whether it sits in a stream block, decoded."""
    decoder = Decoder()
    out = []
    for frame in load(capture).frames:
        in_stream = decoder.in_stream
        message = decoder.decode(frame.payload)
        if isinstance(message, Insert):
            out.append((frame.payload, in_stream, message))
    return out


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_raw_insert_decodes_to_what_decode_gives(capture: str) -> None:
    found = inserts(capture)
    assert len(found) > 100
    if load(capture).streaming:
        assert any(in_stream for _, in_stream, _ in found)  # with the xid prefix, too
    for payload, in_stream, insert in found:
        raw = raw_insert(payload, 0, streaming=in_stream)
        assert (raw.relid, raw.xid) == (insert.relid, insert.xid)
        assert decode_raw_insert(raw) == insert
        assert raw_tuple(raw) == insert.new
        # after a spill file round trip (msgpack), too
        again = msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=RawInsert)
        assert decode_raw_insert(again) == insert


def test_an_insert_read_in_place_from_a_whole_frame() -> None:
    payload, in_stream, insert = inserts("text_v1")[0]
    frame = b"w" + bytes(24) + payload  # XLogData header, then the message
    assert decode_raw_insert(raw_insert(frame, 25, streaming=in_stream, lsn=7)) == insert
    in_place = raw_insert(memoryview(frame), 25, streaming=in_stream)  # as the source reads frames
    assert type(in_place.data) is bytes and decode_raw_insert(in_place) == insert


@pytest.mark.parametrize("capture", ["text_v1", "binary_v2_stream"])
def test_cut_short_raises_protocol_error(capture: str) -> None:
    for payload, in_stream, _ in inserts(capture)[:20]:
        head = 1 + (4 if in_stream else 0) + 5
        for cut in range(head):
            with pytest.raises(ProtocolError):
                raw_insert(payload[:cut], 0, streaming=in_stream, lsn=1)
        raw = raw_insert(payload, 0, streaming=in_stream)
        for cut in range(len(raw.data)):
            with pytest.raises(ProtocolError):
                raw_tuple(RawInsert(raw.relid, raw.data[:cut], raw.xid))
        with pytest.raises(ProtocolError):
            raw_tuple(RawInsert(raw.relid, raw.data + b"x", raw.xid))


def test_not_an_insert_is_refused() -> None:
    payload, _, _ = inserts("text_v1")[0]
    with pytest.raises(ProtocolError, match="not an insert"):
        raw_insert(b"U" + payload[1:], 0, streaming=False)
    with pytest.raises(ProtocolError, match="expected 'N'"):
        raw_insert(payload[:5] + b"K" + payload[6:], 0, streaming=False)
