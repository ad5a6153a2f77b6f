"""The compiled row-layout fast path decodes exactly what the column-by-column path decodes."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import pgoutput
from protocol.errors import ProtocolError

cell = st.one_of(
    st.just(b"n"), st.just(b"u"),
    st.tuples(st.sampled_from([b"t", b"b"]), st.binary(max_size=6)).map(
        lambda kv: kv[0] + struct.pack(">I", len(kv[1])) + kv[1]
    ),
)
row = st.lists(cell, min_size=1, max_size=5).map(
    lambda cells: struct.pack(">h", len(cells)) + b"".join(cells)
)
# What the private readers may raise on short input; decode() turns all of it into TruncatedMessage.
SHORT = (ProtocolError, struct.error, IndexError)


def outcome(read: object, buf: bytes) -> object:
    try:
        return read(buf, 0)  # type: ignore[operator]
    except SHORT:
        return "error"


@settings(max_examples=400, deadline=None)
@given(st.lists(row, min_size=1, max_size=12), st.binary(max_size=3))
def test_fast_path_equals_column_by_column(rows: list[bytes], tail: bytes) -> None:
    """Rows of the same length repeat, so layouts get compiled, reused and contradicted."""
    pgoutput._SHAPES.clear()
    for image in rows * 3:
        buf = image + tail
        assert outcome(pgoutput._tuple, buf) == outcome(pgoutput._columns, buf)


@settings(max_examples=200, deadline=None)
@given(st.lists(row, min_size=1, max_size=6), st.integers(0, 40))
def test_fast_path_never_reads_a_truncated_row_as_whole(rows: list[bytes], cut: int) -> None:
    pgoutput._SHAPES.clear()
    for image in rows * 3:
        pgoutput._tuple(image, 0)  # learn
        short = image[: max(0, len(image) - 1 - cut % max(1, len(image)))]
        assert outcome(pgoutput._tuple, short) == outcome(pgoutput._columns, short)
