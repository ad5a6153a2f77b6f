"""The decoder and assembler against bytes captured from a real PostgreSQL 15 (see capture.py)."""

from __future__ import annotations

import struct
from collections import Counter

import pytest

from protocol.messages import (
    UNCHANGED_TOAST,
    Begin,
    Commit,
    Delete,
    Insert,
    Message,
    Origin,
    Relation,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Type,
    Update,
)
from protocol.transactions import Transaction
from tests.unit.protocol.captured import CAPTURES, assembled, load, messages


def int4(capture: str, cell: object) -> int:
    assert isinstance(cell, bytes)
    return struct.unpack(">i", cell)[0] if load(capture).binary else int(cell)


def txns(capture: str) -> list[Transaction]:
    return [t for t in assembled(capture) if isinstance(t, Transaction)]


def rows(capture: str, kind: type, table: str) -> list[object]:
    out = []
    for txn in txns(capture):
        rels = dict(txn.relations)
        for change in txn.changes:
            if isinstance(change, Relation):
                rels[change.relid] = change
            elif isinstance(change, kind) and rels[change.relid].name == table:  # type: ignore[attr-defined]
                out.append(change)
    return out


@pytest.mark.parametrize("capture", CAPTURES)
def test_captured_from_postgres_15(capture: str) -> None:
    data = load(capture)
    assert data.server_version.startswith("15.")
    assert len(data.frames) > 1000


@pytest.mark.parametrize("capture", CAPTURES)
def test_every_message_type_present(capture: str) -> None:
    seen = Counter(type(m) for m in messages(capture))
    expected = {Begin, Commit, Origin, Relation, Type, Insert, Update, Delete, Truncate, Message}
    if load(capture).streaming:
        expected |= {StreamStart, StreamStop, StreamCommit, StreamAbort}
    else:
        assert not seen.keys() & {StreamStart, StreamStop, StreamCommit, StreamAbort}
    assert expected <= seen.keys()


@pytest.mark.parametrize("capture", CAPTURES)
def test_cell_kinds_follow_binary_option(capture: str) -> None:
    kinds = set()
    for m in messages(capture):
        if isinstance(m, Insert):
            kinds |= set(m.new.kinds)
    want = ord("b") if load(capture).binary else ord("t")
    assert want in kinds and ord("n") in kinds
    assert ({ord("t"), ord("b")} - {want}).isdisjoint(kinds)


@pytest.mark.parametrize("capture", CAPTURES)
def test_insert_values_and_nulls(capture: str) -> None:
    first = rows(capture, Insert, "items")[0]
    assert isinstance(first, Insert)
    new = first.new
    assert int4(capture, new.values[0]) == 1
    assert new.values[1] == b"one"
    assert new.is_null(6) and new.values[6] is None
    assert new.values[7] == b"n1"
    rel = next(m for m in messages(capture) if isinstance(m, Relation) and m.name == "items")
    assert rel.namespace == "public" and rel.replica_identity == "d"
    assert rel.column_names == ("id", "name", "qty", "price", "tags", "m", "big", "note")
    assert rel.key_columns == ("id",)
    assert [c.type_oid for c in rel.columns][:4] == [23, 25, 23, 1700]
    assert rel.columns[3].type_modifier == (10 << 16 | 2) + 4  # numeric(10,2)


@pytest.mark.parametrize("capture", CAPTURES)
def test_enum_column_sends_type_message(capture: str) -> None:
    types = [m for m in messages(capture) if isinstance(m, Type)]
    assert types and all(t.name == "mood" and t.namespace == "public" for t in types)
    rel = next(m for m in messages(capture) if isinstance(m, Relation) and m.name == "items")
    assert rel.columns[5].type_oid == types[0].oid


