"""The initial copy (`router.cluster.copy.initial.copy_snapshot`) between two real PostgreSQL nodes, on
local Spark.

The donor holds a 200k-row table of mixed types (text, numeric, timestamptz, jsonb, bytea, an array,
NULLs), a partitioned table with two partitions and an empty table. A connection exports a snapshot and
stays open; then the donor changes (inserts, updates, deletes): none of that may reach the target. The
target gets the pre-data schema from `pg_dump --snapshot`, the copy, then the post-data schema; its rows
must be exactly the snapshot's (count and md5 of the ordered rows, the donor's read under the snapshot).
One Spark session is shared by the whole module (`reuse_spark`).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from router.cluster.copy.initial import (
    CopyProgress,
    CopyReport,
    CopyTable,
    copy_snapshot,
    read_leaves,
    reuse_spark,
)
from router.cluster.copy.plan import BlockRange, CopyTask
from router.cluster.copy.worker import SNAPSHOT_HINT, CopyJob, TaskFailure, run_task
from router.errors import PgmeshError
from router.testing.localnodes import find_pg_bindir

pytestmark = pytest.mark.slow  # Spark (a JVM) for the module

MASTER = "local[2]"
PASSWORD = "s3cret-pw"
MIXED_ROWS = 200_000

SCHEMA = """
CREATE SCHEMA app;
CREATE TABLE app.mixed (
    id bigint PRIMARY KEY,
    label text,
    amount numeric(14, 4),
    at timestamptz NOT NULL,
    doc jsonb,
    raw bytea,
    tags int[],
    ratio float8,
    flag boolean,
    note varchar(40) DEFAULT 'none'
);
CREATE TABLE app.events (
    id bigint NOT NULL,
    day date NOT NULL,
    payload text,
    PRIMARY KEY (id, day)
) PARTITION BY RANGE (day);
CREATE TABLE app.events_2024 PARTITION OF app.events FOR VALUES FROM ('2024-01-01') TO ('2025-01-01');
CREATE TABLE app.events_2025 PARTITION OF app.events FOR VALUES FROM ('2025-01-01') TO ('2026-01-01');
CREATE TABLE app.empty (id int PRIMARY KEY, v text);
CREATE TABLE app.child (id int PRIMARY KEY, mixed_id bigint REFERENCES app.mixed (id));
"""
FILL = f"""
INSERT INTO app.mixed (id, label, amount, at, doc, raw, tags, ratio, flag, note)
SELECT g,
       CASE WHEN g % 10 = 0 THEN NULL ELSE repeat(md5(g::text), 1 + g % 3) || ' é ✓' END,
       CASE WHEN g % 13 = 0 THEN NULL ELSE (g * 1.2345)::numeric(14, 4) END,
       timestamptz '2024-01-01 00:00:00+00' + g * interval '1 minute 7 seconds',
       CASE WHEN g % 17 = 0 THEN NULL
            ELSE jsonb_build_object('g', g, 'odd', g % 2 = 1, 'list', jsonb_build_array(g, 'x')) END,
       CASE WHEN g % 19 = 0 THEN NULL ELSE decode(md5(g::text), 'hex') END,
       CASE WHEN g % 23 = 0 THEN NULL ELSE ARRAY[g, g % 7, -g] END,
       CASE WHEN g % 29 = 0 THEN 'NaN'::float8 ELSE g / 7.0 END,
       CASE WHEN g % 31 = 0 THEN NULL ELSE g % 2 = 0 END,
       CASE WHEN g % 37 = 0 THEN NULL ELSE 'n' || g END
