"""The pipe session's statements on one target (router.apply.shapes.Statements): the plan of an encoded
transaction on PostgreSQL 15 and 16+, what is prepared when, and what a target cannot take. No server:
`Prepared(None)` has no decision functions, so the guarded statements raise at a conflict."""

from __future__ import annotations

import pytest

from protocol.frontend import bind_execute
from protocol.messages import UNCHANGED_TOAST, Column, Insert, Relation, TupleData, Update
from protocol.transactions import Transaction
from router.apply.encode import Encoded, Shape, encode
from router.apply.prepared import Prepared
from router.apply.scripts import COMMIT_CHECKS
from router.apply.shapes import DECIDED, Plan, Statements
from router.apply.statements import TargetTable
from router.errors import ApplyError, SchemaMismatch, Unpipeable
from router.progress.applied import mark_cte
from router.stream.seen import APPLIED_PREFIX, applied_content

REL = Relation(7, "public", "Odd Name", "d", (
    Column("id", 23, -1, True), Column("note", 25, -1, False), Column("doc", 114, -1, False),
))
KEY = ("public", "Odd Name")
SETUP15 = "SELECT pg_catalog.pg_replication_origin_xact_setup($1::pg_lsn, $2::timestamptz)"
REMOTE15 = f"{SETUP15}, pg_catalog.set_config('pgmesh.remote', $3, true)"
SET_REMOTE = "SELECT pg_catalog.set_config('pgmesh.remote', $1, true)"
SHAPES: dict[tuple[int, str, bytes], Shape] = {}  # shared, as a source's links share an Encoder's


def keyed_tables() -> dict[tuple[str, str], TargetTable]:
    """REL's table with column types and a primary key (as tests/unit/router/apply/test_statements.py)."""
    table = TargetTable("public", "Odd Name", frozenset({"id", "note", "doc"}),
                        {"id": "integer", "note": "text", "doc": "json"}, pk=("id",))
    return {KEY: table}


def statements(*, late: bool, tables: dict[tuple[str, str], TargetTable] | None = None) -> Statements:
    made = Statements("n1", "pgmesh_n1", late=late, mark=late)
    made.tables = keyed_tables() if tables is None else tables
    made.origin = "7"
    return made


def enc(*changes: object, commit_time: int = 0) -> Encoded:
    txn = Transaction(
        xid=5, commit_lsn=0x100, end_lsn=0x1_0000_0200, commit_time=commit_time, changes=list(changes),  # type: ignore[arg-type]
        relations={REL.relid: REL}, seen=(("n2", 5),),
    )
    result = encode(txn, SHAPES)
    assert result is not None
    return result


def insert(key: bytes) -> Insert:
    return Insert(7, TupleData(b"ttn", (key, b"a", None)))


def update(key: bytes) -> Update:
    return Update(7, TupleData(b"ttt", (key, b"b", b"{}")))


class Sqls:
    """The SQL of every name a `Statements` prepared, collected from `new` as a pipe would send it."""

    def __init__(self, made: Statements) -> None:
        self.made = made
        self.by_name: dict[bytes, str] = {}

    def plan(self, encoded: Encoded, remote: bool = False) -> list[tuple[str, object]]:
        """The plan as (SQL, parameters), after preparing what it needs (then `sent`)."""
        out: Plan = self.made.transaction(encoded, Prepared(None), remote)
        return self.named(out)

    def named(self, out: Plan) -> list[tuple[str, object]]:
        for name, sql, _ in self.made.new:
            assert name not in self.by_name  # a name is never prepared twice
            self.by_name[name] = sql
        self.made.sent()
        return [(self.by_name[name], params) for name, params in out]


def test_on_15_the_setup_comes_first() -> None:
    sqls = Sqls(statements(late=False))
    e = enc(update(b"1"))
    plan = sqls.plan(e)
    assert plan[0] == ("BEGIN", None) and plan[-1] == ("COMMIT", None)
    assert plan[1] == (SETUP15, e.setup)
    assert plan[2][0].startswith("WITH pgmesh_w AS (UPDATE") and plan[2][1] == (b"1", b"b", b"{}", b"1")
    assert len(plan) == 4
    # with the remote version: a third parameter of the set-up, nothing else
    remote = sqls.plan(e, remote=True)
    assert remote[1] == (REMOTE15, e.remote()) and len(e.remote()) == 3 and len(remote) == 4