@pytest.mark.parametrize("capture", CAPTURES)
def test_toasted_value_left_unchanged_by_update(capture: str) -> None:
    inserted = rows(capture, Insert, "items")[1]
    assert isinstance(inserted, Insert)
    big = inserted.new.values[6]
    assert isinstance(big, bytes) and len(big) == 8000
    update = rows(capture, Update, "items")[0]
    assert isinstance(update, Update)
    assert update.old is None and update.old_kind is None
    assert update.new.is_unchanged(6) and not update.new.is_null(6)
    assert update.new.values[6] is UNCHANGED_TOAST
    assert int4(capture, update.new.values[2]) == 21


@pytest.mark.parametrize("capture", CAPTURES)
def test_primary_key_change_sends_old_key(capture: str) -> None:
    update = rows(capture, Update, "items")[1]
    assert isinstance(update, Update) and update.old is not None
    assert update.old_kind == "K"
    assert int4(capture, update.old.values[0]) == 1
    assert all(update.old.is_null(i) for i in range(1, 8))  # only key columns in the old key
    assert int4(capture, update.new.values[0]) == 3
    delete = rows(capture, Delete, "items")[0]
    assert isinstance(delete, Delete)
    assert delete.old_kind == "K" and int4(capture, delete.old.values[0]) == 3


@pytest.mark.parametrize("capture", CAPTURES)
def test_replica_identity_full_sends_old_row(capture: str) -> None:
    rel = next(m for m in messages(capture) if isinstance(m, Relation) and m.name == "full_ident")
    assert rel.replica_identity == "f" and rel.key_columns == ("a", "b")
    (update,) = rows(capture, Update, "full_ident")
    assert isinstance(update, Update) and update.old is not None
    assert update.old_kind == "O" and update.old.values[1] == b"x" and update.new.values[1] == b"y"
    (delete,) = rows(capture, Delete, "full_ident")
    assert isinstance(delete, Delete)
    assert delete.old_kind == "O" and int4(capture, delete.old.values[0]) == 2 and delete.old.is_null(1)


@pytest.mark.parametrize("capture", CAPTURES)
def test_truncate_flags(capture: str) -> None:
    truncates = [m for m in messages(capture) if isinstance(m, Truncate)]
    assert [(t.cascade, t.restart_identity, len(t.relids)) for t in truncates] == [
        (True, True, 2),
        (False, False, 1),
    ]
    names = {m.relid: m.name for m in messages(capture) if isinstance(m, Relation)}
    assert {names[r] for r in truncates[0].relids} == {"parent", "child"}
    assert names[truncates[1].relids[0]] == "full_ident"


@pytest.mark.parametrize("capture", CAPTURES)
def test_logical_messages(capture: str) -> None:
    plain = [m for m in messages(capture) if isinstance(m, Message)]
    assert [(m.transactional, m.prefix, m.content) for m in plain] == [
        (True, "pgmesh.test", b"transactional hello"),
        (False, "pgmesh.test", b"non-transactional hello"),
        (True, "pgmesh.bin", b"\x00\xff\x00"),
        (True, "pgmesh.test", b"inside a stream"),
    ]
    # The non-transactional one is handed out on its own; the others inside their transactions.
    loose = [m for m in assembled(capture) if isinstance(m, Message)]
    assert [m.content for m in loose] == [b"non-transactional hello"]
    inside = [c for t in txns(capture) for c in t.changes if isinstance(c, Message)]
    assert len(inside) == 3 and all(m.transactional for m in inside)


@pytest.mark.parametrize("capture", CAPTURES)
def test_relation_sent_again_after_alter_table(capture: str) -> None:
    items = [m for m in messages(capture) if isinstance(m, Relation) and m.name == "items"]
    assert len({m.relid for m in items}) == 1
    assert items[0].column_names[-1] == "note"
    assert items[-1].column_names[-1] == "extra"
    after = [i for i in rows(capture, Insert, "items") if isinstance(i, Insert) and len(i.new.values) == 9]
    assert after and int4(capture, after[0].new.values[8]) == 7


