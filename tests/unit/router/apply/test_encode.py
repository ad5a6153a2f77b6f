"""The pipe's encoding of a source transaction (router.apply.encode): what it takes, what it leaves to the
script path, and the parameters of each statement (the tuple's own bytes). No server."""

from __future__ import annotations

import msgspec
import pytest

from protocol.messages import (
    KIND_BINARY,
    KIND_NULL,
    KIND_TEXT,
    UNCHANGED_TOAST,
    Column,
    Delete,
    Insert,
    Message,
    Relation,
    Truncate,
    TupleData,
    Type,
    Update,
)
from protocol.transactions import Transaction
from router.apply.encode import DELETE, INSERT, UPDATE, Encoded, Encoder, Shape, encode
from router.apply.parts import is_large
from router.apply.statements import KEY_LOCKS_MAX, remote_version

REL = Relation(7, "public", "t", "d", (
    Column("id", 23, -1, True), Column("note", 25, -1, False), Column("doc", 114, -1, False),
))
# the same table after DDL: a fourth column
REL2 = Relation(7, "public", "t", "d", (*REL.columns, Column("extra", 25, -1, False)))


def txn(*changes: object, relations: tuple[Relation, ...] = (REL,), seen: tuple[tuple[str, int], ...] = (),
        ) -> Transaction:
    return Transaction(
        xid=5, commit_lsn=0x100, end_lsn=0x1_0000_0200, commit_time=0, changes=list(changes),  # type: ignore[arg-type]
        relations={r.relid: r for r in relations}, seen=seen,
    )


def row(*values: bytes | None) -> TupleData:
    return TupleData(bytes(KIND_NULL if v is None else KIND_TEXT for v in values), values)


def encoded(t: Transaction) -> Encoded:
    result = encode(t)
    assert result is not None
    return result


INSERT_ONE = Insert(7, row(b"1", b"a", None))
UPDATE_ONE = Update(7, row(b"1", b"b", b"{}"))
DELETE_ONE = Delete(7, TupleData(b"tnn", (b"1", None, None)), "K")


def test_a_plain_transaction_is_taken_with_its_setup() -> None:
    enc = encoded(txn(INSERT_ONE, UPDATE_ONE, DELETE_ONE))
    assert [(s.code, p) for s, p, _ in enc.statements] == [
        (INSERT, (b"1", b"a", None)), (UPDATE, (b"1", b"b", b"{}", b"1")),
        (DELETE, (b"1",)),
    ]
    assert [c for _, _, c in enc.statements] == [INSERT_ONE, UPDATE_ONE, DELETE_ONE]
    assert enc.setup == (b"1/200", b"2000-01-01 00:00:00.000000+00")


@pytest.mark.parametrize("change", [
    Update(7, row(b"2", b"b", b"{}"), row(b"1", None, None), "K"),  # a moved key
    Update(7, row(b"1", b"b", b"{}"), row(b"1", b"a", b"{}"), "O"),  # REPLICA IDENTITY FULL
    Delete(7, row(b"1", b"a", b"{}"), "O"),  # a delete without a key tuple
    Truncate((7,), False, False),
    Insert(7, TupleData(bytes([KIND_TEXT, KIND_BINARY, KIND_NULL]), (b"1", b"\x00a", None))),  # binary
    Update(7, TupleData(bytes([KIND_TEXT, KIND_BINARY, KIND_TEXT]), (b"1", b"\x00b", b"{}"))),
    Update(7, TupleData(b"utt", (UNCHANGED_TOAST, b"b", b"{}"))),  # a key value left out (unchanged TOAST)
    Delete(7, TupleData(bytes([KIND_BINARY, KIND_NULL, KIND_NULL]), (b"\x00\x01", None, None)), "K"),
], ids=["moved-key", "full-update", "full-delete", "truncate", "binary-insert", "binary-update",
        "toast-key", "binary-delete"])
def test_what_the_pipe_leaves_to_the_script_path(change: object) -> None:
    assert encode(txn(INSERT_ONE, change)) is None
    assert encode(txn(INSERT_ONE)) is not None  # the rest alone is taken


def test_a_large_transaction_goes_to_the_script_path() -> None:
    rows = [Insert(7, row(str(i).encode(), None, None)) for i in range(KEY_LOCKS_MAX + 1)]
    assert is_large(txn(*rows)) and encode(txn(*rows)) is None
    assert not is_large(txn(*rows[:-1])) and encode(txn(*rows[:-1])) is not None


def test_a_keyless_update_goes_to_the_script_path() -> None:
    keyless = Relation(9, "public", "k", "n", (Column("a", 23, -1, False),))
    assert encode(txn(Update(9, row(b"1")), relations=(keyless,))) is None