def test_on_15_the_setup_is_fused_into_the_first_inserts_locks() -> None:
    sqls = Sqls(statements(late=False))
    e = enc(insert(b"1"), insert(b"2"))
    plan = sqls.plan(e)
    assert plan[0] == ("BEGIN", None) and plan[-1] == ("COMMIT", None) and len(plan) == 6
    fused, params = plan[1]
    assert fused.startswith(
        "SELECT pg_catalog.pg_replication_origin_xact_setup($4::pg_lsn, $5::timestamptz),"
        " pg_catalog.pg_advisory_xact_lock_shared(")
    assert params == (b"1", b"a", None, *e.setup)  # the row's, then the set-up's
    assert plan[2][0].startswith("INSERT INTO") and plan[2][1] == (b"1", b"a", None)
    lock, params = plan[3]  # the second insert's locks, alone
    assert lock.startswith("SELECT pg_catalog.pg_advisory_xact_lock_shared(") and params == (b"2", b"a", None)
    assert "xact_setup" not in lock and plan[4] == (plan[2][0], (b"2", b"a", None))
    assert "xact_setup" not in "".join(s for s, _ in plan[2:])  # once
    remote = sqls.plan(e, remote=True)
    fused, params = remote[1]
    assert fused.startswith(
        "SELECT pg_catalog.pg_replication_origin_xact_setup($4::pg_lsn, $5::timestamptz),"
        " pg_catalog.set_config('pgmesh.remote', $6, true), pg_catalog.pg_advisory_xact_lock_shared(")
    assert params == (b"1", b"a", None, *e.remote())


def test_on_15_an_insert_after_an_update_takes_its_locks_alone() -> None:
    sqls = Sqls(statements(late=False))
    e = enc(update(b"1"), insert(b"2"))
    plan = [s for s, _ in sqls.plan(e)]
    assert plan[1] == SETUP15 and plan[2].startswith("WITH pgmesh_w AS (UPDATE")
    assert plan[3].startswith("SELECT pg_catalog.pg_advisory_xact_lock_shared(")
    assert "xact_setup" not in plan[3]
    assert plan[4].startswith("INSERT INTO") and plan[5] == "COMMIT" and len(plan) == 6


def test_on_16_the_setup_with_the_applied_mark_comes_last() -> None:
    sqls = Sqls(statements(late=True))
    e = enc(insert(b"1"), update(b"1"))
    plan = sqls.plan(e)
    sql = [s for s, _ in plan]
    assert sql[0] == "BEGIN" and sql[-1] == "COMMIT" and len(plan) == 6
    assert sql[1].startswith("SELECT pg_catalog.pg_advisory_xact_lock_shared(") and "xact_setup" not in sql[1]
    assert sql[2].startswith("INSERT INTO") and sql[3].startswith("WITH pgmesh_w AS (UPDATE")
    setup, params = plan[4]
    assert setup.startswith(mark_cte("$1::pg_lsn")) and "pg_replication_origin_xact_setup" in setup
    assert "pgmesh.remote" not in setup and params == e.setup
    # with the remote version: set right after BEGIN, the set-up unchanged
    remote = sqls.plan(e, remote=True)
    assert remote[1] == (SET_REMOTE, e.remote()[2:]) and remote[-2] == (setup, e.setup)
    assert len(remote) == 7


def test_a_deferrable_table_checks_constraints_before_the_setup_on_16() -> None:
    tables = keyed_tables()
    tables[KEY].deferrable = True
    plan = [s for s, _ in Sqls(statements(late=True, tables=tables)).plan(enc(update(b"1")))]
    assert plan[-3] == COMMIT_CHECKS and plan[-2].startswith(mark_cte("$1::pg_lsn")) and plan[-1] == "COMMIT"
    plain = [s for s, _ in Sqls(statements(late=True)).plan(enc(update(b"1")))]
    assert COMMIT_CHECKS not in plain
    fifteen = [s for s, _ in Sqls(statements(late=False, tables=tables)).plan(enc(update(b"1")))]
    assert COMMIT_CHECKS not in fifteen  # the set-up comes first there


def test_statements_are_prepared_once() -> None:
    made = statements(late=False)
    made.transaction(enc(update(b"1"), insert(b"2")), Prepared(None), False)
    sqls = [sql for _, sql, _ in made.new]
    # BEGIN, the set-up, COMMIT; the update, the insert, its locks
    assert sqls[0] == "BEGIN" and SETUP15 in sqls and "COMMIT" in sqls and len(sqls) == 6
    assert len({name for name, _, _ in made.new}) == 6
    made.sent()
    again = made.transaction(enc(update(b"5"), insert(b"6")), Prepared(None), False)
    assert made.new == [] and len(again) == 6  # the same shapes: nothing more to prepare
    # a new shape (an unchanged TOAST value left out) prepares its update only
    made.transaction(enc(Update(7, TupleData(b"ttu", (b"1", b"x", UNCHANGED_TOAST)))), Prepared(None), False)
    assert len(made.new) == 1 and '"doc"' not in made.new[0][1].split("WHERE")[0]


