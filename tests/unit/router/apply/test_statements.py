"""SQL generated for one source transaction (no server: the integration tests run it for real)."""

from __future__ import annotations

import pytest

from protocol.messages import UNCHANGED_TOAST, Column, Delete, Insert, Relation, Truncate, TupleData, Update
from protocol.transactions import Transaction
from router.apply.scripts import transaction_script
from router.apply.statements import TargetTable, quote_ident, quote_literal
from router.errors import ApplyError

REL = Relation(7, "public", "Odd ""Name", "d", (
    Column("id", 23, -1, True), Column("note", 25, -1, False), Column("doc", 114, -1, False),
))
FULL = Relation(8, "s", "log", "f", (Column("a", 23, -1, True), Column("doc", 114, -1, True)))
TABLES = {
    ("public", "Odd Name"): TargetTable("public", "Odd Name", frozenset({"id", "note", "doc", "extra"})),
    ("s", "log"): TargetTable("s", "log", frozenset({"a", "doc"})),
}


def txn(*changes: object, relations: tuple[Relation, ...] = (REL, FULL)) -> Transaction:
    return Transaction(
        xid=5, commit_lsn=0x100, end_lsn=0x1_0000_0200, commit_time=0, changes=list(changes),  # type: ignore[arg-type]
        relations={r.relid: r for r in relations},
    )


def keyed_tables() -> dict[tuple[str, str], TargetTable]:
    """REL's table as a target with column types and a primary key (the guarded, prepared paths)."""
    table = TargetTable("public", "Odd Name", frozenset({"id", "note", "doc"}),
                        {"id": "integer", "note": "text", "doc": "json"}, pk=("id",))
    return {("public", "Odd Name"): table}


def test_script_is_one_transaction_with_origin_setup_last() -> None:
    """The origin's set-up is the last statement before COMMIT: on PostgreSQL 16+ a transaction that rolls
    back after it still moves the origin's progress (the change before it failing would count as applied)."""
    script = transaction_script(txn(Insert(7, TupleData(b"tnt", (b"1", None, b'{"k": "it\'s"}')))), TABLES)
    lines = script.split(";\n")
    assert lines[0] == "BEGIN"
    assert lines[1] == (
        'INSERT INTO "public"."Odd Name" ("id", "note", "doc") OVERRIDING SYSTEM VALUE'
        ' VALUES (\'1\', NULL, \'{"k": "it\'\'s"}\')'
    )
    assert lines[2] == (
        "SELECT pg_catalog.pg_replication_origin_xact_setup('1/200', '2000-01-01 00:00:00.000000+00'),"
        " pg_catalog.set_config('pgmesh.remote', '1/200|2000-01-01 00:00:00.000000+00|', true)"
    )
    assert lines[-1] == "COMMIT;"


def test_deferred_checks_run_before_the_origin_setup() -> None:
    """A table with a deferrable constraint: `SET CONSTRAINTS ALL IMMEDIATE` before the set-up, so that no
    check fails at COMMIT, after it."""
    from router.apply.scripts import COMMIT_CHECKS

    tables = {key: TargetTable(*key, t.columns) for key, t in TABLES.items()}
    insert = Insert(7, TupleData(b"tnt", (b"1", None, b"{}")))
    assert COMMIT_CHECKS not in transaction_script(txn(insert), tables)
    tables[("public", "Odd Name")].deferrable = True
    lines = transaction_script(txn(insert), tables).split(";\n")
    assert lines[-3] == COMMIT_CHECKS and "xact_setup" in lines[-2] and lines[-1] == "COMMIT;"
    assert lines.count(COMMIT_CHECKS) == 1


def test_update_leaves_unchanged_toast_out_and_matches_old_key() -> None:
    new = TupleData(b"ttu", (b"2", b"x", UNCHANGED_TOAST))
    change = Update(7, new, TupleData(b"tnn", (b"1", None, None)), "K")
    script = transaction_script(txn(change), TABLES)
    assert (
        'UPDATE "public"."Odd Name" AS "pgmesh_t" SET "id" = \'2\', "note" = \'x\''
        ' WHERE "pgmesh_t"."id" = \'1\''
    ) in script
    assert '"doc"' not in script.split("UPDATE")[1]


def test_full_identity_touches_exactly_one_row_and_compares_json_as_text() -> None:
    change = Delete(8, TupleData(b"tt", (b"1", b"{}")), "O")
    script = transaction_script(txn(change), TABLES)
    assert (
        'DELETE FROM "s"."log" AS "pgmesh_t" WHERE "pgmesh_t".ctid = (SELECT "pgmesh_f".ctid'
        ' FROM "s"."log" AS "pgmesh_f" WHERE "pgmesh_f"."a" = \'1\' AND "pgmesh_f"."doc"::text = \'{}\''
        ' LIMIT 1)'
    ) in script


