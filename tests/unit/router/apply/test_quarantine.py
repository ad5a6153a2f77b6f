"""Quarantine's pure parts (router.apply.quarantine, router.errors.is_refused, the config's on_refused), and
an applier that meets an illegal liveness move while it handles an error: it ends in "error", its task
goes on."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest

from protocol.messages import KIND_TEXT, Column, Insert, Relation, TupleData
from protocol.transactions import Transaction
from router.apply.applier import Applier
from router.apply.quarantine import Entry, Guard, QuarantineIndex, key_text
from router.apply.state import LinkState, Liveness
from router.apply.statements import TargetTable
from router.config.model import parse_config
from router.errors import ConfigError, ConnectionLost, PgmeshError, is_refused, refused_sqlstate
from router.progress.positions import LinkProgress
from router.stream.linkqueue import LinkQueue

MINIMAL = """\
[cluster]
name = "demo"

[[nodes]]
name = "a"
dsn = "host=10.0.0.1 dbname=app"

[[nodes]]
name = "b"
dsn = "host=10.0.0.2 dbname=app"
"""


class _ServerError(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(f"server said {sqlstate}")
        self.sqlstate = sqlstate


@pytest.mark.parametrize("state", ["23514", "23503", "23502", "23P01", "23001", "22001", "22P02", "22003",
                                   "P0001", "P0004", "38000", "39P01", "2F005"])
def test_refused_states(state: str) -> None:
    assert refused_sqlstate(state) and is_refused(_ServerError(state))


@pytest.mark.parametrize("state", ["23505", "40001", "40P01", "08006", "53300", "57P01", "55P03", "42703",
                                   "42P01", "42804", "PGM01", "PGM02", "XX000", "0A000", "", None])
def test_not_refused_states(state: str | None) -> None:
    assert not refused_sqlstate(state)


def test_a_pgmesh_error_is_never_refused() -> None:
    assert not is_refused(PgmeshError("the rule for this table is error", sqlstate="23514"))


def test_on_refused_defaults_to_pause_and_a_table_overrides_it() -> None:
    config = parse_config(MINIMAL)
    assert config.on_refused("public", "t") == "pause" and not config.quarantines()
    config = parse_config(MINIMAL + '[replication]\non_refused = "quarantine"\n'
                          '[[tables]]\nname = "s.kept"\non_refused = "pause"\n')
    assert config.on_refused("public", "t") == "quarantine" and config.quarantines()
    assert config.on_refused("s", "kept") == "pause"
    config = parse_config(MINIMAL + '[[tables]]\nname = "t"\non_refused = "quarantine"\n')
    assert config.on_refused("public", "t") == "quarantine" and config.on_refused("public", "u") == "pause"
    assert config.quarantines()


def test_on_refused_takes_only_pause_or_quarantine() -> None:
    with pytest.raises(ConfigError, match=re.escape("on_refused")):
        parse_config(MINIMAL + '[replication]\non_refused = "skip"\n')


class _Conn:
    def __init__(self, rows: list[tuple[Any, ...]], meanwhile: Callable[[], None] = lambda: None) -> None:
        self.rows = rows
        self.meanwhile = meanwhile
        self.sent: list[str] = []
        self.values: list[Any] = []  # what fetchval returns, in turn (then None)

    async def fetch(self, query: str) -> list[tuple[Any, ...]]:
        self.meanwhile()  # what a link commits while the read runs
        return self.rows

    async def execute(self, query: str, *args: Any) -> None:
        self.sent.append(query)

    async def fetchval(self, query: str, *args: Any) -> Any:
        self.sent.append(query)
        return self.values.pop(0) if self.values else None


def _txn(table: str, key: int = 1) -> Transaction:
    relation = Relation(7, "public", table, "d", (Column("id", 23, -1, True),))
    change = Insert(7, TupleData(bytes([KIND_TEXT]), (str(key).encode(),)))
    return Transaction(1, 10, 20, 30, [relation, change], {7: relation})


TABLES = {
    ("public", n): TargetTable("public", n, frozenset({"id"}), {"id": "integer"}, ("id",)) for n in "tu"
}


async def test_the_index_holds_pending_keys_and_keeps_those_added_while_it_read() -> None:
    index = QuarantineIndex("b")
    assert not index.holds(_txn("t"), TABLES)  # nothing pending: the fast path
    await index.load(_Conn([("public.t", '{"id": "1"}', 2)]), required=True, now=0.0)
    assert index.counts == {"public.t": 2} and index.pending == 2
    assert index.holds(_txn("t"), TABLES) and not index.holds(_txn("u"), TABLES)
    assert not index.holds(_txn("t", key=2), TABLES)  # another key of that table: the fast path
    assert index.holds(_txn("t", key=2), {})  # a table not known here: the careful way
    assert index.knows("public.t", [key_text({"id": "1"})])
    # a link commits an entry while the next read runs (the read does not see it): kept
    conn = _Conn([], lambda: index.add("public.t", [key_text({"id": "5"})]))
    await index.load(conn, required=True, now=1.0)
    assert index.knows("public.t", [key_text({"id": "5"})])
    assert not index.knows("public.t", [key_text({"id": "1"})])  # resolved meanwhile: gone
    index.forget("public.t", [key_text({"id": "5"})])
    assert not index.holds(_txn("t"), TABLES) and index.pending == 0
    assert not index.due(100.0)  # nothing pending: never read again for that


async def test_the_cap_pauses_instead_of_a_new_entry() -> None:
    config = parse_config(MINIMAL + '[replication]\non_refused = "quarantine"\n')
    index = QuarantineIndex("b", limit=1)
    index.add("public.t", [key_text({"id": "1"})])
    txn = _txn("t", 2)
    guard = Guard(config, index, "a", txn, savepoints=True)
    table = TargetTable("public", "t", frozenset({"id"}), {"id": "integer"}, ("id",))
    conn = _Conn([])
    with pytest.raises(PgmeshError, match="the most a node holds"):
        await guard.change(conn, Entry(table, "insert", {"id": "2"}, None), _refused, lambda: None)
    assert conn.sent == ["SAVEPOINT pgmesh_quarantine", "ROLLBACK TO SAVEPOINT pgmesh_quarantine"]


async def _refused() -> None:
    raise asyncpg.exceptions.CheckViolationError("new row violates check constraint")


async def test_an_illegal_move_while_handling_an_error_ends_the_link_in_error() -> None:
    config = parse_config(MINIMAL)
    link = Applier(config, "a", config.node("b"), LinkQueue(10), LinkProgress("a", "b"))

    async def connect() -> None:  # the link is on an error (as a race could leave it) and the session drops
        link.condition.liveness = Liveness.ERROR
        raise ConnectionLost("gone")

    link._connect = connect  # type: ignore[method-assign]
    task = asyncio.create_task(link.run())
    try:
        for _ in range(100):
            if link.state is LinkState.ERROR:
                break
            await asyncio.sleep(0.01)
        assert link.state is LinkState.ERROR
        assert "internal error: link a -> b: no move from error to down" in (link.last_error or "")
        assert not task.done()  # the applier's task goes on, waiting for `pgmesh resume`
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_pending_key_is_followed_where_the_table_no_longer_quarantines() -> None:
    """on_refused went back to "pause" for the table while a key had entries: its changes still follow."""
    config = parse_config(MINIMAL)
    index = QuarantineIndex("b")
    index.add("public.t", [key_text({"id": "1"})])
    guard = Guard(config, index, "a", _txn("t"), savepoints=False)
    assert guard.watches("public", "t", "public.t") and not guard.covers("public", "t")
    table = TABLES[("public", "t")]
    conn = _Conn([])
    conn.values = [4, 5]  # the newest pending entry of the key; the new entry's id
    await guard.change(conn, Entry(table, "update", {"id": "1"}, None), _refused, lambda: None, covered=False)
    assert [w[2] for w in guard.written] == [5] and "SAVEPOINT" not in " ".join(conn.sent)


class _Missing:
    def __init__(self, error: type[Exception]) -> None:
        self.error = error

    async def fetch(self, query: str) -> list[tuple[Any, ...]]:
        raise self.error("relation \"pgmesh.quarantine\" does not exist")


@pytest.mark.parametrize("error", [asyncpg.UndefinedTableError, asyncpg.InsufficientPrivilegeError])
async def test_a_missing_or_unreadable_table_matters_where_a_table_quarantines(
    error: type[Exception],
) -> None:
    index = QuarantineIndex("b")
    await index.load(_Missing(error), required=False)  # an installation from before it, nothing configured
    assert index.pending == 0
    with pytest.raises(PgmeshError, match="pgmesh init"):
        await index.load(_Missing(error), required=True)