FROM generate_series(1, {MIXED_ROWS}) g;
INSERT INTO app.events SELECT g, date '2024-06-01' + (g % 400), 'event ' || g
FROM generate_series(1, 20000) g;
INSERT INTO app.child SELECT g, g FROM generate_series(1, 1000) g;
"""
# After the snapshot: none of this may be copied.
CHANGES = """
INSERT INTO app.mixed (id, label, at) SELECT g, 'late', now() FROM generate_series(1000001, 1005000) g;
UPDATE app.mixed SET label = 'changed', amount = -1 WHERE id % 7 = 0;
DELETE FROM app.mixed WHERE id % 11 = 0 AND id > 1000;
INSERT INTO app.events SELECT g, date '2025-03-01', 'late' FROM generate_series(100001, 101000) g;
DELETE FROM app.events WHERE id % 5 = 0;
INSERT INTO app.empty VALUES (1, 'late');
"""
TABLES = ["app.mixed", "app.events", "app.empty", "app.child"]
FINGERPRINT = "SELECT count(*), md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) FROM {} t"


@pytest.fixture(scope="module")
def spark() -> Iterator[None]:
    """One Spark session (and JVM) for every test of this module."""
    with reuse_spark():
        yield


def run_tool(argv: Sequence[str], *, stdin: bytes | None = None) -> bytes:
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}
    done = subprocess.run(list(argv), input=stdin, capture_output=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    return done.stdout


def schema_section(donor_dsn: str, target_dsn: str, snapshot: str, section: str) -> None:
    """`pg_dump --schema-only --section=SECTION --snapshot=SNAPSHOT donor | psql target`."""
    bindir = find_pg_bindir()
    dump = run_tool([str(bindir / "pg_dump"), "--schema-only", f"--section={section}",
                     f"--snapshot={snapshot}", "--no-publications", "--no-subscriptions", "-d", donor_dsn])
    run_tool([str(bindir / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", target_dsn], stdin=dump)


def fingerprints(conn: psycopg.Connection[Any], tables: Sequence[str]) -> dict[str, tuple[int, str]]:
    out = {}
    for table in tables:
        row = conn.execute(FINGERPRINT.format(table)).fetchone()
        assert row is not None
        out[table] = (int(row[0]), str(row[1]))
    return out


def copy_tables(conn: psycopg.Connection[Any]) -> list[CopyTable]:
    tables = []
    for name in TABLES:
        schema, table = name.split(".")
        row = conn.execute(
            "SELECT array_agg(attname::text ORDER BY attnum) FROM pg_attribute"
            " WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped",
            [name],
        ).fetchone()
        assert row is not None
        tables.append(CopyTable(schema, table, tuple(row[0])))
    return tables


class Exported:
    """A donor connection holding an exported snapshot open, and what that snapshot shows."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn)
        self.conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        row = self.conn.execute("SELECT pg_export_snapshot()").fetchone()
        assert row is not None
        self.name = str(row[0])

    def close(self) -> None:
        self.conn.close()