def test_truncate_flags() -> None:
    script = transaction_script(txn(Truncate((7, 8), True, True)), TABLES)
    # decided by version on the target (pgmesh.truncate_by_version), in the source's order, with its flags
    assert ("SELECT pgmesh.truncate_by_version(ARRAY['public', 's']::text[],"
            " ARRAY['Odd Name', 'log']::text[], true, true,"
            " '2000-01-01 00:00:00.000000+00'::timestamptz)") in script


def test_missing_column_or_table_names_them() -> None:
    tables = {("public", "Odd Name"): TargetTable("public", "Odd Name", frozenset({"id"}))}
    with pytest.raises(ApplyError) as info:
        transaction_script(txn(Insert(7, TupleData(b"ttt", (b"1", b"x", b"{}")))), tables)
    assert "public.Odd Name" in str(info.value) and "note, doc" in str(info.value)
    with pytest.raises(ApplyError, match="no such table"):
        transaction_script(txn(Delete(8, TupleData(b"tt", (b"1", b"{}")), "O")), tables)


def test_binary_values_are_refused() -> None:
    with pytest.raises(ApplyError, match="expected text"):
        transaction_script(txn(Insert(7, TupleData(b"bnn", (b"\x00\x00\x00\x01", None, None)))), TABLES)


def test_quoting() -> None:
    assert quote_ident('a"b') == '"a""b"'
    assert quote_literal("it's \\ fine") == "'it''s \\ fine'"


def test_runs_of_inserts_become_one_statement() -> None:
    rows = [Insert(7, TupleData(b"tnn", (str(i).encode(), None, None))) for i in range(3)]
    script = transaction_script(txn(*rows), TABLES)
    assert script.count("INSERT INTO") == 1
    assert "VALUES ('0', NULL, NULL), ('1', NULL, NULL), ('2', NULL, NULL)" in script


def test_keyed_updates_and_deletes_use_prepared_statements_once_per_shape() -> None:
    from router.apply.prepared import Prepared

    prepared = Prepared()
    up = Update(7, TupleData(b"ttu", (b"1", b"x", UNCHANGED_TOAST)))
    first = transaction_script(txn(up, Delete(7, TupleData(b"tnn", (b"1", None, None)), "K")), TABLES,
                               prepared=prepared)
    # the origin's xact_setup is prepared too, once per session
    assert "PREPARE pgmesh_1 AS SELECT pg_catalog.pg_replication_origin_xact_setup($1, $2)" in first
    assert "EXECUTE pgmesh_1('1/200', '2000-01-01 00:00:00.000000+00');\nCOMMIT;" in first  # last
    assert (
        'PREPARE pgmesh_2 AS UPDATE "public"."Odd Name" AS "pgmesh_t" SET "id" = $1, "note" = $2'
        ' WHERE "pgmesh_t"."id" = $3'
    ) in first
    assert "EXECUTE pgmesh_2('1', 'x', '1')" in first
    assert (
        'PREPARE pgmesh_3 AS DELETE FROM "public"."Odd Name" AS "pgmesh_t" WHERE "pgmesh_t"."id" = $1'
    ) in first
    second = transaction_script(txn(up), TABLES, prepared=prepared)
    assert "PREPARE" not in second and "EXECUTE pgmesh_2" in second and "EXECUTE pgmesh_1" in second
    full = transaction_script(txn(Delete(8, TupleData(b"tt", (b"1", b"{}")), "O")), TABLES, prepared=prepared)
    assert "PREPARE" not in full and "ctid" in full  # whole-row matches stay plain SQL


