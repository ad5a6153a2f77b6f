"""router.apply.parallel: which transactions may share a batch's lanes."""

from __future__ import annotations

from protocol.messages import Column, Delete, Insert, Relation, Truncate, TupleData, Update
from protocol.transactions import Transaction
from router.apply.parallel import plan_lanes, row_keys
from router.apply.statements import TargetTable

KV = Relation(7, "public", "kv", "d", (Column("id", 23, -1, True), Column("v", 23, -1, False),
                                        Column("u", 25, -1, False)))
TABLES = {("public", "kv"): TargetTable("public", "kv", frozenset({"id", "v", "u"}),
                                        {"id": "integer", "v": "integer", "u": "text"}, ("id",), (("u",),))}


def txn(*changes: object) -> Transaction:
    return Transaction(1, 1, 1, 0, list(changes), {7: KV})  # type: ignore[arg-type]


def ins(i: int, u: str) -> Insert:
    return Insert(7, TupleData(b"ttt", (str(i).encode(), b"0", u.encode())))


def upd(i: int) -> Update:
    return Update(7, TupleData(b"ttu", (str(i).encode(), b"1", None)))


def test_keys_are_primary_and_unique_values() -> None:
    keys = row_keys(txn(ins(1, "x")), TABLES)
    assert keys is not None and len(keys) == 2


def test_independent_transactions_spread_and_dependent_ones_follow() -> None:
    lanes = plan_lanes([txn(ins(1, "a")), txn(ins(2, "b")), txn(upd(1)), txn(upd(2)), txn(upd(1))], TABLES, 2)
    assert lanes[0] != lanes[1]
    assert lanes[2] == lanes[0] and lanes[4] == lanes[0] and lanes[3] == lanes[1]


def test_a_transaction_on_two_lanes_ends_the_plan() -> None:
    lanes = plan_lanes([txn(ins(1, "a")), txn(ins(2, "b")), txn(upd(1), upd(2)), txn(ins(3, "c"))], TABLES, 2)
    assert len(lanes) == 2


def test_same_unique_value_is_a_dependency() -> None:
    lanes = plan_lanes([txn(ins(1, "same")), txn(ins(2, "same"))], TABLES, 2)
    assert lanes[0] == lanes[1]


def test_truncate_and_full_identity_run_alone() -> None:
    assert row_keys(txn(Truncate((7,), False, False)), TABLES) is None
    full = Delete(7, TupleData(b"ttt", (b"1", b"0", b"x")), "O")
    assert row_keys(txn(full), TABLES) is None
    assert plan_lanes([txn(ins(1, "a")), txn(full)], TABLES, 2) == [0]
