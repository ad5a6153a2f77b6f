"""router.errors: errors render from their fields, context is added by copy, and the retry rules."""

from __future__ import annotations

import pickle

import asyncpg
import psycopg
import pytest

from protocol.transactions import Transaction
from router.errors import (
    CONFLICT_STATES,
    SCHEMA_STATES,
    UNIQUE_ATTEMPTS,
    Action,
    ApplyError,
    ConnectionLost,
    LostBeforeCommit,
    PgmeshError,
    SchemaMismatch,
    SchemaWait,
    decide,
    decide_link,
    describe,
    is_conflict,
    retry_unique,
    tables_changed,
)


def test_text_is_rendered_from_the_fields() -> None:
    exc = ApplyError("no column w", relation="public.t", sqlstate="42703", hint="add it")
    assert str(exc) == "table public.t, SQLSTATE 42703: no column w (hint: add it)"
    assert exc.args == ("no column w",)


def test_context_is_added_by_copy() -> None:
    exc = SchemaMismatch("no column w", relation="public.t")
    placed = exc.at(node="b", lsn=0x16B3748, relation="other.t")
    assert type(placed) is SchemaMismatch
    assert str(placed) == "node b, table public.t, LSN 0/16B3748: no column w"  # the raiser's table stays
    assert exc.node is None and exc.lsn is None  # the original is left as it was
    assert str(exc) == "table public.t: no column w"
    assert placed.at(node="c").node == "b"


def test_an_error_with_its_own_constructor_copies_too() -> None:
    txn = Transaction(xid=7, commit_lsn=0, end_lsn=0, commit_time=0, changes=[], relations={})
    lost = LostBeforeCommit(txn).at(node="b")
    assert lost.txn is txn and "transaction 7" in str(lost) and str(lost).startswith("node b:")


def test_keywords_and_pickling_as_before() -> None:
    exc = ConnectionLost("gone", node="a", lsn=1, relation=None, sqlstate="08006", hint=None)
    again = pickle.loads(pickle.dumps(exc))
    assert str(again) == str(exc) and again.sqlstate == "08006"
    assert decide(exc) is Action.RETRY


def test_the_appliers_rules() -> None:
    conflict = asyncpg.UniqueViolationError("duplicate key")
    assert is_conflict(conflict) and "23505" in CONFLICT_STATES
    assert tables_changed(asyncpg.UndefinedColumnError("no column")) and "42703" in SCHEMA_STATES
    assert not tables_changed(conflict)
    assert [retry_unique(conflict, n) for n in range(1, UNIQUE_ATTEMPTS + 1)] == [True] * 4 + [False]
    assert not retry_unique(asyncpg.DeadlockDetectedError("deadlock"), 1)


def test_a_link_waits_for_a_schema_then_pauses() -> None:
    wait = SchemaWait()
    missing = SchemaMismatch("no table public.t")
    assert decide_link(missing, wait, now=100.0, schema_wait_s=60) is Action.RETRY
    assert decide_link(missing, wait, now=159.0, schema_wait_s=60) is Action.RETRY
    assert decide_link(missing, wait, now=160.0, schema_wait_s=60) is Action.PAUSE
    assert decide_link(missing, wait, now=161.0, schema_wait_s=60) is Action.RETRY  # a new wait
    wait.done()
    assert wait.since is None


def test_a_link_retries_a_closed_session() -> None:
    wait = SchemaWait()
    assert decide_link(asyncpg.InterfaceError("connection is closed"), wait, now=0, schema_wait_s=60) \
        is Action.RETRY
    assert decide_link(asyncpg.InterfaceError("other"), wait, now=0, schema_wait_s=60) is Action.FAIL
    lost = asyncpg.InternalClientError("cannot switch to state 12; another operation (2) is in progress")
    assert decide_link(lost, wait, now=0, schema_wait_s=60) is Action.RETRY
    assert decide_link(psycopg.OperationalError("timeout"), wait, now=0, schema_wait_s=60) is Action.RETRY
    assert decide_link(PgmeshError("x", sqlstate="23502"), wait, now=0, schema_wait_s=60) is Action.PAUSE
    # a session the router terminated itself: asyncpg may raise anything from the statement in flight
    gone = AttributeError("'NoneType' object has no attribute 'bind_execute'")
    assert decide_link(gone, wait, now=0, schema_wait_s=60) is Action.FAIL
    assert decide_link(gone, wait, now=0, schema_wait_s=60, dropped=True) is Action.RETRY


@pytest.mark.parametrize("cls", [ApplyError, SchemaMismatch, ConnectionLost])
def test_every_error_is_a_pgmesh_error(cls: type[PgmeshError]) -> None:
    assert issubclass(cls, PgmeshError)


def test_describe_names_the_table_a_server_error_is_about() -> None:
    fields = {"M": 'duplicate key value violates unique constraint "t_pkey"', "C": "23505", "s": "public",
              "t": "t", "n": "t_pkey", "D": "Key (a)=(1) already exists."}
    exc = asyncpg.UniqueViolationError.new(fields)
    assert describe(exc) == (
        'table public.t: duplicate key value violates unique constraint "t_pkey" (SQLSTATE 23505)'
    )
    assert describe(asyncpg.UniqueViolationError.new({"M": "no table here", "C": "23505"})) == (
        "no table here (SQLSTATE 23505)"
    )
    assert describe(ValueError("plain\nsecond line")) == "ValueError: plain"
