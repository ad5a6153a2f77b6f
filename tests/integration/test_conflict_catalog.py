"""What `pgmesh init` installs for conflict handling, on real PostgreSQL 15 nodes, and `pgmesh conflicts`.

Owns: proving that init creates `pgmesh.conflict_history`, `pgmesh.tombstones`, the tombstone trigger on
every replicated table (keyed by the primary key, the replica identity index, or every column) and the
guards `pgmesh.expect_origin` / `pgmesh.expect_rows`; that the trigger records local deletes and the
router's (under `session_replication_role = replica` and a replication origin) with the key text the
applier must reproduce; that a second init changes nothing and a later one repairs what drifted; that
init refuses delta columns a table cannot have; and that `pgmesh conflicts` reads every node's history.
Must not sleep or time anything.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from router.apply.statements import setup_statement
from router.cluster.checks import check_cluster
from router.cluster.install import init_cluster, install, uninstall
from router.config.model import Config, parse_config
from router.conflicts.catalog import TOMBSTONE_SETTINGS, tombstone_keys
from router.errors import ConfigError
from router.ops.control import cmd_conflicts
from router.testing.mesh import free_port, running_router, wait_for
from tests.fix_mesh import MeshFactory

Nodes = Callable[..., list[Any]]

SCHEMA = """
CREATE SCHEMA sales;
CREATE TABLE public.items (id int PRIMARY KEY, v text);
CREATE TABLE public.stamps (at timestamptz, n float8, label text, PRIMARY KEY (at, n));
CREATE TABLE public.ident (a int NOT NULL, b date NOT NULL, v text, UNIQUE (b, a));
ALTER TABLE public.ident REPLICA IDENTITY USING INDEX ident_b_a_key;
CREATE TABLE public.loose (x int, y text, d interval);
ALTER TABLE public.loose REPLICA IDENTITY FULL;
CREATE TABLE sales.events (id int, day date, PRIMARY KEY (id, day)) PARTITION BY RANGE (day);
CREATE TABLE sales.events_2024 PARTITION OF sales.events FOR VALUES FROM ('2024-01-01') TO ('2025-01-01');
"""
KEYS = {
    ("public", "items"): ("id",),
    ("public", "stamps"): ("at", "n"),
    ("public", "ident"): ("b", "a"),  # the replica identity index, in its column order
    ("public", "loose"): ("x", "y", "d"),  # REPLICA IDENTITY FULL without a key: every column
    ("sales", "events"): ("id", "day"),
}
HISTORY_COLUMNS = [
    ("id", "bigint", "NO"),
    ("at", "timestamp with time zone", "NO"),
    ("source", "text", "NO"),
    ("table_name", "text", "NO"),
    ("key", "text", "NO"),
    ("conflict_type", "text", "NO"),
    ("resolution", "text", "NO"),
    ("resolver", "text", "NO"),
    ("reason", "text", "YES"),
    ("local_origin", "text", "YES"),
    ("local_commit_time", "timestamp with time zone", "YES"),
    ("remote_origin", "text", "NO"),
    ("remote_commit_time", "timestamp with time zone", "NO"),
    ("remote_lsn", "pg_lsn", "YES"),
    ("local_row", "jsonb", "YES"),
    ("remote_row", "jsonb", "YES"),
]


def config_for(cluster: str, dsns: Sequence[tuple[str, str]], extra: str = "", exclude: str = "") -> Config:
    lines = [f"[cluster]\nname = {json.dumps(cluster)}\n"]
    lines += [f"[[nodes]]\nname = {json.dumps(n)}\ndsn = {json.dumps(d)}\n" for n, d in dsns]
    if exclude:
        lines.append(f"[replication]\nexclude = [{json.dumps(exclude)}]\n")
    return parse_config("\n".join(lines) + extra)


def text_of(nodes: Sequence[Any], cluster: str) -> str:
    lines = [f"[cluster]\nname = {json.dumps(cluster)}\n"]
    lines += [f"[[nodes]]\nname = {json.dumps(n.name)}\ndsn = {json.dumps(n.dsn())}\n" for n in nodes]
    return "\n".join(lines)


async def execute(dsn: str, script: str, params: Sequence[Any] | None = None) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(script, params)


async def rows(dsn: str, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(query, params)
        return list(await cur.fetchall())


async def conflict_objects(dsn: str) -> dict[str, list[tuple[Any, ...]]]:
    """pgmesh's conflict objects on a node, with oids, so a re-created object shows up as a change."""
    return {
        "tables": await rows(
            dsn,
            "SELECT c.oid, c.relname, c.relkind::text FROM pg_class c"
            " WHERE c.relnamespace = 'pgmesh'::regnamespace ORDER BY c.relname",
        ),
        "functions": await rows(
            dsn,
            "SELECT p.oid, p.oid::regprocedure::text, p.provolatile::text, p.proparallel::text, p.proconfig"
            " FROM pg_proc p WHERE p.pronamespace = 'pgmesh'::regnamespace ORDER BY 2",
        ),
        "triggers": await rows(
            dsn,
            "SELECT t.oid, t.tgrelid::regclass::text, t.tgenabled::text, t.tgparentid <> 0, t.tgargs"
            " FROM pg_trigger t WHERE t.tgname = 'pgmesh_tombstone' ORDER BY 2",
        ),
    }