def test_guarded_single_inserts_are_prepared_and_big_transactions_lock_tables() -> None:
    from router.apply.prepared import Prepared
    from router.apply.statements import KEY_LOCKS_MAX

    tables = keyed_tables()
    prepared = Prepared()
    prelude: list[str] = []
    one = Insert(7, TupleData(b"ttn", (b"1", b"it's", None)))
    script = transaction_script(txn(one), tables, prepared=prepared, guard_origin=3, prelude=prelude)
    # the origin's setup; the remote version's; the insert, unless a tombstone holds the key; the locks
    assert len(prelude) == 4
    assert prelude[0] == "PREPARE pgmesh_1 AS SELECT pg_catalog.pg_replication_origin_xact_setup($1, $2)"
    assert prelude[1] == "PREPARE pgmesh_2 AS SELECT pg_catalog.set_config('pgmesh.remote', $1, true)"
    assert "EXISTS (SELECT 1 FROM pgmesh.tombstones" in prelude[2] and "$1::integer" in prelude[2]
    assert "pg_advisory_xact_lock_shared" in prelude[3] and "hashtextextended" in prelude[3]
    # the remote version first (the decision functions read it), the origin's setup last
    assert script == (
        "BEGIN;\nEXECUTE pgmesh_2('1/200|2000-01-01 00:00:00.000000+00|');\n"
        "EXECUTE pgmesh_4('1');\nEXECUTE pgmesh_3('1', 'it''s', NULL);\n"
        "EXECUTE pgmesh_1('1/200', '2000-01-01 00:00:00.000000+00');\nCOMMIT;"
    )
    again = transaction_script(txn(one), tables, prepared=prepared, guard_origin=3, prelude=prelude)
    assert len(prelude) == 4 and "EXECUTE pgmesh_4" in again  # planned once per relation
    update = Update(7, TupleData(b"ttn", (b"2", b"x", None)))
    later = transaction_script(txn(update, one), tables, prepared=prepared, guard_origin=3, prelude=prelude)
    assert later.index("EXECUTE pgmesh_5(") < later.index("EXECUTE pgmesh_4('1')")  # the update, the locks
    assert later.index("EXECUTE pgmesh_4('1')") < later.index("EXECUTE pgmesh_1(")  # the setup last
    many = [Insert(7, TupleData(b"ttn", (str(i).encode(), b"x", None))) for i in range(KEY_LOCKS_MAX + 1)]
    big = transaction_script(txn(*many), tables, prepared=prepared, guard_origin=3, prelude=prelude)
    assert "pg_advisory_xact_lock(pg_catalog.hashtext('public.Odd Name'), 0)" in big  # the table, once
    assert "hashtextextended" not in big and big.count("INSERT INTO") == 1



def test_without_the_remote_version_no_transaction_sets_pgmesh_remote() -> None:
    """A link without recent conflicts leaves `pgmesh.remote` out (router.apply.decide.Decisions.remote),
    for every kind of statement."""
    from router.apply.prepared import Prepared

    tables = keyed_tables()
    prepared = Prepared()
    prelude: list[str] = []
    one = Insert(7, TupleData(b"ttn", (b"1", b"x", None)))
    update = Update(7, TupleData(b"ttn", (b"2", b"x", None)))
    for changes in ((one,), (update, one), (Delete(7, TupleData(b"tnn", (b"2", None, None)), "K"),)):
        script = transaction_script(txn(*changes), tables, prepared=prepared, guard_origin=3, prelude=prelude,
                                    remote=False)
        assert "pgmesh.remote" not in script and "|" not in script, script
    assert not any("pgmesh.remote" in p for p in prelude), prelude
    # with it: set first, before any statement that may call a decision function
    script = transaction_script(txn(update, one), tables, prepared=prepared, guard_origin=3, prelude=prelude)
    name = prelude[-1].split()[1]
    assert prelude[-1] == f"PREPARE {name} AS SELECT pg_catalog.set_config('pgmesh.remote', $1, true)"
    assert script.startswith(f"BEGIN;\nEXECUTE {name}('1/200|2000-01-01 00:00:00.000000+00|');")

def _raw(insert: Insert) -> object:
    """The RawInsert for `insert`: its row as pgoutput's TupleData bytes (text and null cells)."""
    import struct

    from protocol.messages import RawInsert

    data = struct.pack(">h", len(insert.new.kinds))
    for kind, value in zip(insert.new.kinds, insert.new.values, strict=True):
        data += bytes([kind])
        if isinstance(value, bytes):
            data += struct.pack(">I", len(value)) + value
    return RawInsert(insert.relid, data, insert.xid)


def test_raw_inserts_read_back_from_a_spill_go_to_copy_and_insert_as_decoded_ones() -> None:
    from router.apply.scripts import COPY_MIN_ROWS, CopyRun, transaction_segments

    tables = keyed_tables()
    notes = [b"plain", b"tab\there", b"new\nline", b"back\\slash", None]
    rows = [Insert(7, TupleData(b"t" + (b"t" if notes[i % 5] is not None else b"n") + b"n",
                                (str(i).encode(), notes[i % 5], None)))
            for i in range(COPY_MIN_ROWS + 50)]
    raws = [_raw(r) for r in rows]
    decoded = transaction_segments(txn(*rows), tables, guard_origin=3)
    mixed = transaction_segments(txn(*raws[:10], *rows[10:20], *raws[20:]), tables, guard_origin=3)
    assert [type(s) for s in mixed] == [type(s) for s in decoded] == [str, CopyRun, str]
    assert isinstance(mixed[1], CopyRun) and isinstance(decoded[1], CopyRun)
    assert mixed[1].data() == decoded[1].data()
    assert b"tab\\there\t" in mixed[1].data() and b"\\N" in mixed[1].data()
    assert mixed[1].fallback() == decoded[1].fallback()  # the guarded INSERT, when tombstones exist
    # A run too short for COPY: an INSERT with the same literals.
    short = transaction_segments(txn(*raws[:KEY], relations=(REL,)), tables, guard_origin=3)
    assert short == transaction_segments(txn(*rows[:KEY], relations=(REL,)), tables, guard_origin=3)


