"""`router.apply.skip`'s pure parts: which LSN a skip may name, where it falls in a batch, what a
transaction held (`pgmesh skip`)."""

from __future__ import annotations

import msgspec
import pytest

from protocol.messages import Column, Delete, Insert, Message, Relation, TupleData, Update
from protocol.transactions import Transaction
from router.apply.skip import check_skip, due, held_by, parse_skip
from router.ddl.messages import DDL_PREFIX, DdlCommand
from router.errors import PgmeshError


def txn(end: int, changes: list[object] | None = None) -> Transaction:
    rel = Relation(1, "public", "t", "d", (Column("id", 20, -1, True),))
    return Transaction(7, end - 8, end, 0, list(changes or []), {1: rel})  # type: ignore[arg-type]


def test_an_lsn_is_parsed_or_refused_with_what_one_looks_like() -> None:
    assert parse_skip("0/1A") == 0x1A
    with pytest.raises(PgmeshError, match="not an LSN"):
        parse_skip("1A")


def test_a_stuck_link_takes_only_its_own_transaction() -> None:
    assert "skipping the transaction at 0/100" in check_skip(0x100, link="a -> c", target="c", applied=0x80,
                                                             stuck=0x100)
    with pytest.raises(PgmeshError, match="stuck on the transaction that ends at 0/100, not at 0/108"):
        check_skip(0x108, link="a -> c", target="c", applied=0x80, stuck=0x100)
    with pytest.raises(PgmeshError, match=r"not ahead of what node c applied \(0/80\)"):
        check_skip(0x80, link="a -> c", target="c", applied=0x80, stuck=0x100)


def test_a_running_link_takes_a_future_lsn() -> None:
    assert "will be skipped when it comes" in check_skip(0x200, link="a -> c", target="c", applied=0x80,
                                                         stuck=None)


def test_due_is_the_first_transaction_at_or_past_the_lsn() -> None:
    batch = [txn(0x100), txn(0x200), txn(0x300)]
    assert due(batch, 0x200) == 1
    assert due(batch, 0x180) == 1  # none ends there: the applier drops the skip on reaching 0x200
    assert due(batch, 0x400) is None


def test_what_a_transaction_held_is_counted_per_table() -> None:
    row = TupleData(b"t", (b"1",))
    command = DdlCommand("CREATE INDEX t_v ON t (v)", "public", "postgres", "CREATE INDEX")
    ddl = Message(True, 0x10, DDL_PREFIX, msgspec.json.encode(command))
    tables, held = held_by(txn(0x100, [Insert(1, row), Insert(1, row), Update(1, row), Delete(1, row, "K"),
                                       ddl]))
    assert tables == "public.t"
    assert held == {"public.t": {"insert": 2, "update": 1, "delete": 1},
                    "ddl": ['CREATE INDEX: CREATE INDEX t_v ON t (v)']}