async def pgmesh(*args: str) -> tuple[int | None, str, str]:
    """Run the `pgmesh` command line: (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode(), err.decode()


# ---------------------------------------------------------------------------------------------------------


async def test_init_creates_history_tombstones_guards_and_triggers_once(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, settings={}, cluster="cc", init=False)
    nodes, config = m.nodes, m.config

    report, lines = await init_cluster(config)

    assert report.ok, report.render()
    for name in ("a", "b"):
        mine = [line for line in lines if line.startswith(f"node {name}: ")]
        assert f"node {name}: created table pgmesh.conflict_history" in mine
        assert f"node {name}: created table pgmesh.tombstones" in mine
        assert (
            f"node {name}: created functions pgmesh.tombstone, pgmesh.expect_origin, pgmesh.expect_rows,"
            " pgmesh.origin_node, pgmesh.remote_wins, pgmesh.remote_version, pgmesh.decide, pgmesh.truncated,"
            " pgmesh.table_tombstone, pgmesh.truncate_by_version, pgmesh.truncate_sweep" in mine
        )
        assert f"node {name}: created tombstone trigger on public.ident (key b, a)" in mine
        assert f"node {name}: created tombstone trigger on sales.events (key id, day)" in mine
    before = {}
    for node in nodes:
        dsn = node.dsn()
        columns = await rows(
            dsn,
            "SELECT column_name::text, data_type::text, is_nullable::text FROM information_schema.columns"
            " WHERE table_schema = 'pgmesh' AND table_name = 'conflict_history' ORDER BY ordinal_position",
        )
        assert columns == HISTORY_COLUMNS
        indexes = await rows(
            dsn,
            "SELECT indexdef FROM pg_indexes WHERE schemaname = 'pgmesh'"
            " AND tablename IN ('conflict_history', 'tombstones') ORDER BY indexname",
        )
        assert [i[0].split(" USING ")[1] for i in indexes] == [
            "btree (at)",
            "btree (id)",
            "btree (table_name, key)",
        ]
        tomb = await rows(
            dsn,
            "SELECT column_name::text, udt_name::text FROM information_schema.columns"
            " WHERE table_schema = 'pgmesh' AND table_name = 'tombstones' ORDER BY ordinal_position",
        )
        assert tomb == [("table_name", "text"), ("key", "_text"), ("xid", "xid8")]
        state = before[node.name] = await conflict_objects(dsn)
        functions = {f[1]: f[2:] for f in state["functions"]}
        assert functions["pgmesh.expect_origin(xid,oid)"][:2] == ("v", "r")
        assert functions["pgmesh.expect_rows(bigint,bigint)"][:2] == ("i", "s")
        # the settings the key text is made under, as the applier must reproduce them
        wanted = {f"{name}={value}" for name, value in TOMBSTONE_SETTINGS.items()}
        assert wanted >= {"TimeZone=UTC", "DateStyle=ISO, YMD", "IntervalStyle=postgres"}
        assert "extra_float_digits=3" in wanted
        assert set(functions["pgmesh.tombstone()"][2]) >= wanted
        # one trigger per replicated table, enabled REPLICA (the stream carries each key: the router records
        # the node's own deletes); the partition has the root's clone
        assert [(t[1], t[2], t[3]) for t in state["triggers"]] == [
            ("ident", "R", False),
            ("items", "R", False),
            ("loose", "R", False),
            ("sales.events", "R", False),
            ("sales.events_2024", "R", True),
            ("stamps", "R", False),
        ]
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            assert await tombstone_keys(conn) == KEYS

    again = await install(config, await check_cluster(config))

    assert len(again) == 2 and all("already installed, nothing changed" in line for line in again), again
    assert all("tombstone triggers on 5 tables" in line for line in again), again
    for node in nodes:
        assert await conflict_objects(node.dsn()) == before[node.name]


async def test_init_repairs_triggers_and_functions_that_drifted(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, settings={}, cluster="fix")
    nodes, config = m.nodes, m.config
    a = nodes[0].dsn()
    # Drift behind pgmesh's back (its DDL event trigger, which would repair both at once, switched off
    # for the session): loose gets a primary key (its deletions are keyed by it from now on), and
    # the trigger on items is no longer REPLICA.
    behind = "SET pgmesh.ddl_inner = on; "
    for node in nodes:
        await execute(node.dsn(), behind + "ALTER TABLE loose ALTER x SET NOT NULL, ADD PRIMARY KEY (x)")
    await execute(a, behind + "ALTER TABLE items ENABLE TRIGGER pgmesh_tombstone")
    await execute(a, "COMMENT ON FUNCTION pgmesh.expect_rows(bigint, bigint) IS 'an older pgmesh'")

    _, lines = await init_cluster(config)

    assert "node a: re-created tombstone trigger on public.loose (key x, y, d -> x)" in lines
    assert "node b: re-created tombstone trigger on public.loose (key x, y, d -> x)" in lines
    assert "node a: enabled tombstone trigger REPLICA on public.items" in lines
    assert "node a: replaced functions pgmesh.expect_rows (new definition)" in lines
    assert not any(
        line.startswith("node b: enabled") or "replaced" in line for line in lines if "node b" in line
    )
    assert (
        await rows(a, "SELECT tgenabled::text FROM pg_trigger WHERE tgname = 'pgmesh_tombstone'")
        == [("R",)] * 6
    )

    excluded = config_for("fix", [(n.name, n.dsn()) for n in nodes], exclude="items")
    _, lines = await init_cluster(excluded)
    assert "node a: dropped tombstone trigger from public.items (no longer replicated)" in lines
    async with await psycopg.AsyncConnection.connect(a, autocommit=True) as conn:
        assert ("public", "items") not in await tombstone_keys(conn)

    await uninstall(excluded, "b")  # the schema goes, and with its function every trigger pgmesh made
    assert await rows(nodes[1].dsn(), "SELECT 1 FROM pg_trigger WHERE tgname = 'pgmesh_tombstone'") == []


async def test_tombstone_trigger_records_local_and_replicated_deletes(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, settings={}, cluster="tomb")
    nodes, config = m.nodes, m.config
    a = nodes[0].dsn()
    # Session settings that would change the text of these values: the trigger's own settings win.
    odd = (
        "SET TimeZone = 'America/New_York'; SET DateStyle = 'SQL, DMY'; SET IntervalStyle = 'iso_8601';"
        " SET extra_float_digits = 0"
    )
    async with await psycopg.AsyncConnection.connect(a, autocommit=True) as conn:
        await conn.execute(odd)
        await conn.execute(
            "INSERT INTO stamps VALUES ('2024-05-01 12:00:00+02', 0.1, 'x');"
            " INSERT INTO ident VALUES (7, '2024-02-03', 'v'); INSERT INTO items VALUES (1, 'one');"
            " INSERT INTO loose VALUES (1, NULL, '1 day 2 hours'), (1, NULL, '1 day 2 hours');"
            " INSERT INTO sales.events VALUES (5, '2024-06-01')"
        )
        clock = "SELECT extract(epoch FROM clock_timestamp())"  # this DateStyle does not parse
        before = (await (await conn.execute(clock)).fetchall())[0][0]
        async with conn.transaction():
            cur = await conn.execute("SELECT pg_current_xact_id()::text")
            xid = (await cur.fetchall())[0][0]
            await conn.execute(
                "DELETE FROM stamps; DELETE FROM ident; DELETE FROM items; DELETE FROM loose;"
                " DELETE FROM sales.events"
            )
        after = (await (await conn.execute(clock)).fetchall())[0][0]

    # The application's deletes wrote no tombstone (the trigger fires REPLICA): the router records them
    # from a's decoded stream, under the deleting transaction's xid, in the same text.
    query = (
        "SELECT table_name, key, xid::text, extract(epoch FROM pg_xact_commit_timestamp(xid::xid))"
        " FROM pgmesh.tombstones ORDER BY table_name, key"
    )
    assert await rows(a, query) == []
    async with running_router(config, admin=False) as router:

        async def recorded() -> bool:
            return len(await rows(a, query)) == 5

        await wait_for(recorded, "a's own deletes recorded")
        recording = router.recorders["a"].progress
        await wait_for(lambda: recording.flushed >= recording.enqueued, "the recorder's position durable")
    assert (await rows(a, "SELECT position FROM pgmesh.tombstones_recorded"))[0][0] is not None
    tombs = await rows(a, query)
    assert [(t, k) for t, k, _, _ in tombs] == [
        ("public.ident", ["2024-02-03", "7"]),
        ("public.items", ["1"]),
        ("public.loose", ["1", None, "1 day 02:00:00"]),  # duplicate rows: one tombstone
        ("public.stamps", ["2024-05-01 10:00:00+00", "0.1"]),
        ("sales.events", ["5", "2024-06-01"]),  # the partition's delete under the root's name
    ]
    assert {x for _, _, x, _ in tombs} == {xid}
    assert all(before < committed < after for _, _, _, committed in tombs)

    # The router's deletes: session_replication_role = replica, applied under the source's origin and
    # commit time. The tombstone carries that version (the key's earlier tombstone is replaced).
    origin = config.origin_name("b")
    source_time = dt.datetime(2024, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC)
    async with await psycopg.AsyncConnection.connect(a, autocommit=True) as conn:
        await conn.execute("INSERT INTO items VALUES (1, 'again'), (2, 'two')")
        await conn.execute("SET session_replication_role = replica")
        await conn.execute("SELECT pg_replication_origin_session_setup(%s)", [origin])
        await conn.execute("SET pgmesh.source = 'b'")  # the set-up sets the applied mark too, as the router's
        async with conn.transaction():
            await conn.execute("DELETE FROM items")
            await conn.execute(setup_statement("'0/1234'", "%s", None, True), [source_time])
    replicated = await rows(
        a,
        "SELECT t.key, c.timestamp, o.roname FROM pgmesh.tombstones t,"
        " pg_xact_commit_timestamp_origin(t.xid::xid) c JOIN pg_replication_origin o ON o.roident = c.roident"
        " WHERE t.table_name = 'public.items' ORDER BY t.key",
    )
    assert replicated == [(["1"], source_time, origin), (["2"], source_time, origin)]


async def test_guards_raise_pgm01_and_pgm02(mesh: MeshFactory) -> None:
    m = await mesh(
        nodes=2, schema="CREATE TABLE items (id int PRIMARY KEY, v text);", settings={}, cluster="guard"
    )
    nodes, config = m.nodes, m.config
    a = nodes[0].dsn()
    origin = config.origin_name("b")
    roident = (await rows(a, "SELECT roident FROM pg_replication_origin WHERE roname = %s", [origin]))[0][0]
    await execute(a, "INSERT INTO items VALUES (1, 'local')")
    async with await psycopg.AsyncConnection.connect(a, autocommit=True) as conn:
        await conn.execute("SELECT pg_replication_origin_session_setup(%s)", [origin])
        async with conn.transaction():
            await conn.execute("SELECT pg_replication_origin_xact_setup('0/1', now())")
            await conn.execute("INSERT INTO items VALUES (2, 'from b')")

    async with await psycopg.AsyncConnection.connect(a, autocommit=True) as conn:

        async def origin_ok(key: int, expected: int) -> Any:
            query = "SELECT pgmesh.expect_origin(xmin, %s) FROM items WHERE id = %s"
            return (await (await conn.execute(query, [expected, key])).fetchall())[0][0]

        assert await origin_ok(1, 0) is True
        assert await origin_ok(2, roident) is True
        for key, expected in ((1, roident), (2, 0)):
            with pytest.raises(psycopg.Error) as raised:
                await origin_ok(key, expected)
            assert raised.value.sqlstate == "PGM01"
            assert raised.value.diag.message_primary == "pgmesh: conflict, row last written by another origin"
        async with conn.transaction():  # a row this transaction wrote itself is no conflict
            await conn.execute("INSERT INTO items VALUES (3, 'mine')")
            assert await origin_ok(3, roident) is True
        guarded = (
            "WITH w AS (UPDATE items SET v = 'x' WHERE id = %s AND pgmesh.expect_origin(xmin, %s)"
            " RETURNING 1)"
            " SELECT pgmesh.expect_rows(count(*), 1) FROM w"
        )
        await conn.execute(guarded, [2, roident])
        with pytest.raises(psycopg.Error) as raised:
            await conn.execute(guarded, [99, roident])
        assert raised.value.sqlstate == "PGM02"
        assert raised.value.diag.message_primary == "pgmesh: conflict, 0 of 1 rows matched"
        await conn.execute("SELECT pgmesh.expect_rows(2, 2)")
        for got in ("3", "NULL"):
            with pytest.raises(psycopg.Error) as raised:
                await conn.execute(f"SELECT pgmesh.expect_rows({got}, 2)")
            assert raised.value.sqlstate == "PGM02"


async def test_init_refuses_delta_columns_a_table_cannot_have(pg_nodes: Nodes) -> None:
    nodes = pg_nodes(2, names=["a", "b"])
    for node in nodes:
        await execute(
            node.dsn(), "CREATE TABLE inv (id int PRIMARY KEY, qty int, price numeric(9, 2), name text)"
        )
    dsns = [(n.name, n.dsn()) for n in nodes]
    delta = '\n[[tables]]\nname = "public.inv"\ndelta_columns = {}\n'

    config = config_for("delta", dsns, delta.format('["qty"]'))
    report = await check_cluster(config)
    assert [(c.node, c.check, c.relation) for c in report.problems] == [
        ("a", "delta_columns", "public.inv"),
        ("b", "delta_columns", "public.inv"),
    ]
    assert "is not REPLICA IDENTITY FULL" in report.problems[0].detail
    assert 'ALTER TABLE "public"."inv" REPLICA IDENTITY FULL' in (report.problems[0].hint or "")
    with pytest.raises(ConfigError) as refused:
        await install(config, report)
    assert "node a" in str(refused.value) and "table public.inv: delta columns qty" in str(refused.value)
    for node in nodes:
        assert await rows(node.dsn(), "SELECT 1 FROM pg_namespace WHERE nspname = 'pgmesh'") == []

    for node in nodes:
        await execute(node.dsn(), "ALTER TABLE inv REPLICA IDENTITY FULL")
    report = await check_cluster(config_for("delta", dsns, delta.format('["qty", "name", "nope"]')))
    (problem, _) = report.problems
    assert (
        problem.detail
        == "delta columns qty, name, nope: column name is text, not a numeric type; has no column nope"
    )

    report, _ = await init_cluster(config_for("delta", dsns, delta.format('["qty", "price"]')))
    assert report.ok, report.render()
    assert "✓ delta_columns" in report.render()


async def test_conflicts_command_lists_every_nodes_history(mesh: MeshFactory, tmp_path: Path) -> None:
    m = await mesh(
        nodes=2, schema="CREATE TABLE items (id int PRIMARY KEY, v text);", settings={}, cluster="hist"
    )
    nodes = m.nodes
    record = (
        "INSERT INTO pgmesh.conflict_history (at, source, table_name, key, conflict_type, resolution,"
        " resolver, reason, local_origin, local_commit_time, remote_origin, remote_commit_time, remote_lsn,"
        " remote_row)"
        " VALUES (now() - %s::interval, %s, 'public.items', %s, %s, %s, 'last_update_wins', 'remote wins',"
        " %s, now() - interval '3 hours', %s, now() - %s::interval, '0/16B3748', '{\"id\": 1}')"
    )
    a, b = (n.dsn() for n in nodes)
    await execute(
        a, record, ["2 hours", "b", "1", "update_origin_differs", "apply_remote", "a", "b", "2 hours"]
    )
    await execute(a, record, ["1 minute", "b", "2", "insert_exists", "keep_local", "a", "b", "1 minute"])
    await execute(
        b, record, ["30 minutes", "a", "3", "delete_missing", "keep_local", None, "a", "30 minutes"]
    )
    down = f"host=127.0.0.1 port={free_port()} dbname=app user=postgres connect_timeout=2"
    config = config_for("hist", [("a", a), ("b", b), ("c", down)])

    out = io.StringIO()
    assert await cmd_conflicts(config, out=out) == 1  # node c could not be read
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("node c: down (")
    assert lines[1].split() == ["time", "(UTC)", "node", "source", "table", "key", "type", "resolution"]
    table = [line.split()[2:] for line in lines[2:]]
    assert table == [
        ["a", "b", "public.items", "1", "update_origin_differs", "apply_remote"],
        ["b", "a", "public.items", "3", "delete_missing", "keep_local"],
        ["a", "b", "public.items", "2", "insert_exists", "keep_local"],
    ]

    out = io.StringIO()
    await cmd_conflicts(config, since="45m", out=out)
    assert [line.split()[5] for line in out.getvalue().splitlines()[2:]] == ["3", "2"]
    out = io.StringIO()
    await cmd_conflicts(config, limit=1, out=out)
    assert [line.split()[5] for line in out.getvalue().splitlines()[2:]] == ["2"]

    out, err = io.StringIO(), io.StringIO()
    since = (dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)).isoformat()
    assert await cmd_conflicts(config, since=since, as_json=True, out=out, err=err) == 1
    assert err.getvalue().startswith("node c: down (")
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(r["node"], r["key"], r["conflict_type"]) for r in records] == [
        ("b", "3", "delete_missing"),
        ("a", "2", "insert_exists"),
    ]
    first = records[0]
    assert first["remote_row"] == {"id": 1} and first["local_row"] is None
    assert (
        first["remote_lsn"] == "0/16B3748" and first["local_origin"] is None and first["remote_origin"] == "a"
    )
    assert dt.datetime.fromisoformat(first["at"]) > dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)

    path = tmp_path / "config.toml"
    path.write_text(text_of(nodes, "hist"))
    code, stdout, _ = await pgmesh("conflicts", "--config", str(path), "--since", "1h")
    assert code == 0
    assert [line.split()[5] for line in stdout.splitlines()[1:]] == ["3", "2"]
    code, _, stderr = await pgmesh("conflicts", "--config", str(path), "--since", "yesterday")
    assert code == 2 and "--since 'yesterday'" in stderr
