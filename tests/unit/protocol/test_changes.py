"""The kinds of change and their dispatch table (protocol.changes), and the message prefixes a transaction
carries, spilled part included (Transaction.prefixes, kept by the assembler as messages arrive)."""

from __future__ import annotations

import struct
from typing import Any

import pytest

from protocol.changes import KINDS, ChangeContext, Dispatch, ignore, note_relation, prefixes_of
from protocol.messages import (
    Begin,
    Column,
    Commit,
    Delete,
    Insert,
    Message,
    RawInsert,
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
from protocol.transactions import Spill, Transaction, TransactionAssembler

REL = Relation(16384, "public", "t", "d", (Column("id", 23, -1, True), Column("v", 25, -1, False)))
DDL = "pgmesh.ddl"


def row(i: int, xid: int | None = None) -> Insert:
    return Insert(REL.relid, TupleData(b"bt", (struct.pack(">i", i), f"v{i}".encode())), xid)


def message(prefix: str, xid: int | None = None) -> Message:
    return Message(True, 0x10, prefix, b"{}", xid)


def test_a_table_names_every_kind_or_says_what_handles_the_rest() -> None:
    def name(context: list[str], change: Any) -> str:
        context.append(type(change).__name__)
        return type(change).__name__

    table: Dispatch[list[str], str] = Dispatch({kind: name for kind in KINDS})
    seen: list[str] = []
    tuple_ = TupleData(b"t", (b"1",))
    changes = [REL, Type(1, "s", "t"), row(1), RawInsert(1, b""), Update(1, tuple_), Delete(1, tuple_, "K"),
               Truncate((1,), False, False), message("p")]
    assert [table(seen, c) for c in changes] == seen == [k.__name__ for k in KINDS]
    with pytest.raises(TypeError, match="no handler for Message"):
        Dispatch({kind: name for kind in KINDS if kind is not Message})
    with pytest.raises(TypeError, match="not a kind of change: Begin"):
        Dispatch({Begin: name}, otherwise=name)
    rows_only: Dispatch[list[str], str] = Dispatch({Insert: name}, otherwise=lambda context, change: "other")
    assert rows_only([], row(1)) == "Insert" and rows_only([], REL) == "other"


def test_shared_handlers_keep_relations_current_and_ignore() -> None:
    context = ChangeContext({})
    note_relation(context, REL)
    assert context.relations == {REL.relid: REL}
    assert ignore(context, REL) is None


def test_prefixes_of_the_messages_among_changes() -> None:
    assert prefixes_of([REL, row(1), message(DDL), message("x"), message(DDL)]) == {DDL, "x"}
    assert prefixes_of([row(1)]) == set()


def test_a_hand_built_transaction_collects_its_prefixes() -> None:
    txn = Transaction(1, 2, 3, 4, [REL, message(DDL), row(1)], {REL.relid: REL})
    assert txn.prefixes == {DDL}
    assert Transaction(1, 2, 3, 4, [row(1)], {REL.relid: REL}).prefixes == frozenset()
    given = Transaction(1, 2, 3, 4, [row(1)], {REL.relid: REL}, prefixes=frozenset({"x"}))
    assert given.prefixes == {"x"}


def test_the_prefixes_of_a_spilled_part_stay_known() -> None:
    asm = TransactionAssembler(spill_bytes=25)
    asm.feed(Begin(0x500, 1, 7))
    asm.feed(REL)
    asm.feed(message(DDL), None, 10)
    early = None
    for i in range(4):
        if isinstance(asm.feed(row(i), None, 10), Spill) and early is None:
            early = asm.open_transaction()  # handed out at its first spill, as a source may
    assert early is not None and early.prefixes == {DDL}
    asm.feed(message("later"), None, 5)
    assert early.prefixes == {DDL, "later"}  # the assembler's own set: it grows with the transaction
    txn = asm.feed(Commit(0, 0x500, 0x510, 2))
    assert isinstance(txn, Transaction) and txn.spilled
    assert prefixes_of(txn.changes) == {"later"}  # the DDL message is in the spilled part
    assert txn.prefixes == {DDL, "later"} and txn.prefixes is early.prefixes
    asm.feed(Begin(0x600, 1, 8))
    asm.feed(row(1), None, 30)
    plain = asm.feed(Commit(0, 0x600, 0x610, 2))
    assert isinstance(plain, Transaction) and plain.prefixes == frozenset()


def test_a_subtransaction_aborted_takes_its_messages_in_memory_away_not_the_spilled_ones() -> None:
    asm = TransactionAssembler(spill_bytes=25)
    asm.feed(StreamStart(9, True))
    asm.feed(REL)
    asm.feed(message("spilled", 11), None, 10)
    assert isinstance(asm.feed(row(1, 11), None, 20), Spill)
    asm.feed(message("kept", 9), None, 5)
    asm.feed(message("memory", 11), None, 5)
    asm.feed(StreamStop())
    stream = asm.open_stream(9)
    assert stream is not None and stream.prefixes == {"spilled", "kept", "memory"}
    asm.feed(StreamAbort(9, 11))
    txn = asm.feed(StreamCommit(9, 0, 0x900, 0x910, 5))
    assert isinstance(txn, Transaction) and txn.aborted_subxids == (11,)
    assert txn.prefixes == {"spilled", "kept"} and stream.prefixes == {"spilled", "kept"}
    asm.feed(StreamStart(10, True))
    asm.feed(message("gone", 12), None, 5)
    asm.feed(StreamStop())
    asm.feed(StreamAbort(10, 12))
    whole = asm.feed(StreamCommit(10, 0, 0xA00, 0xA10, 5))
    assert isinstance(whole, Transaction) and whole.prefixes == set() and whole.changes == []