def test_update_parameters_are_the_set_columns_then_the_key() -> None:
    """An unchanged TOAST value is not set (left out of the parameters and of the shape's `sets`)."""
    change = Update(7, TupleData(b"ttu", (b"3", b"x", UNCHANGED_TOAST)))
    enc = encoded(txn(change))
    (shape, params, got), = enc.statements
    assert got is change
    assert shape.code == UPDATE and shape.sets == (0, 1) and shape.keys == (0,)
    assert params == (b"3", b"x", b"3")
    nulls = Update(7, row(b"3", None, b"[]"))
    (shape, params, _), = encoded(txn(nulls)).statements
    assert shape.sets == (0, 1, 2) and params == (b"3", None, b"[]", b"3")


def test_delete_parameters_are_the_key_and_insert_parameters_every_column() -> None:
    enc = encoded(txn(DELETE_ONE, Insert(7, row(b"2", None, b"{}"))))
    (dshape, dparams, _), (ishape, iparams, _) = enc.statements
    assert dshape.code == DELETE and dshape.keys == (0,) and dshape.sets == () and dparams == (b"1",)
    assert ishape.code == INSERT and ishape.sets == (0, 1, 2) and iparams == (b"2", None, b"{}")
    value = b"it's"
    (_, params, _), = encoded(txn(Insert(7, row(b"4", value, None)))).statements
    assert params[1] is value  # the tuple's own bytes, not a copy or a literal


def test_the_same_shape_is_the_same_object() -> None:
    shapes: dict[tuple[int, str, bytes], Shape] = {}
    one = encode(txn(Update(7, row(b"1", b"a", b"{}")), INSERT_ONE), shapes)
    two = encode(txn(Update(7, row(b"2", None, b"[]")), Insert(7, row(b"5", None, None))), shapes)
    toast = encode(txn(Update(7, TupleData(b"ttu", (b"1", b"a", UNCHANGED_TOAST)))), shapes)
    assert one is not None and two is not None and toast is not None
    assert one.statements[0][0] is two.statements[0][0]  # NULL or not: the same mask
    assert one.statements[1][0] is two.statements[1][0]
    assert toast.statements[0][0] is not one.statements[0][0]  # another mask
    assert toast.statements[0][0].sets == (0, 1)
    encoder = Encoder()
    first = encoder.shape(UPDATE, REL, b"\x00\x00\x00")
    assert encoder.shape(UPDATE, REL, b"\x00\x00\x00") is first
    assert encoder.shape(UPDATE, REL, b"\x00\x00\x01") is not first
    assert encoder.shape(DELETE, REL, b"") is not first


def test_an_inline_relation_message_changes_the_relation_of_later_changes() -> None:
    before = Insert(7, row(b"1", None, None))
    after = Insert(7, row(b"2", None, None, b"x"))
    enc = encoded(txn(before, Type(99, "public", "mood"), REL2, after, Message(True, 1, "p", b"c")))
    (first, p1, _), (second, p2, _) = enc.statements
    assert first.relation is REL and second.relation is REL2
    assert first is not second and second.sets == (0, 1, 2, 3)
    assert p1 == (b"1", None, None) and p2 == (b"2", None, None, b"x")


def test_the_encoder_shares_an_encoding_for_the_same_transaction_object() -> None:
    encoder = Encoder()
    t = txn(INSERT_ONE)
    first = encoder.encoded(t)
    assert first is not None and encoder.encodes == 1 and encoder.hits == 0
    assert encoder.encoded(t) is first and encoder.hits == 1 and encoder.encodes == 1
    other = txn(INSERT_ONE)  # equal, but another object: encoded anew
    again = encoder.encoded(other)
    assert again is not None and again is not first and again.txn is other
    assert encoder.encodes == 2 and encoder.hits == 1
    assert again.statements[0][0] is first.statements[0][0]  # the shapes are shared
    truncate = txn(Truncate((7,), False, False))
    assert encoder.encoded(truncate) is None and encoder.encoded(truncate) is None
    # a transaction left to scripts is not kept (a large one would stay in memory for nothing)
    assert encoder.encodes == 4 and encoder.hits == 1


def test_the_encoder_keeps_a_bounded_number_of_bytes() -> None:
    """The shared encodings hold their transactions: at most _CACHED_BYTES of payload, the oldest go."""
    encoder = Encoder()
    big = [msgspec.structs.replace(txn(INSERT_ONE), nbytes=6 << 20) for _ in range(4)]
    for t in big:
        encoder.encoded(t)
    assert encoder.encoded(big[-1]) is not None and encoder.hits == 1  # the newest is kept
    encoder.encoded(big[0])  # 24 MB came after it: gone, encoded again
    assert encoder.hits == 1 and encoder.encodes == 5


def test_remote_is_the_setup_and_the_remote_version() -> None:
    t = txn(INSERT_ONE, seen=(("n2", 5),))
    enc = encoded(t)
    lsn, when = enc.setup
    assert lsn == b"1/200" and when == b"2000-01-01 00:00:00.000000+00"
    remote = enc.remote()
    assert remote[:2] == enc.setup
    assert remote[2] == remote_version(t, "1/200", "2000-01-01 00:00:00.000000+00").encode()
    assert remote[2] is not None and remote[2].startswith(b"1/200|2000-01-01 00:00:00.000000+00|{")