@pytest.mark.parametrize("capture", CAPTURES)
def test_origin_message_from_origin_session(capture: str) -> None:
    origins = [m for m in messages(capture) if isinstance(m, Origin)]
    assert [(o.name, o.commit_lsn) for o in origins] == [("pgmesh_capture_origin", 0xABCDEF)]
    (txn,) = [t for t in txns(capture) if t.origin is not None]
    assert txn.origin == "pgmesh_capture_origin" and txn.origin_lsn == 0xABCDEF
    (insert,) = txn.changes
    assert isinstance(insert, Insert) and insert.new.values[1] == b"from elsewhere"


@pytest.mark.parametrize("capture", CAPTURES)
def test_transactions_whole_and_in_commit_order(capture: str) -> None:
    all_txns = txns(capture)
    ends = [t.end_lsn for t in all_txns]
    assert ends == sorted(ends) and len(set(ends)) == len(ends)
    for t in all_txns:
        assert t.commit_lsn < t.end_lsn and t.commit_time > 0
        for change in t.changes:
            if isinstance(change, (Insert, Update, Delete)):
                assert change.relid in t.relations or any(
                    isinstance(c, Relation) and c.relid == change.relid for c in t.changes
                )
    bulk = {}
    for t in all_txns:
        payloads = Counter(
            c.new.values[1]
            for c in t.changes
            if isinstance(c, Insert) and len(c.new.values) > 1 and isinstance(c.new.values[1], bytes)
        )
        bulk.update({k: (v, t.streamed) for k, v in payloads.items()})
    streaming = load(capture).streaming
    assert bulk[b"x" * 40] == (1500, streaming)
    assert b"gone" not in bulk and b"rolled-back" not in bulk  # aborted transaction and subtransaction
    assert bulk[b"kept-a"] == (1000, streaming) and bulk[b"kept-b"] == (10, streaming)
    assert bulk[b"big"] == (2000, streaming)
    # The small transaction that committed while the big one streamed is handed out first.
    names = [
        c.new.values[1]
        for t in all_txns
        for c in t.changes
        if isinstance(c, Insert) and len(c.new.values) > 1
    ]
    assert names.index(b"interleaved") < names.index(b"big")


def test_streamed_blocks_carry_xids() -> None:
    msgs = messages("binary_v2_stream")
    starts = [m for m in msgs if isinstance(m, StreamStart)]
    aborts = [m for m in msgs if isinstance(m, StreamAbort)]
    commits = [m for m in msgs if isinstance(m, StreamCommit)]
    assert starts[0].first_segment and any(not s.first_segment for s in starts)
    assert len(commits) == 3
    assert any(a.xid == a.subxid for a in aborts)  # a whole streamed transaction rolled back
    assert any(a.xid != a.subxid for a in aborts)  # ROLLBACK TO SAVEPOINT inside a streamed one
    in_stream = False
    for m in msgs:
        if isinstance(m, StreamStart):
            in_stream = True
        elif isinstance(m, StreamStop):
            in_stream = False
        elif isinstance(m, (Insert, Relation, Message)) and m.__struct_config__.tag != "O":
            if isinstance(m, Message) and not m.transactional:
                continue
            assert (m.xid is not None) == in_stream


def test_binary_values_are_copy_binary_fields() -> None:
    first = rows("binary_v1", Insert, "items")[0]
    assert isinstance(first, Insert)
    values = first.new.values
    assert values[0] == b"\x00\x00\x00\x01"
    assert values[2] == struct.pack(">i", 10)
    assert values[3] == struct.pack(">hhhh", 2, 0, 0, 2) + struct.pack(">hh", 1, 5000)  # numeric 1.50
    assert values[5] == b"ok"  # enum send format is its label


def test_tuple_helpers() -> None:
    t = TupleData(b"tnub", (b"1", None, UNCHANGED_TOAST, b"\x00"))
    assert t.text(0) == "1" and t.text(1) is None
    assert t.is_null(1) and t.is_unchanged(2) and t.is_binary(3)
    with pytest.raises(ValueError):
        t.text(3)
    assert repr(UNCHANGED_TOAST) == "UNCHANGED_TOAST"