def test_a_lost_batch_prepares_its_statements_again() -> None:
    made = statements(late=True)
    first = made.transaction(enc(update(b"1")), Prepared(None), False)
    prepared = {name: sql for name, sql, _ in made.new}
    made.sent()
    made.lost()  # the batch failed: its PREPAREs may not have run
    second = made.transaction(enc(update(b"1")), Prepared(None), False)
    again = {name: sql for name, sql, _ in made.new}
    assert sorted(again.values()) == sorted(prepared.values())
    # under the same names (shared by every link's session), each closed first: the failed batch may have
    # prepared it
    assert set(again) == set(prepared) and set(made.stale) == set(prepared)
    assert [again[n] for n, _ in second] == [prepared[n] for n, _ in first]
    # a batch that succeeded keeps its statements: the next `sent` forgets it
    made.sent()
    made.transaction(enc(insert(b"2")), Prepared(None), False)
    made.sent()
    made.lost()  # only the insert's two statements were the failed batch's
    made.transaction(enc(update(b"3"), insert(b"4")), Prepared(None), False)
    assert sorted(sql.split(" ")[0] for _, sql, _ in made.new) == ["INSERT", "SELECT"]


def test_a_lost_batch_prepares_the_fused_setup_again() -> None:
    """On 15: an insert's statements prepared by a batch that succeeded, its locks fused with the set-up
    first prepared by one that failed: the fused statement must be prepared again."""
    made = statements(late=False)
    made.transaction(enc(update(b"1"), insert(b"2")), Prepared(None), False)  # the locks alone
    made.sent()
    made.transaction(enc(insert(b"3")), Prepared(None), False)  # the fused locks: new
    (gone, sql, _), = made.new
    assert "xact_setup" in sql
    made.sent()
    made.lost()
    plan = made.transaction(enc(insert(b"3")), Prepared(None), False)
    assert plan[1][0] == gone and made.stale == [gone]  # closed, then prepared again
    assert [name for name, _, _ in made.new] == [plan[1][0]]


def test_reset_renames_everything() -> None:
    made = statements(late=False)
    first = made.transaction(enc(insert(b"1")), Prepared(None), False)
    made.sent()
    made.reset()
    second = made.transaction(enc(insert(b"1")), Prepared(None), False)
    # BEGIN, the insert, its locks, them fused with the set-up, COMMIT (the set-up alone is not needed)
    assert len(made.new) == 5 and len(second) == len(first) == 4
    # the same names (every link's session names a statement alike), each closed before it is prepared
    assert {n for n, _ in first} == {n for n, _ in second} <= set(made.stale)
    assert {n for n, _ in second} <= {n for n, _, _ in made.new}


def test_a_skipped_table_leaves_its_statements_out() -> None:
    tables = keyed_tables()
    tables[KEY].skip = True
    made = statements(late=False, tables=tables)
    e = enc(update(b"1"), insert(b"2"))
    plan = made.transaction(e, Prepared(None), False)
    sqls = {name: sql for name, sql, _ in made.new}
    assert [sqls[n] for n, _ in plan] == ["BEGIN", SETUP15, "COMMIT"] and plan[1][1] == e.setup
    late = statements(late=True, tables=tables)
    plan = late.transaction(e, Prepared(None), False)
    sqls = {name: sql for name, sql, _ in late.new}
    assert [sqls[n] for n, _ in plan][::2] == ["BEGIN", "COMMIT"] and len(plan) == 3


def test_an_insert_the_target_cannot_key_is_unpipeable() -> None:
    untyped = {KEY: TargetTable("public", "Odd Name", frozenset({"id", "note", "doc"}), pk=("id",))}
    with pytest.raises(Unpipeable):
        statements(late=True, tables=untyped).transaction(enc(insert(b"1")), Prepared(None), False)
    partly = {KEY: TargetTable("public", "Odd Name", frozenset({"id", "note", "doc"}), {"note": "text"},
                               pk=("id",))}
    with pytest.raises(Unpipeable):
        statements(late=False, tables=partly).transaction(enc(insert(b"1")), Prepared(None), False)


def test_a_missing_table_is_a_schema_mismatch() -> None:
    with pytest.raises(SchemaMismatch):
        statements(late=True, tables={}).transaction(enc(update(b"1")), Prepared(None), False)