KEY = 3


def test_a_raw_insert_that_does_not_read_back_names_its_table() -> None:
    from protocol.messages import RawInsert
    from router.apply.scripts import COPY_MIN_ROWS, CopyRun, transaction_segments

    tables = keyed_tables()
    good = [_raw(Insert(7, TupleData(b"tnn", (str(i).encode(), None, None)))) for i in range(COPY_MIN_ROWS)]
    damaged = RawInsert(7, good[0].data[:-1])  # type: ignore[attr-defined]  # one byte short
    segments = transaction_segments(txn(*good, damaged), tables, guard_origin=3)
    run = segments[1]
    assert isinstance(run, CopyRun)
    for build in (run.data, run.fallback):
        with pytest.raises(ApplyError, match="does not read back") as caught:
            build()
        assert caught.value.relation == "public.Odd Name"
    with pytest.raises(ApplyError, match="does not read back"):  # a short run: an INSERT
        transaction_segments(txn(good[0], damaged), tables, guard_origin=3)


def test_on_postgresql_15_the_origin_setup_goes_first_fused_with_a_single_inserts_locks() -> None:
    """A rollback leaves the origin alone on 15: the set-up (with `pgmesh.remote`) goes with the first
    statement, in it when that is a single guarded insert (one statement fewer than set-up last)."""
    from router.apply.prepared import Prepared

    tables = keyed_tables()
    prepared = Prepared()
    prelude: list[str] = []
    one = Insert(7, TupleData(b"ttn", (b"1", b"x", None)))
    script = transaction_script(txn(one), tables, prepared=prepared, guard_origin=3, prelude=prelude,
                                setup_last=False)
    fused = next(p for p in prelude if "pg_advisory_xact_lock_shared" in p)
    assert "pg_replication_origin_xact_setup($2, $3)" in fused and "set_config('pgmesh.remote', $4" in fused
    statements = script.split(";\n")
    assert statements[0] == "BEGIN" and statements[1].startswith(f"EXECUTE {fused.split()[1]}('1', '1/200'")
    assert len(statements) == 4 and statements[-1] == "COMMIT;"
    update = Update(7, TupleData(b"ttn", (b"2", b"x", None)))
    later = transaction_script(txn(update, one), tables, prepared=prepared, guard_origin=3, prelude=prelude,
                               setup_last=False)
    assert later.split(";\n")[1].startswith("EXECUTE pgmesh_1('1/200'")  # the set-up, then the update


def test_with_the_mark_the_setup_statement_sets_the_applied_mark_first() -> None:
    """On 16+ (`mark`) the set-up statement updates the source's `pgmesh.links.applied` to the same LSN, in
    a CTE the set-up reads from (so the UPDATE runs first), keyed by the session's `pgmesh.source`; on 15
    the statement is the set-up alone. The prepared form is a statement of its own, planned once."""
    from router.apply.prepared import Prepared

    script = transaction_script(txn(Insert(7, TupleData(b"tnt", (b"1", None, b"{}")))), TABLES, mark=True)
    setup = script.split(";\n")[-2]
    assert setup.startswith(
        "WITH pgmesh_mark AS (UPDATE \"pgmesh\".\"links\" SET applied = '1/200'"
        " WHERE source = pg_catalog.current_setting('pgmesh.source') RETURNING 1),"
    )
    assert "SELECT pg_catalog.pg_replication_origin_xact_setup('1/200'," in setup
    assert setup.endswith(" FROM pgmesh_marked")
    plain = transaction_script(txn(Insert(7, TupleData(b"tnt", (b"1", None, b"{}")))), TABLES)
    assert "pgmesh_mark" not in plain
    prepared, prelude = Prepared(), []
    marked = prepared.setup(["'1/200'", "'t'"], prelude, mark=True)
    bare = prepared.setup(["'1/200'", "'t'"], prelude)
    assert marked != bare and len(prelude) == 2
    assert "UPDATE \"pgmesh\".\"links\" SET applied = $1" in prelude[0]
    assert "pgmesh_mark" not in prelude[1]
