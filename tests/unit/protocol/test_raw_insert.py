"""Inserts left undecoded (`RawInsert`), from bytes captured from a real PostgreSQL 15.

The router's source feeds the inserts of a transaction that already spilled as `raw_insert(...)`: the
row stays the server's bytes until a reader decodes it (`decode_raw_insert`) or copies it through to
COPY. Decoded, it must be exactly what `decode` gives for the same bytes; cut short, it must raise a
ProtocolError, never anything else.
"""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import ProtocolError
from protocol.messages import Insert, RawInsert
from protocol.pgoutput import Decoder, decode_raw_insert, raw_copy_text, raw_insert, raw_tuple
from tests.unit.protocol.captured import CAPTURES, load


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


# ---------------------------------------------------------------------- rows straight to COPY text


def _cell(value: bytes | None) -> bytes:
    return b"n" if value is None else b"t" + struct.pack(">I", len(value)) + value


def _raw(values: list[bytes | None]) -> RawInsert:
    return RawInsert(1, struct.pack(">h", len(values)) + b"".join(_cell(v) for v in values))


def _copy_lines(rows: list[list[bytes | None]]) -> bytes | None:
    """COPY text of rows the simple way; None when a value needs escaping or is NULL."""
    out = b""
    for row in rows:
        if any(v is None or any(c in v for c in (b"\t", b"\n", b"\r", b"\\")) for v in row):
            return None
        out += b"\t".join(v for v in row if v is not None) + b"\n"
    return out


@pytest.mark.parametrize("capture", CAPTURES)
def test_raw_copy_text_of_captured_rows_is_their_values_or_none(capture: str) -> None:
    by_relation: dict[int, list[tuple[RawInsert, Insert]]] = {}
    for payload, in_stream, insert in inserts(capture):
        by_relation.setdefault(insert.relid, []).append((raw_insert(payload, 0, streaming=in_stream), insert))
    fast = 0
    for pairs in by_relation.values():
        width = len(pairs[0][1].new.kinds)
        got = raw_copy_text([raw for raw, _ in pairs], width)
        binary = any(k != ord("t") and k != ord("n") for _, i in pairs for k in i.new.kinds)
        want = None if binary else _copy_lines([list(i.new.values) for _, i in pairs])  # type: ignore[misc]
        assert got is None or got == want
        fast += got is not None
    assert fast or load(capture).binary


_TEXT = st.binary(max_size=12).map(lambda b: b.replace(b"\0", b"t"))
_VALUE = st.one_of(
    _TEXT,
    st.sampled_from([b"t", b"tt", b"\\", b"a\tb", b"a\nb", b"\r", b"x" * 300, b"t" * 0x7400, b"y" * 70_000]),
    st.none(),
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5).flatmap(lambda w: st.lists(st.lists(_VALUE, min_size=w, max_size=w), min_size=1,
                                                    max_size=6)))
def test_raw_copy_text_is_the_copy_lines_or_none(rows: list[list[bytes | None]]) -> None:
    width = len(rows[0])
    got = raw_copy_text([_raw(r) for r in rows], width)
    want = _copy_lines(rows)
    assert got is None or got == want
    simple = all(v is not None and len(v) < 65_536 for r in rows for v in r)
    if simple and want is not None:
        assert got == want  # nothing in the way: the fast path takes it
