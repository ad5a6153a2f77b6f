"""DDL replication, pure parts: the capture message, glob patterns as regexes, rows fitted after DDL."""

from __future__ import annotations

import re

import msgspec

from protocol.messages import Column, Delete, Insert, Message, Relation, TupleData, Update
from protocol.transactions import Transaction
from router.ddl.capture import glob_regex
from router.ddl.messages import DDL_PREFIX, DdlCommand, ddl_command, has_ddl
from router.ddl.reconcile import reconcile
from router.ops.ddl import orders_itself

REL = Relation(1, "public", "t", "d", (Column("id", 23, -1, True), Column("x", 23, -1, False),
                                      Column("z", 23, -1, False), Column("v", 25, -1, False)))


def row(*values: str | None) -> TupleData:
    return TupleData(bytes(ord("n") if v is None else ord("t") for v in values),
                     tuple(None if v is None else v.encode() for v in values))


def txn(*changes: object) -> Transaction:
    return Transaction(xid=1, commit_lsn=10, end_lsn=11, commit_time=0, changes=list(changes),
                       relations={1: REL})


def test_glob_patterns_match_like_the_config() -> None:
    regex = re.compile(glob_regex(["public.*", "app.order?", "plain"]))
    assert regex.match("public.t") and regex.match("app.orders") and regex.match("other.plain")
    assert not regex.match("app.order") and not regex.match("x.public")
    assert not re.compile(glob_regex([])).match("public.t")
    assert re.compile(glob_regex(["we.ird$(x)"])).match("we.ird$(x)")


def test_the_capture_message_round_trips() -> None:
    command = DdlCommand(sql="ALTER TABLE t ADD c int", search_path="public", role="app", tag="ALTER TABLE")
    message = Message(True, 5, DDL_PREFIX, msgspec.json.encode(command))
    assert ddl_command(message) == command
    assert has_ddl(txn(message)) and not has_ddl(txn(Message(True, 5, "other", b"{}")))


def test_rows_sent_before_a_rename_and_a_drop_fit_the_target() -> None:
    columns = {("public", "t"): frozenset({"id", "y", "v"})}
    drift = {"public.t": {"x": "y", "z": None}}
    original = txn(
        Insert(1, row("1", "10", "20", "a")),
        Update(1, row("1", "11", None, "b"), row("1", "10", "20", "a"), "O"),
        Delete(1, row("1", "11", None, "b"), "K"),
    )
    fitted = reconcile(original, columns, drift)
    assert fitted is not None
    relation = fitted.relations[1]
    assert [c.name for c in relation.columns] == ["id", "y", "v"]
    insert, update, delete = fitted.changes
    assert isinstance(insert, Insert) and insert.new == row("1", "10", "a")
    assert isinstance(update, Update) and update.new == row("1", "11", "b")
    assert update.old == row("1", "10", "a")
    assert isinstance(delete, Delete) and delete.old == row("1", "11", "b")


def test_renames_chain_and_inline_relations_are_fitted_too() -> None:
    columns = {("public", "t"): frozenset({"id", "x3", "z", "v"})}
    inline = Relation(1, "public", "t", "d", REL.columns)
    chain: dict[str, dict[str, str | None]] = {"public.t": {"x": "x2", "x2": "x3"}}
    fitted = reconcile(txn(inline, Insert(1, row("1", "2", "3", "4"))), columns, chain)
    assert fitted is not None
    assert isinstance(fitted.changes[0], Relation)
    assert [c.name for c in fitted.changes[0].columns] == ["id", "x3", "z", "v"]


def test_nothing_to_fit_or_an_unexplained_column_gives_none() -> None:
    insert = txn(Insert(1, row("1", "2", "3", "4")))
    every = {("public", "t"): frozenset({"id", "x", "z", "v"})}
    assert reconcile(insert, every, {"public.t": {"q": None}}) is None
    some = {("public", "t"): frozenset({"id", "v"})}
    assert reconcile(insert, some, {"public.t": {"x": None}}) is None  # z is missing and unexplained


def test_enum_labels_always_go_behind_the_barrier_and_the_lock() -> None:
    assert orders_itself("ALTER TYPE mood ADD VALUE 'x'")
    assert orders_itself("alter type public.mood\n  add value if not exists 'y' before 'ok'")
    assert orders_itself("DO $$ BEGIN ALTER TYPE m ADD VALUE 'z'; END $$")
    assert not orders_itself("ALTER TYPE mood RENAME VALUE 'x' TO 'y'")
    assert not orders_itself("ALTER TABLE t ADD COLUMN value int")
