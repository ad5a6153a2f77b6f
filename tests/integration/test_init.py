"""`pgmesh init` on real PostgreSQL 15 nodes: the checks, the install, its idempotence, and refusals.

Owns: proving that `router.cluster.install` installs exactly what it says (schema, links, publication, slot,
origins) on every node, that a second install changes nothing, and that every bad input (a missing or
different table, a table without a key, a wrong setting, a wrong password, a node that is down) is
refused with a report naming the node and the table, never the password. Must not sleep or time anything.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import psycopg
import pytest

from router.cluster.checks import Check, InitReport, check_cluster
from router.cluster.install import init_cluster, install, uninstall
from router.config.model import Config, parse_config
from router.errors import ConfigError, PgmeshError, SlotError
from router.testing.mesh import free_port

Nodes = Callable[..., list[Any]]

GOOD_SCHEMA = """
CREATE SCHEMA sales;
CREATE TABLE public.orders (id bigint PRIMARY KEY, customer text NOT NULL, total numeric(12, 2));
CREATE TABLE public.notes (body text, at timestamptz);
ALTER TABLE public.notes REPLICA IDENTITY FULL;
CREATE TABLE public.scratch (x int);
CREATE TABLE sales.events (id int, day date, PRIMARY KEY (id, day)) PARTITION BY RANGE (day);
CREATE TABLE sales.events_2024 PARTITION OF sales.events FOR VALUES FROM ('2024-01-01') TO ('2025-01-01');
ALTER TABLE public.orders DROP COLUMN customer;
ALTER TABLE public.orders ADD COLUMN customer text;
"""
# b creates orders' columns in another order and without the dropped column: still the same table.
GOOD_SCHEMA_B = GOOD_SCHEMA.replace(
    "CREATE TABLE public.orders (id bigint PRIMARY KEY, customer text NOT NULL, total numeric(12, 2));",
    "CREATE TABLE public.orders (customer text, total numeric(12, 2), id bigint PRIMARY KEY);",
).replace(
    "ALTER TABLE public.orders DROP COLUMN customer;\nALTER TABLE public.orders ADD COLUMN customer text;", ""
)
GOOD_TABLES = [("public", "notes"), ("public", "orders"), ("sales", "events")]


def config_for(
    cluster: str,
    dsns: Sequence[tuple[str, str]],
    tables: Sequence[str] = ("*.*",),
    exclude: Sequence[str] = (),
    keyless: str = "full",
) -> Config:
    """A config.toml text for these nodes, parsed the way `pgmesh` parses the file (`keyless`:
    `new_table_without_key`)."""
    lines = [f"[cluster]\nname = {json.dumps(cluster)}\n"]
    for name, dsn in dsns:
        lines.append(f"[[nodes]]\nname = {json.dumps(name)}\ndsn = {json.dumps(dsn)}\n")
    lines.append(
        f"[replication]\ntables = {json.dumps(list(tables))}\nexclude = {json.dumps(list(exclude))}\n"
        f"new_table_without_key = {json.dumps(keyless)}\n"
    )
    return parse_config("\n".join(lines))


async def execute(dsn: str, script: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(script)


async def rows(dsn: str, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(query, params)
        return list(await cur.fetchall())


async def catalog_state(dsn: str, config: Config) -> dict[str, list[tuple[Any, ...]]]:
    """Everything pgmesh installs on a node, with oids, so a re-created object shows up as a change."""
    name = config.slot_name
    links_table = await rows(dsn, "SELECT oid FROM pg_class WHERE oid = to_regclass('pgmesh.links')")
    links_sql = "SELECT source, paused, reason, updated FROM pgmesh.links ORDER BY source"
    return {
        "schema": await rows(dsn, "SELECT oid, nspname FROM pg_namespace WHERE nspname = 'pgmesh'"),
        "links_table": links_table,
        "links": await rows(dsn, links_sql) if links_table else [],
        "publication": await rows(
            dsn, "SELECT oid, pubviaroot, puballtables FROM pg_publication WHERE pubname = %s", [name]
        ),
        "published": await rows(
            dsn,
            "SELECT n.nspname, c.relname FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid"
            " JOIN pg_class c ON c.oid = r.prrelid JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE p.pubname = %s ORDER BY 1, 2",
            [name],
        ),
        "slots": await rows(
            dsn,
            "SELECT slot_name, plugin, slot_type, database, confirmed_flush_lsn::text"
            " FROM pg_replication_slots ORDER BY 1",
        ),
        "origins": await rows(dsn, "SELECT roident, roname FROM pg_replication_origin ORDER BY roname"),
    }


def problems_of(report: InitReport) -> list[tuple[str, str, str | None]]:
    return [(c.node, c.check, c.relation) for c in report.problems]


START_GROW = (
    b"START_REPLICATION SLOT pgmesh_grow LOGICAL 0/0 (proto_version '1', publication_names 'pgmesh_grow')"
)


async def slot_active(dsn: str, slot: str) -> bool:
    return await rows(dsn, "SELECT active FROM pg_replication_slots WHERE slot_name = %s", [slot]) == [
        (True,)
    ]


async def wait_for(check: Callable[[], Awaitable[bool]], what: str, limit: float = 30.0) -> None:
    """Poll a condition until it holds (never a fixed sleep)."""
    deadline = time.monotonic() + limit
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------------------------------------------------


async def test_good_cluster_installs_once_and_the_second_install_changes_nothing(pg_nodes: Nodes) -> None:
    nodes = pg_nodes(3, names=["a", "b", "c"])
    for node in nodes:
        await execute(node.dsn(), GOOD_SCHEMA_B if node.name == "b" else GOOD_SCHEMA)
    config = config_for("shop", [(n.name, n.dsn()) for n in nodes], ["public.*", "sales.*"], ["scratch"])

    report, lines = await init_cluster(config)

    assert report.ok, report.render()
    assert report.tables == GOOD_TABLES
    assert "✗" not in report.render() and "✓" in report.render()
    assert {c.check for c in report.checks} >= {"connect", "version", "wal_level", "superuser", "tables"}
    assert any("created publication pgmesh_shop for 3 tables" in line for line in lines)
    before = {}
    for node in nodes:
        state = before[node.name] = await catalog_state(node.dsn(), config)
        others = sorted(n.name for n in nodes if n is not node)
        assert len(state["schema"]) == 1
        assert state["published"] == GOOD_TABLES  # the partition root, not its partition; no scratch
        assert [row[1:] for row in state["publication"]] == [(True, False)]
        assert [row[:4] for row in state["slots"]] == [("pgmesh_shop", "pgoutput", "logical", "app")]
        assert [row[1] for row in state["origins"]] == [f"pgmesh_shop_{o}" for o in others]
        assert [(s, paused, reason) for s, paused, reason, _ in state["links"]] == [
            (o, False, None) for o in others
        ]

    again = await install(config, await check_cluster(config))

    assert len(again) == 3
    assert all("already installed, nothing changed" in line for line in again), again
    for node in nodes:
        assert await catalog_state(node.dsn(), config) == before[node.name]


async def test_a_new_table_is_added_to_the_publication_and_uninstall_cleans_a_node(pg_nodes: Nodes) -> None:
    nodes = pg_nodes(2, names=["a", "b"])
    config = config_for("grow", [(n.name, n.dsn()) for n in nodes])

    report, lines = await init_cluster(config)  # no table yet: an empty publication

    assert report.ok and report.tables == [], report.render()
    assert any("created publication pgmesh_grow for 0 tables" in line for line in lines)
    for node in nodes:  # local DDL: the event trigger does not replicate it, but the table joins
        await execute(node.dsn(), "SET pgmesh.ddl_local = on; CREATE TABLE t (id int PRIMARY KEY)")
    assert await rows(nodes[0].dsn(), "SELECT tablename FROM pg_publication_tables") == [("t",)]
    _, lines = await init_cluster(config)
    assert any("already installed, nothing changed" in line for line in lines), lines
    for node in nodes:  # a table pgmesh did not see created joins at the next init
        await execute(node.dsn(), "ALTER PUBLICATION pgmesh_grow DROP TABLE t")
    _, lines = await init_cluster(config)
    assert any("publication pgmesh_grow: added 1 tables, removed 0" in line for line in lines), lines
    assert await rows(nodes[0].dsn(), "SELECT tablename FROM pg_publication_tables") == [("t",)]

    async with await psycopg.AsyncConnection.connect(
        nodes[0].dsn(), replication="database", autocommit=True
    ) as stream:
        stream.pgconn.send_query(START_GROW)  # the slot becomes active; nothing reads the stream
        await wait_for(lambda: slot_active(nodes[0].dsn(), "pgmesh_grow"), "slot pgmesh_grow active")
        with pytest.raises(SlotError, match=r"node a: slot pgmesh_grow is in use"):
            await uninstall(config, "a")
        await stream.close()  # still in COPY mode: close rather than let the context manager commit
    assert (await catalog_state(nodes[0].dsn(), config))["slots"], "a refused uninstall must remove nothing"

    assert await uninstall(config, "b") != ["node b: nothing of pgmesh left to remove"]
    state = await catalog_state(nodes[1].dsn(), config)
    assert state["schema"] == state["publication"] == state["slots"] == state["origins"] == []
    assert await uninstall(config, "b") == ["node b: nothing of pgmesh left to remove"]


async def test_table_problems_are_refused_naming_node_and_table(pg_nodes: Nodes) -> None:
    nodes = pg_nodes(3, names=["a", "b", "c"])
    dsns = [(n.name, n.dsn()) for n in nodes]
    scripts = {
        "a": "CREATE TABLE m (id int PRIMARY KEY); CREATE TABLE ty (id int PRIMARY KEY, qty int, note text);",
        "b": "CREATE TABLE m (id int PRIMARY KEY); CREATE TABLE ty (id int PRIMARY KEY, qty bigint);",
        "c": "CREATE TABLE ty (id int PRIMARY KEY, qty int, note text);",
    }
    for node in nodes:
        await execute(node.dsn(), scripts[node.name] + "CREATE TABLE nk (id int, v text);")

    report = await check_cluster(config_for("tab", dsns, ["m"]))
    assert problems_of(report) == [("c", "table", "public.m")]
    assert "missing here (exists on node a, b)" in report.render()

    report = await check_cluster(config_for("tab", dsns, ["ty"]))
    assert problems_of(report) == [("b", "table", "public.ty")]
    (problem,) = report.problems
    assert "column qty is bigint here but integer on node a" in problem.detail
    assert "column note (text) is missing here" in problem.detail

    # A table without a key (or with only a deferrable one), under "warn" or "refuse": refused.
    await execute(nodes[0].dsn(), "CREATE TABLE dk (id int PRIMARY KEY DEFERRABLE)")
    report = await check_cluster(config_for("tab", dsns, ["dk"], keyless="warn"))
    assert ("a", "table", "public.dk") in problems_of(report)
    assert "(or only a deferrable one)" in report.problems[0].detail
    config = config_for("tab", dsns, ["nk"], keyless="refuse")
    report = await check_cluster(config)
    assert problems_of(report) == [(n, "table", "public.nk") for n in ("a", "b", "c")]
    assert all("REPLICA IDENTITY FULL" in (c.hint or "") for c in report.problems)
    with pytest.raises(ConfigError) as refused:
        await install(config, report)
    text = str(refused.value)
    assert "node a" in text and "node c" in text and "table public.nk: has no primary key" in text
    assert 'ALTER TABLE "public"."nk" REPLICA IDENTITY FULL' in text
    for node in nodes:
        assert await rows(node.dsn(), "SELECT 1 FROM pg_namespace WHERE nspname = 'pgmesh'") == []

    for node in nodes:
        await execute(node.dsn(), "ALTER TABLE nk REPLICA IDENTITY FULL")
    report = await check_cluster(config)
    assert report.ok, report.render()
    assert report.tables == [("public", "nk")]


async def test_init_makes_a_table_without_a_key_replica_identity_full(pg_nodes: Nodes) -> None:
    """Under `new_table_without_key = "full"` (the default) init accepts a table without a key and makes it
    REPLICA IDENTITY FULL on every node, partitions included, as the DDL capture does with one created
    later; a primary key added later makes it DEFAULT again. A failed init leaves the identity as it was."""
    nodes = pg_nodes(2, names=["a", "b"])
    dsns = [(n.name, n.dsn()) for n in nodes]
    schema = (
        "CREATE TABLE nk (id int, v text);"
        "CREATE TABLE pk (id int PRIMARY KEY);"
        "CREATE TABLE pt (id int, v text) PARTITION BY RANGE (id);"
        "CREATE TABLE pt_1 PARTITION OF pt FOR VALUES FROM (0) TO (100);"
    )
    for node in nodes:
        await execute(node.dsn(), schema)
    identities = (
        "SELECT c.relname, c.relreplident::text FROM pg_class c"
        " WHERE c.relname IN ('nk', 'pk', 'pt', 'pt_1') ORDER BY 1"
    )
    config = config_for("bare", dsns)
    report = await check_cluster(config)
    assert report.ok, report.render()
    assert "made REPLICA IDENTITY FULL by init (2 without a key)" in report.render()
    # a failure on the last node (a slot of pgmesh's name is taken there) rolls the identities back too
    taken = f"SELECT pg_create_logical_replication_slot('{config.slot_name}', 'test_decoding')"
    await execute(nodes[1].dsn(), taken)
    with pytest.raises(PgmeshError, match="what it had created on node a, b was removed"):
        await install(config, report)
    await execute(nodes[1].dsn(), f"SELECT pg_drop_replication_slot('{config.slot_name}')")
    for node in nodes:
        assert await rows(node.dsn(), identities) == [("nk", "d"), ("pk", "d"), ("pt", "d"), ("pt_1", "d")]
    report, done = await init_cluster(config)
    assert report.ok, report.render()
    made = "made 3 tables without a key (or under a FULL root) REPLICA IDENTITY FULL"
    assert any(made in line for line in done), done
    for node in nodes:
        assert await rows(node.dsn(), identities) == [("nk", "f"), ("pk", "d"), ("pt", "f"), ("pt_1", "f")]
        await execute(node.dsn(), "SET pgmesh.ddl_local = on; ALTER TABLE nk ADD PRIMARY KEY (id)")
        assert (await rows(node.dsn(), identities))[0] == ("nk", "d")


async def test_wal_level_replica_and_a_role_that_is_not_superuser_are_refused(pg_nodes: Nodes) -> None:
    (a,) = pg_nodes(1, names=["a"])
    (b,) = pg_nodes(1, names=["b"], settings={"wal_level": "replica"})
    await execute(a.dsn(), "CREATE ROLE plain LOGIN")
    config = config_for("wal", [("a", a.dsn()), ("b", b.dsn()), ("c", a.dsn(user="plain"))])

    report = await check_cluster(config)

    assert problems_of(report) == [("b", "wal_level", None), ("c", "superuser", None)]
    rendered = report.render()
    assert "✗ wal_level" in rendered and "is replica" in rendered and "restart" in rendered
    assert "session_replication_role" in report.problems[1].detail
    with pytest.raises(ConfigError, match="node b, c"):
        await install(config, report)


async def test_wrong_password_a_down_node_and_a_bad_dsn_are_failed_checks(pg_nodes: Nodes) -> None:
    a, b = pg_nodes(2, names=["a", "b"], password="s3cret-Pw")
    down = f"host=127.0.0.1 port={free_port()} dbname=app user=postgres password=also-s3cret"
    garbled = "host=127.0.0.1 password=zz9 qq7"
    nodes = [("a", a.dsn()), ("b", b.dsn(password="wr0ng-Pw")), ("c", down), ("d", garbled)]
    config = config_for("auth", nodes)

    report = await check_cluster(config)

    assert problems_of(report) == [(n, "connect", None) for n in ("b", "c", "d")]
    by_node: dict[str, Check] = {c.node: c for c in report.problems}
    assert "password authentication failed" in by_node["b"].detail
    assert "password" in (by_node["b"].hint or "")
    assert "running and reachable" in (by_node["c"].hint or "")
    assert "not a valid libpq connection string" in by_node["d"].detail
    rendered = report.render()
    for secret in ("s3cret-Pw", "wr0ng-Pw", "also-s3cret", "zz9", "qq7"):
        assert secret not in rendered
    assert "node a" in rendered and "✓ connect" in rendered
    with pytest.raises(ConfigError) as refused:
        await install(config, report)
    assert "wr0ng-Pw" not in str(refused.value)