def test_an_update_moving_a_generated_always_column_raises() -> None:
    """Checked by value on the change (router.apply.statements.check_always). encode takes no update with
    an old row, so the change here is put in by hand."""
    tables = keyed_tables()
    tables[KEY].always = frozenset({"note"})
    made = statements(late=True, tables=tables)
    e = enc(update(b"1"))
    plain = made.transaction(e, Prepared(None), False)  # no old row: nothing to compare
    assert len(plain) == 4
    shape, params, _ = e.statements[0]
    moved = Update(7, TupleData(b"ttt", (b"1", b"b", b"{}")), TupleData(b"ttt", (b"1", b"a", b"{}")), "O")
    by_hand = Encoded(((shape, params, moved),), e.setup, e.txn)
    with pytest.raises(ApplyError, match="GENERATED ALWAYS") as raised:
        made.transaction(by_hand, Prepared(None), False)
    assert not isinstance(raised.value, (Unpipeable, SchemaMismatch))
    same = Update(7, TupleData(b"ttt", (b"1", b"a", b"{}")), TupleData(b"ttt", (b"1", b"a", b"[]")), "O")
    kept = Encoded(((shape, params, same),), e.setup, e.txn)
    assert len(made.transaction(kept, Prepared(None), False)) == 4


def test_ending_announces_the_batch_then_counts_decisions() -> None:
    made = statements(late=True)
    batch = [enc(update(b"1"), commit_time=10).txn, enc(update(b"2"), commit_time=30).txn]
    out = made.ending(batch, True, "n1")
    sqls = {name: sql for name, sql, _ in made.new}
    note, params = out[0]
    assert "pg_logical_emit_message(false, " in sqls[note] and f"'{APPLIED_PREFIX}'" in sqls[note]
    assert "pg_replication_origin_session_setup('pgmesh_n1')" in sqls[note]
    assert params == (applied_content("n1", 30).encode(),)
    assert out[1:] == [(out[1][0], None)] and sqls[out[1][0]] == DECIDED
    made.sent()
    quiet = made.ending(batch, False, "n1")
    assert quiet == [(out[1][0], None)] and made.new == []
    assert made.ending([], True, "n1") == quiet


def test_the_origin_id_is_a_literal_in_the_statements_text() -> None:
    """Where the script path's prepared update reads the origin from a parameter ($5 here: after three set
    columns and the key), the pipe writes the session's origin id into the SQL."""
    made = statements(late=True)
    made.transaction(enc(update(b"1")), Prepared(None), False)
    sql = next(sql for _, sql, _ in made.new if sql.startswith("WITH pgmesh_w AS (UPDATE"))
    assert "roident = 7 THEN" in sql and "pgmesh.expect_origin(" in sql and ", 7)" in sql
    assert "$5" not in sql and "$4" in sql


def test_names_are_the_same_in_every_session_and_bound_once() -> None:
    """Two links' sessions of one source name a shape's statements alike, so a change's Bind + Execute
    bytes are built by the first and reused by the second (`Encoded.bound`); the origin literal in the
    SQL differs, the names do not."""
    one, two = statements(late=False), statements(late=False)
    two.origin = "9"
    e = enc(update(b"1"), insert(b"2"))
    first, second = one.wire(e, Prepared(None), False), two.wire(e, Prepared(None), False)
    assert first == second
    assert [n for n, _, _ in one.new] == [n for n, _, _ in two.new]
    assert [s for _, s, _ in one.new] != [s for _, s, _ in two.new]  # (the origin id)
    plan = one.transaction(e, Prepared(None), False)
    with_params = [i for i, (_, params) in enumerate(plan) if params is not None]
    assert with_params and all(first[i] is second[i] for i in with_params)  # built once
    assert first == [bind_execute(name, params) for name, params in plan]
    assert len(e.bound) == sum(params is not None for _, params in plan)
    sixteen = statements(late=True)  # another plan: the cached pieces are only those it names
    assert sixteen.wire(e, Prepared(None), True) == [
        bind_execute(name, params) for name, params in sixteen.transaction(e, Prepared(None), True)]


def test_reset_leaves_the_old_statements_to_close() -> None:
    """What a reset renames is closed by the next batch (`stale`), but never a name not yet prepared."""
    made = statements(late=False)
    made.transaction(enc(insert(b"1")), Prepared(None), False)
    made.sent()
    sent = set(made.fresh)
    made.fresh = []
    made.transaction(enc(update(b"2")), Prepared(None), False)  # its PREPARE not sent yet
    unsent = {name for name, _, _ in made.new}
    made.reset()
    assert set(made.stale) == sent and not set(made.stale) & unsent
