"""`pgmesh init` on real PostgreSQL 15 nodes: keys compared across nodes, and init as all or nothing.

Owns: proving that init refuses, naming node, table and what differs, a primary key, a unique constraint or
index (columns, expression, partial predicate, NULLS NOT DISTINCT, DEFERRABLE) or a replica identity that
is not alike on every node, while names may differ; that a failure on the second or the last node, found
by the checks or met during the install, leaves no node with anything of pgmesh (schema, publication,
slot, origins, event triggers, triggers on user tables) and an earlier installation as it was; that init
then succeeds once the cause is fixed; and that an apply error names node, table and LSN in the status
and the log. Must not sleep or time anything.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from router.cluster.checks import check_cluster
from router.cluster.install import init_cluster, install
from router.config.model import Config
from router.errors import ConfigError, PgmeshError
from router.ops.control import cmd_init, render_status
from router.testing.mesh import running_router, wait_for
from tests.integration.test_init import catalog_state, config_for, execute, problems_of, rows

Nodes = Callable[..., list[Any]]

# Alike on a and c; b differs in one thing per table. Names differ everywhere on purpose.
KEYS_A = """
CREATE TABLE pk (id int PRIMARY KEY, k int);
CREATE TABLE uq (id int PRIMARY KEY, email text, CONSTRAINT uq_email_a UNIQUE (email));
CREATE TABLE expr (id int PRIMARY KEY, email text);
CREATE UNIQUE INDEX expr_a ON expr (lower(email));
CREATE TABLE part (id int PRIMARY KEY, code text, active boolean);
CREATE UNIQUE INDEX part_a ON part (code) WHERE active;
CREATE TABLE nnd (id int PRIMARY KEY, code text, UNIQUE NULLS NOT DISTINCT (code));
CREATE TABLE dfr (id int PRIMARY KEY, code text, UNIQUE (code) DEFERRABLE);
CREATE TABLE full_ident (id int PRIMARY KEY, v text);
ALTER TABLE full_ident REPLICA IDENTITY FULL;
CREATE TABLE idx_ident (id int PRIMARY KEY, a int NOT NULL, b int NOT NULL);
CREATE UNIQUE INDEX idx_ident_a_a ON idx_ident (a);
CREATE UNIQUE INDEX idx_ident_b_a ON idx_ident (b);
ALTER TABLE idx_ident REPLICA IDENTITY USING INDEX idx_ident_a_a;
CREATE TABLE same (id int, code text NOT NULL, CONSTRAINT same_pk_a PRIMARY KEY (id));
ALTER TABLE same ADD CONSTRAINT same_code_a UNIQUE (code);
ALTER TABLE same REPLICA IDENTITY USING INDEX same_pk_a;
"""
KEYS_B = """
CREATE TABLE pk (id int, k int PRIMARY KEY);
CREATE TABLE uq (id int PRIMARY KEY, email text);
CREATE TABLE expr (id int PRIMARY KEY, email text);
CREATE UNIQUE INDEX expr_b ON expr (upper(email));
CREATE TABLE part (id int PRIMARY KEY, code text, active boolean);
CREATE UNIQUE INDEX part_b ON part (code);
CREATE TABLE nnd (id int PRIMARY KEY, code text, UNIQUE (code));
CREATE TABLE dfr (id int PRIMARY KEY, code text, UNIQUE (code));
CREATE TABLE full_ident (id int PRIMARY KEY, v text);
CREATE TABLE idx_ident (id int PRIMARY KEY, a int NOT NULL, b int NOT NULL);
CREATE UNIQUE INDEX idx_ident_a_b ON idx_ident (a);
CREATE UNIQUE INDEX idx_ident_b_b ON idx_ident (b);
ALTER TABLE idx_ident REPLICA IDENTITY USING INDEX idx_ident_b_b;
CREATE TABLE same (id int PRIMARY KEY, code text NOT NULL);
CREATE UNIQUE INDEX same_code_b ON same (code);
CREATE UNIQUE INDEX same_code_b_again ON same (code);
"""
# What init says on node b, per table (the other nodes have nothing to say).
MISSING_HERE = "of node a is missing here"
NO_MATCH = "here has no match on node a"
EXPECTED_B = {
    "public.pk": ("primary key (k) here but (id) on node a",),
    "public.uq": (f"unique (email) {MISSING_HERE}",),
    "public.expr": (f"unique (upper(email)) {NO_MATCH}", f"unique (lower(email)) {MISSING_HERE}"),
    "public.part": (f"unique (code) {NO_MATCH}", f"unique (code) WHERE active {MISSING_HERE}"),
    "public.nnd": (f"unique (code) {NO_MATCH}", f"unique (code) NULLS NOT DISTINCT {MISSING_HERE}"),
    "public.dfr": (f"unique (code) {NO_MATCH}", f"unique (code) DEFERRABLE {MISSING_HERE}"),
    "public.full_ident": ("replica identity DEFAULT here but FULL on node a",),
    "public.idx_ident": ("replica identity USING INDEX (b) here but USING INDEX (a) on node a",),
}
FIX_B = """
ALTER TABLE pk DROP CONSTRAINT pk_pkey; ALTER TABLE pk ADD PRIMARY KEY (id);
ALTER TABLE uq ADD UNIQUE (email);
DROP INDEX expr_b; CREATE UNIQUE INDEX ON expr (lower(email));
DROP INDEX part_b; CREATE UNIQUE INDEX ON part (code) WHERE active;
ALTER TABLE nnd DROP CONSTRAINT nnd_code_key; ALTER TABLE nnd ADD UNIQUE NULLS NOT DISTINCT (code);
ALTER TABLE dfr DROP CONSTRAINT dfr_code_key; ALTER TABLE dfr ADD UNIQUE (code) DEFERRABLE;
ALTER TABLE full_ident REPLICA IDENTITY FULL;
ALTER TABLE idx_ident REPLICA IDENTITY USING INDEX idx_ident_a_b;
"""

# A DBA's event trigger that refuses all DDL on a node.
NO_DDL = """
CREATE FUNCTION no_ddl() RETURNS event_trigger LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'DDL is frozen on this node'; END $$;
CREATE EVENT TRIGGER no_ddl ON ddl_command_start EXECUTE FUNCTION no_ddl();
"""
PGMESH_TRACES = {
    "schema": "SELECT nspname FROM pg_namespace WHERE nspname = 'pgmesh'",
    "publications": "SELECT pubname FROM pg_publication ORDER BY 1",
    "slots": "SELECT slot_name, plugin FROM pg_replication_slots ORDER BY 1",
    "origins": "SELECT roname FROM pg_replication_origin ORDER BY 1",
    "event_triggers": "SELECT evtname FROM pg_event_trigger WHERE evtname LIKE 'pgmesh%%' ORDER BY 1",
    "triggers": "SELECT tgrelid::regclass::text, tgname FROM pg_trigger"
    " WHERE NOT tgisinternal AND tgname LIKE 'pgmesh%%' ORDER BY 1, 2",
}


async def traces(dsn: str) -> dict[str, list[tuple[Any, ...]]]:
    """Whatever pgmesh could have left on a node (slots of any plugin: another tool's shows too)."""
    return {what: await rows(dsn, query) for what, query in PGMESH_TRACES.items()}


Rows = list[tuple[Any, ...]]


async def assert_clean(nodes: list[Any], foreign_slots: dict[str, Rows] | None = None) -> None:
    for node in nodes:
        found = await traces(node.dsn())
        expected = {what: [] for what in PGMESH_TRACES}
        expected["slots"] = (foreign_slots or {}).get(node.name, [])
        assert found == expected, f"node {node.name} is not clean: {found}"


async def assert_installed(nodes: list[Any], config: Config) -> None:
    for node in nodes:
        state = await catalog_state(node.dsn(), config)
        assert state["schema"] and state["publication"], node.name
        assert [row[0] for row in state["slots"]] == [config.slot_name], node.name
        assert len(state["origins"]) == len(nodes) - 1, node.name
        found = await traces(node.dsn())
        assert len(found["event_triggers"]) >= 3 and found["triggers"], node.name


# ---------------------------------------------------------------------------------------------------------


async def test_keys_that_differ_are_refused_naming_node_table_and_what(pg_nodes: Nodes) -> None:
    nodes = pg_nodes(3, names=["a", "b", "c"])
    for node in nodes:
        await execute(node.dsn(), KEYS_B if node.name == "b" else KEYS_A)
    config = config_for("keys", [(n.name, n.dsn()) for n in nodes])

    report = await check_cluster(config)

    assert sorted(problems_of(report)) == sorted(("b", "keys", t) for t in EXPECTED_B), report.render()
    for problem in report.problems:
        assert "; ".join(EXPECTED_B[problem.relation or ""]) == problem.detail, problem
        assert "index names may differ" in (problem.hint or "")
    rendered = report.render()
    assert "✓ tables" in rendered and "table public.same" not in rendered  # names differ, shapes alike
    out = io.StringIO()
    assert await cmd_init(config, out=out) == 1  # the command line: refused, with the report
    assert "NOT READY: 8 problem(s) on node b" in out.getvalue()
    assert "table public.pk: primary key (k) here but (id) on node a" in out.getvalue()
    await assert_clean(nodes)

    await execute(nodes[1].dsn(), FIX_B)
    report, _ = await init_cluster(config)
    assert report.ok, report.render()
    await assert_installed(nodes, config)


async def test_the_issue_shape_different_primary_keys_is_refused_before_any_row_diverges(
    pg_nodes: Nodes,
) -> None:
    a, b = pg_nodes(2, names=["a", "b"])
    await execute(a.dsn(), "CREATE TABLE t (id int PRIMARY KEY, k int)")
    await execute(b.dsn(), "CREATE TABLE t (id int, k int PRIMARY KEY)")
    config = config_for("issue", [("a", a.dsn()), ("b", b.dsn())])

    with pytest.raises(ConfigError) as refused:
        await init_cluster(config)

    text = str(refused.value)
    assert "✗ keys" in text and "table public.t: primary key (k) here but (id) on node a" in text
    await assert_clean([a, b])


async def test_a_failure_the_checks_find_on_the_second_or_last_node_installs_nothing(pg_nodes: Nodes) -> None:
    nodes = pg_nodes(3, names=["a", "b", "c"], password="s3cret-Pw")
    a, b, c = nodes
    for node in nodes:
        await execute(node.dsn(), "CREATE TABLE t (id int PRIMARY KEY, v text)")
    await execute(c.dsn(), "CREATE ROLE plain LOGIN SUPERUSER PASSWORD 's3cret-Pw'")
    good = [("a", a.dsn()), ("b", b.dsn()), ("c", c.dsn())]
    foreign = "SELECT pg_create_logical_replication_slot('pgmesh_fail', 'test_decoding')"

    cases: list[tuple[str, list[tuple[str, str]], str, str]] = [
        ("wrong password on b", [good[0], ("b", b.dsn(password="wr0ng")), good[2]], "", "connect"),
        ("table without key on c", good, "CREATE TABLE nokey (v text)", "table"),
        ("privilege missing on c", [good[0], good[1], ("c", c.dsn(user="plain"))],
         "ALTER ROLE plain NOSUPERUSER", "superuser"),
        ("slot name taken on b", good, foreign, "replication_slots"),
    ]
    for what, dsns, inject, check in cases:
        target = nodes[1] if what.endswith(" b") else c
        if inject:
            await execute(target.dsn(), inject)
        config = config_for("fail", dsns)
        with pytest.raises(ConfigError) as refused:
            await init_cluster(config)
        assert f"✗ {check}" in str(refused.value), what
        foreign_slots = {"b": [("pgmesh_fail", "test_decoding")]} if inject == foreign else {}
        await assert_clean(nodes, foreign_slots)
        fix = {
            "table": "DROP TABLE nokey",
            "superuser": "ALTER ROLE plain SUPERUSER",
            "replication_slots": "SELECT pg_drop_replication_slot('pgmesh_fail')",
        }.get(check)
        if fix:
            await execute(target.dsn(), fix)

    config = config_for("fail", good)
    report, _ = await init_cluster(config)
    assert report.ok, report.render()
    await assert_installed(nodes, config)


async def test_a_failure_during_install_on_the_second_or_last_node_is_undone_on_every_node(
    pg_nodes: Nodes,
) -> None:
    nodes = pg_nodes(3, names=["a", "b", "c"])
    a, b, c = nodes
    for node in nodes:
        await execute(node.dsn(), "CREATE TABLE t (id int PRIMARY KEY, v text)")
    config = config_for("undo", [(n.name, n.dsn()) for n in nodes])

    # The second node refuses DDL (a DBA's event trigger): met while the catalog is staged on every node.
    await execute(b.dsn(), NO_DDL)
    report = await check_cluster(config)
    assert report.ok, report.render()
    with pytest.raises(PgmeshError) as failed:
        await install(config, report)
    assert "node b" in str(failed.value) and "DDL is frozen on this node" in str(failed.value)
    assert "install failed, nothing of it is left on any node: node b" in str(failed.value)
    await assert_clean(nodes)
    await execute(b.dsn(), "DROP EVENT TRIGGER no_ddl; DROP FUNCTION no_ddl()")

    # The last node's slot name is taken after the checks: a and b have their slots by then.
    report = await check_cluster(config)
    assert report.ok, report.render()
    await execute(c.dsn(), "SELECT pg_create_logical_replication_slot('pgmesh_undo', 'test_decoding')")
    with pytest.raises(PgmeshError) as failed:
        await install(config, report)
    text = str(failed.value)
    assert "node c" in text and "slot pgmesh_undo exists for plugin 'test_decoding'" in text
    assert "nothing of it is left on any node (what it had created on node a, b, c was removed)" in text
    await assert_clean(nodes, {"c": [("pgmesh_undo", "test_decoding")]})  # another tool's slot stays
    await execute(c.dsn(), "SELECT pg_drop_replication_slot('pgmesh_undo')")

    # A privilege lost after the checks, on the last node.
    await execute(c.dsn(), "CREATE ROLE plain LOGIN SUPERUSER")
    with_plain = config_for("undo", [("a", a.dsn()), ("b", b.dsn()), ("c", c.dsn(user="plain"))])
    report = await check_cluster(with_plain)
    assert report.ok, report.render()
    await execute(c.dsn(), "ALTER ROLE plain NOSUPERUSER")
    with pytest.raises(PgmeshError, match="node c"):
        await install(with_plain, report)
    await assert_clean(nodes)

    report, _ = await init_cluster(config)
    assert report.ok, report.render()
    await assert_installed(nodes, config)
    before = {n.name: await catalog_state(n.dsn(), config) for n in nodes}

    # A second init that fails (DDL frozen on b again) leaves the first installation as it was, slots and
    # their positions included.
    await execute(b.dsn(), f"SET pgmesh.ddl_local = on; {NO_DDL}")
    report = await check_cluster(config)
    assert report.ok, report.render()
    with pytest.raises(PgmeshError, match="node b"):
        await install(config, report)
    for node in nodes:
        assert await catalog_state(node.dsn(), config) == before[node.name], node.name


async def test_an_apply_constraint_violation_names_node_table_and_lsn(mesh: Any, caplog: Any) -> None:
    """A row the target refuses (a CHECK constraint only b has: init does not compare CHECK constraints,
    and no conflict resolution applies) pauses the link with node, LSN, table and constraint. (It used a
    collision on an expression unique index, which the careful path now decides.)"""
    m = await mesh(2, "CREATE TABLE t (id int PRIMARY KEY, email text)")
    a, b = m.nodes
    await execute(b.dsn(), "SET pgmesh.ddl_local = on;"
                  " ALTER TABLE t ADD CONSTRAINT t_email CHECK (email NOT LIKE 'ann%')")
    await execute(a.dsn(), "INSERT INTO t VALUES (1, 'ann@example.org')")
    caplog.set_level(logging.INFO)

    async with running_router(m.config) as router:
        def paused() -> bool:
            return any(link.state == "error" for link in router.status().links)

        await wait_for(paused, "the link into b paused on the check violation")
        status = render_status(router.status())

    (line,) = [ln for ln in status.splitlines() if ln.startswith("a -> b")]
    assert "node b, LSN " in line and "table public.t: " in line, line
    assert "t_email" in line and "SQLSTATE 23514" in line, line
    logged = [r.getMessage() for r in caplog.records if "t_email" in r.getMessage()]
    assert any("node b, LSN " in msg and "table public.t" in msg for msg in logged), logged


async def test_one_database_twice_a_foreign_publication_and_a_busy_table_leave_every_node_clean(
    pg_nodes: Nodes,
) -> None:
    nodes = pg_nodes(3, names=["a", "b", "c"])
    a, b, c = nodes
    for node in nodes:
        await execute(node.dsn(), "CREATE TABLE t (id int PRIMARY KEY, v text)")

    # c's dsn names a's database again: its staged transaction would wait on a's for ever.
    twice = config_for("twice", [("a", a.dsn()), ("b", b.dsn()), ("c", a.dsn())])
    report = await check_cluster(twice)
    assert report.ok, report.render()
    with pytest.raises(PgmeshError) as refused:
        await install(twice, report)
    assert "node c: install not started, nothing was changed" in str(refused.value)
    assert "two nodes of the config are the same database" in str(refused.value)
    await assert_clean(nodes)

    # A publication of pgmesh's name FOR ALL TABLES on the last node is refused by the checks.
    config = config_for("busy", [(n.name, n.dsn()) for n in nodes])
    await execute(c.dsn(), "CREATE PUBLICATION pgmesh_busy FOR ALL TABLES")
    with pytest.raises(ConfigError) as refused:
        await init_cluster(config)
    assert "✗ publication" in str(refused.value) and "FOR ALL TABLES" in str(refused.value)
    await execute(c.dsn(), "DROP PUBLICATION pgmesh_busy")
    await assert_clean(nodes)

    # A writer holds the last node's table open: the trigger waits at most the lock timeout, then
    # every node is rolled back.
    async with await psycopg.AsyncConnection.connect(c.dsn()) as writer:
        await writer.execute("INSERT INTO t VALUES (1, 'open')")  # an open transaction, not committed
        with pytest.raises(PgmeshError) as failed:
            await init_cluster(config)
        assert "node c" in str(failed.value) and "lock timeout" in str(failed.value)
        assert "run init again once it is done" in str(failed.value)
        await writer.rollback()
    await assert_clean(nodes)

    report, _ = await init_cluster(config)
    assert report.ok, report.render()
    await assert_installed(nodes, config)


async def test_a_table_held_exclusively_makes_the_checks_fail_not_wait(pg_nodes: Nodes) -> None:
    """The checks read keys under ACCESS SHARE: a session holding a table ACCESS EXCLUSIVE makes them fail
    with a failed check naming the node after their lock wait, not wait for as long as it holds it."""
    nodes = pg_nodes(2, names=["a", "b"])
    for node in nodes:
        await execute(node.dsn(), "CREATE TABLE t (id int PRIMARY KEY, v text)")
    config = config_for("held", [(n.name, n.dsn()) for n in nodes])
    async with await psycopg.AsyncConnection.connect(nodes[1].dsn()) as holder:
        await holder.execute("LOCK TABLE t IN ACCESS EXCLUSIVE MODE")  # held until the rollback below
        report = await check_cluster(config)
        await holder.rollback()
    failed = [c for c in report.problems if c.node == "b"]
    assert [c.check for c in failed] == ["catalog"], report.render()
    assert "waited too long" in failed[0].detail and "holds a table exclusively" in (failed[0].hint or "")
    report = await check_cluster(config)
    assert report.ok, report.render()
    await assert_clean(nodes)