def prepared_pair(pg_nodes: Any) -> tuple[Any, Any, Exported, list[CopyTable]]:
    donor, target = pg_nodes(2, names=["donor", "target"], password=PASSWORD)
    with psycopg.connect(donor.dsn(), autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute(FILL)
        conn.execute("ALTER TABLE app.mixed DROP COLUMN note")  # a dropped column in the heap
        conn.execute("VACUUM ANALYZE")
        tables = copy_tables(conn)
    exported = Exported(donor.dsn())
    with psycopg.connect(donor.dsn(), autocommit=True) as conn:
        conn.execute(CHANGES)
    schema_section(donor.dsn(), target.dsn(), exported.name, "pre-data")
    return donor, target, exported, tables


def check_copied(donor: Any, target: Any, exported: Exported, report: CopyReport) -> None:
    expected = fingerprints(exported.conn, TABLES)
    with psycopg.connect(target.dsn(), autocommit=True) as conn:
        got = fingerprints(conn, TABLES)
    assert got == expected
    assert expected["app.mixed"][0] == MIXED_ROWS
    assert expected["app.empty"][0] == 0
    with psycopg.connect(donor.dsn(), autocommit=True) as conn:
        now = fingerprints(conn, TABLES)
    assert now["app.mixed"] != expected["app.mixed"]  # the donor did change after the snapshot
    assert {f"{t.schema}.{t.name}": t.rows for t in report.tables} == {k: v[0] for k, v in expected.items()}
    assert report.rows == sum(v[0] for v in expected.values())


def test_copy_snapshot_copies_exactly_the_snapshot(pg_nodes: Any, spark: None) -> None:
    donor, target, exported, tables = prepared_pair(pg_nodes)
    seen: list[CopyProgress] = []
    try:
        report = copy_snapshot(donor.dsn(), target.dsn(), exported.name, tables, spark_master=MASTER,
                               partitions_per_table=4, progress=seen.append)
        schema_section(donor.dsn(), target.dsn(), exported.name, "post-data")
        check_copied(donor, target, exported, report)
    finally:
        exported.close()
    by_name = {t.name: t for t in report.tables}
    assert by_name["mixed"].tasks == 4
    assert by_name["events"].tasks == 8  # 4 per leaf partition
    assert by_name["empty"].tasks == 1  # no block to split
    assert report.tasks == sum(t.tasks for t in report.tables)
    assert report.retries == 0
    assert by_name["mixed"].bytes > 10_000_000 and report.bytes == sum(t.bytes for t in report.tables)
    final = seen[-1]
    assert final.final and sum(1 for p in seen if p.final) == 1
    assert (final.tables_done, final.tables_total) == (4, 4)
    assert (final.tasks_done, final.tasks_total) == (report.tasks, report.tasks)
    assert (final.rows, final.bytes) == (report.rows, report.bytes)
    with psycopg.connect(target.dsn(), autocommit=True) as conn:  # post-data built the keys and the FK
        keys = conn.execute("SELECT count(*) FROM pg_constraint WHERE contype IN ('p', 'f')"
                            " AND connamespace = 'app'::regnamespace").fetchone()
    assert keys is not None and keys[0] >= 5


def test_failed_task_is_retried_without_duplicates(pg_nodes: Any, spark: None, tmp_path: Path) -> None:
    donor, target, exported, tables = prepared_pair(pg_nodes)
    marker = tmp_path / "failed-once"
    try:
        report = copy_snapshot(donor.dsn(), target.dsn(), exported.name, tables, spark_master=MASTER,
                               partitions_per_table=3, _fail_once_marker=str(marker))
        assert marker.exists()  # one attempt did fail, after its COPY into the target
        assert report.retries == 1
        check_copied(donor, target, exported, report)
        # The primary keys go on only now: they would fail on a duplicated row.
        schema_section(donor.dsn(), target.dsn(), exported.name, "post-data")
    finally:
        exported.close()


def test_errors_name_the_role_table_and_sqlstate_but_no_dsn(pg_nodes: Any, spark: None) -> None:
    donor, target = pg_nodes(2, names=["donor", "target"], password=PASSWORD)
    with psycopg.connect(donor.dsn(), autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO t SELECT g, 'x' FROM generate_series(1, 10) g")
    table = [CopyTable("public", "t", ("id", "v"))]
    exported = Exported(donor.dsn())
    try:
        # The target has no such table: every attempt fails there, then the job.
        with pytest.raises(PgmeshError) as info:
            copy_snapshot(donor.dsn(), target.dsn(), exported.name, table, spark_master=MASTER)
        error = info.value
        assert (error.node, error.relation, error.sqlstate) == ("target", "public.t", "42P01")
        assert PASSWORD not in str(error) and "password" not in str(error)

        # A table missing on the donor fails while planning, before any task.
        with pytest.raises(PgmeshError) as info:
            copy_snapshot(donor.dsn(), target.dsn(), exported.name, [CopyTable("public", "nope", ("id",))],
                          spark_master=MASTER)
        assert (info.value.node, info.value.relation) == ("donor", "public.nope")

        # Listing a table twice would copy its rows twice.
        with pytest.raises(PgmeshError, match="twice"):
            copy_snapshot(donor.dsn(), target.dsn(), exported.name, table * 2, spark_master=MASTER)
    finally:
        exported.close()

    # Once the exporting transaction has ended the snapshot cannot be imported: say what to do.
    with pytest.raises(PgmeshError) as info:
        copy_snapshot(donor.dsn(), target.dsn(), exported.name, table, spark_master=MASTER)
    with psycopg.connect(donor.dsn()) as conn:
        version = conn.info.server_version
    # (PostgreSQL 18 says 42704, undefined object; older ones 22023, invalid parameter value)
    assert info.value.node == "donor" and info.value.sqlstate == ("42704" if version >= 180000 else "22023")
    assert "keep the connection that exported it" in str(info.value)
    assert PASSWORD not in str(info.value)
    # A task whose snapshot went after the planning (a task imports it itself) says the same.
    job = CopyJob(donor.dsn(), target.dsn(), exported.name, "pgmesh-test", 1)
    task = CopyTask(0, "public", "t", ("id", "v"), BlockRange(0, None), 1)
    with pytest.raises(TaskFailure) as failed:
        run_task(job, task)
    assert failed.value.record["sqlstate"] == info.value.sqlstate
    assert failed.value.record["role"] == "donor" and failed.value.record["hint"] == SNAPSHOT_HINT


# Tables that binary COPY cannot carry (issue 17): a type without send/receive functions (aclitem, a
# user's base type made without them), directly, inside a composite, a domain and an array; empty
# int2vector / oidvector values, which their receive functions refuse. They copy as text; the rest stays
# binary. The donor's sessions write dates, intervals and floats in styles the target would misread
# (or round), so the text copy must fix its own.
TEXT_SCHEMA = """
CREATE SCHEMA app;
CREATE TYPE app.myvarchar;
CREATE FUNCTION app.myvarcharin(cstring, oid, integer) RETURNS app.myvarchar
  LANGUAGE internal IMMUTABLE PARALLEL SAFE STRICT AS 'varcharin';
CREATE FUNCTION app.myvarcharout(app.myvarchar) RETURNS cstring
  LANGUAGE internal IMMUTABLE PARALLEL SAFE STRICT AS 'varcharout';
CREATE TYPE app.myvarchar (input = app.myvarcharin, output = app.myvarcharout);
CREATE TYPE app.holder AS (n int, acl aclitem);
CREATE DOMAIN app.dholder AS app.holder;
CREATE TABLE app.plain (id int PRIMARY KEY, at timestamptz, d date, iv interval, f float8, tags int[]);
CREATE TABLE app.acl (id int PRIMARY KEY, a aclitem, at timestamptz, d date, iv interval, f float8);
CREATE TABLE app.vec (id int PRIMARY KEY, v int2vector, o oidvector);
CREATE TABLE app.nested (id int PRIMARY KEY, h app.dholder[]);
CREATE TABLE app.mine (id int NOT NULL, m app.myvarchar) PARTITION BY RANGE (id);
CREATE TABLE app.mine_1 PARTITION OF app.mine FOR VALUES FROM (0) TO (500);
CREATE TABLE app.mine_2 PARTITION OF app.mine FOR VALUES FROM (500) TO (MAXVALUE);
"""
TEXT_FILL = """
INSERT INTO app.plain SELECT g, timestamptz '2024-01-13 10:00:00+00' + g * interval '1 hour',
    date '2024-01-13' + g, g * interval '1 day -3 hours 7.5 seconds', g / 7.0, ARRAY[g, -g]
FROM generate_series(1, 1000) g;
INSERT INTO app.acl SELECT g, (acldefault('r', (SELECT oid FROM pg_roles WHERE rolname = current_user)))[1],
    timestamptz '2024-01-13 10:00:00+00' + g * interval '1 hour', date '2024-01-13' + g,
    g * interval '1 day -3 hours 7.5 seconds', g / 7.0
FROM generate_series(1, 1000) g;
INSERT INTO app.vec VALUES (1, '', ''), (2, '1 2 3', '23 25'), (3, NULL, NULL);
INSERT INTO app.nested SELECT g, ARRAY[ROW(g, (acldefault('f', (SELECT oid FROM pg_roles
    WHERE rolname = current_user)))[1])::app.dholder, NULL] FROM generate_series(1, 100) g;
INSERT INTO app.mine SELECT g, ('v' || g || ' é')::text::app.myvarchar FROM generate_series(1, 1000) g;
"""
TEXT_TABLES = ["app.plain", "app.acl", "app.vec", "app.nested", "app.mine"]
SAME_STYLE = "SET datestyle = ISO; SET intervalstyle = postgres; SET extra_float_digits = 3"


def test_types_binary_copy_cannot_carry_copy_as_text(pg_nodes: Any, spark: None) -> None:
    donor, target = pg_nodes(2, names=["donor", "target"], password=PASSWORD)
    with psycopg.connect(donor.dsn(), autocommit=True) as conn:
        conn.execute(TEXT_SCHEMA)
        conn.execute(TEXT_FILL)
        for setting, value in (("datestyle", "SQL, DMY"), ("intervalstyle", "sql_standard"),
                               ("extra_float_digits", "-5")):
            conn.execute(psycopg.sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                psycopg.sql.Identifier(conn.info.dbname), psycopg.sql.Identifier(setting),
                psycopg.sql.Literal(value)))
        tables = []
        for name in TEXT_TABLES:
            row = conn.execute("SELECT array_agg(attname::text ORDER BY attnum) FROM pg_attribute"
                               " WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped",
                               [name]).fetchone()
            assert row is not None
            tables.append(CopyTable(*name.split("."), tuple(row[0])))
    exported = Exported(donor.dsn())
    try:
        schema_section(donor.dsn(), target.dsn(), exported.name, "pre-data")
        leaves = read_leaves(donor.dsn(), exported.name, tables)
        formats = {f"{leaf.schema}.{leaf.name}": leaf.binary for leaf in leaves}
        assert formats == {"app.plain": True, "app.acl": False, "app.vec": False, "app.nested": False,
                           "app.mine_1": False, "app.mine_2": False}
        report = copy_snapshot(donor.dsn(), target.dsn(), exported.name, tables, spark_master=MASTER,
                               partitions_per_table=2)
        exported.conn.execute(SAME_STYLE)
        expected = fingerprints(exported.conn, TEXT_TABLES)
    finally:
        exported.close()
    with psycopg.connect(target.dsn(), autocommit=True) as conn:
        conn.execute(SAME_STYLE)
        assert fingerprints(conn, TEXT_TABLES) == expected
    assert {f"{t.schema}.{t.name}": t.rows for t in report.tables} == {k: v[0] for k, v in expected.items()}
    assert expected["app.vec"][0] == 3 and expected["app.mine"][0] == 1000


def test_a_latin1_donor_copies_into_a_utf8_node(pg_nodes: Any, spark: None) -> None:
    """The copy's sessions talk UTF8 to both ends: a LATIN1 donor's text reaches a UTF8 node as the same
    characters, by binary COPY and by text COPY (a table with an aclitem column)."""
    donor_node, target = pg_nodes(2, names=["donor", "target"], password=PASSWORD)
    with psycopg.connect(donor_node.dsn(), autocommit=True) as conn:
        conn.execute("CREATE DATABASE latin ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
    dsn = donor_node.dsn(dbname="latin")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app;"
                     " CREATE TABLE app.b (id int PRIMARY KEY, v text);"
                     " CREATE TABLE app.t (id int PRIMARY KEY, v text, acl aclitem);"
                     " INSERT INTO app.b VALUES (1, 'Motörhead'), (2, 'Ærøskøbing');"
                     " INSERT INTO app.t VALUES (1, 'Motörhead', 'postgres=r/postgres');")
    tables = [CopyTable("app", "b", ("id", "v")), CopyTable("app", "t", ("id", "v", "acl"))]
    exported = Exported(dsn)
    try:
        schema_section(dsn, target.dsn(), exported.name, "pre-data")
        leaves = read_leaves(dsn, exported.name, tables)
        assert {leaf.name: leaf.binary for leaf in leaves} == {"b": True, "t": False}
        copy_snapshot(dsn, target.dsn(), exported.name, tables, spark_master=MASTER, partitions_per_table=1)
    finally:
        exported.close()
    with psycopg.connect(target.dsn(), autocommit=True) as conn:
        assert conn.execute("SELECT id, v FROM app.b ORDER BY id").fetchall() == [
            (1, "Motörhead"), (2, "Ærøskøbing")]
        assert conn.execute("SELECT id, v FROM app.t").fetchall() == [(1, "Motörhead")]
