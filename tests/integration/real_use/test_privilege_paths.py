"""Least privilege as docs/security.md sets it up, and `pgmesh init` as a DBA meets it: a superuser runs
each node's script of `pgmesh init --print-sql --node N` with psql, the router runs as a role without
superuser, and DDL made by `postgres` and by the application's role (ALTER TABLE, CREATE TABLE) reaches
every node with the same owners; `init --check` counts tables one way; init refuses a node whose
`output_plugin_libraries` leaves out pgoutput (18), and a dsn naming a missing database gets that hint."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from router.config.model import parse_config
from router.testing.mesh import fetch, running_router, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.real_use.users import pgmesh, psql, wait_identical

ROLE = "pgmesh_run"
SCHEMA = "CREATE TABLE items (id int PRIMARY KEY, v text);"
_OWNERS = ("SELECT c.relname, pg_get_userbyid(c.relowner) FROM pg_class c"
           " WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r' ORDER BY 1")


def run_script(node: Any, script: str, tmp: Path) -> None:
    """The DBA's run: `psql -v ON_ERROR_STOP=1 -f` as a superuser, connected to the node's database."""
    path = tmp / f"pgmesh-{node.name}.sql"
    path.write_text(script)
    argv = [shutil.which("psql") or "psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", node.dsn(),
            "-f", str(path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


async def owners(node: Any) -> list[tuple[Any, ...]]:
    return await fetch(node.dsn(), _OWNERS)


async def test_ddl_by_postgres_and_by_the_application_replicates_as_its_author(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, init=False)
    a, b, c = m.nodes
    for node in m.nodes:  # as docs/security.md: the router's role, the application's role owning its tables
        psql(node, f"CREATE ROLE {ROLE} LOGIN; CREATE ROLE app LOGIN; ALTER TABLE items OWNER TO app;"
                   " GRANT CREATE ON SCHEMA public TO app")
    run_config = tmp_path / "run.toml"
    run_config.write_text(m.config_text().replace("user=postgres", f"user={ROLE}"))

    for node in m.nodes:  # one script per node, read as the run role, run by a superuser with psql
        printed = pgmesh(run_config, "init", "--print-sql", "--node", node.name)
        assert printed.returncode == 0, printed.stderr
        sections = re.findall(r"^-- node (\w+) \(database \w+\)$", printed.stdout, flags=re.M)
        assert sections == [node.name], printed.stdout[:2000]
        assert f'GRANT "app" TO "{ROLE}"' in printed.stdout  # replayed DDL of app runs as app
        run_script(node, printed.stdout, tmp_path)
    refused = pgmesh(run_config, "init", "--print-sql", "--node", "zz")
    assert refused.returncode != 0 and "no node zz" in refused.stdout + refused.stderr

    checked = pgmesh(run_config, "init", "--check")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    counts = set(re.findall(r"(\d+) replicated tables", checked.stdout))
    assert counts == {"1"}, checked.stdout  # one count, and the true one

    config = parse_config(run_config.read_text())
    async with running_router(config):
        psql(a, "INSERT INTO items VALUES (1, 'a')")
        # DDL by postgres (a superuser: the run role can never SET ROLE to it), then by the application
        psql(a, "ALTER TABLE items ADD COLUMN by_postgres text DEFAULT 'p'")
        psql(a, "CREATE TABLE made_by_postgres (id int PRIMARY KEY, v text)")

        async def on_b_and_c() -> bool:  # one migration after another (at once, b's columns come in another
            # order); on c too: psql below blocks the router's loop, so a replay left open on c would hold
            # the lock c's own CREATE INDEX waits for, until the test's timeout
            query = "SELECT 1 FROM pg_tables WHERE tablename = 'made_by_postgres'"
            return bool(await fetch(b.dsn(), query)) and bool(await fetch(c.dsn(), query))

        await wait_for(on_b_and_c, "postgres's DDL replayed on b and c")
        psql(b, "ALTER TABLE items ADD COLUMN by_app text DEFAULT 'x'", user="app")
        psql(b, "CREATE TABLE made_by_app (id int PRIMARY KEY, v text)", user="app")
        # a migration as one query string, by postgres (replayed whole through pgmesh.ddl_as_owner)
        psql(c, "CREATE TABLE made_by_postgres_2 (id int PRIMARY KEY); CREATE INDEX ON items (v)")

        async def everywhere() -> bool:
            found = [await fetch(n.dsn(), "SELECT count(*) FROM pg_tables WHERE tablename LIKE 'made_by_%'")
                     for n in m.nodes]
            return all(f == [(3,)] for f in found)

        await wait_for(everywhere, "the new tables on every node")
        psql(c, "INSERT INTO made_by_postgres VALUES (1, 'c'); INSERT INTO made_by_app VALUES (1, 'c');"
                " INSERT INTO items VALUES (2, 'c', 'p2', 'x2')")
        psql(b, "UPDATE items SET by_app = 'y' WHERE id = 1", user="app")
        await wait_identical(m.nodes)
    want = [("items", "app"), ("made_by_app", "app"), ("made_by_postgres", "postgres"),
            ("made_by_postgres_2", "postgres")]
    for node in m.nodes:
        assert await owners(node) == want, node.name
    assert await fetch(c.dsn(), "SELECT id, by_postgres, by_app FROM items ORDER BY id") == [
        (1, "p", "y"), (2, "p2", "x2")]


async def test_init_refuses_a_node_whose_output_plugins_leave_out_pgoutput(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, init=False, versions=[18, 18])
    b = m.nodes[1]
    psql(b, "ALTER SYSTEM SET output_plugin_libraries = 'test_decoding'")
    psql(b, "SELECT pg_reload_conf()")
    config = m.write_config(tmp_path / "admin.toml")
    done = pgmesh(config, "init")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    at_b = lines[lines.index("node b"):]
    refused = [line for line in at_b if "output_plugin_libraries" in line and "not allow pgoutput" in line]
    assert refused, done.stdout
    assert "add pgoutput to output_plugin_libraries" in done.stdout
    assert not await fetch(b.dsn(), "SELECT 1 FROM pg_replication_slots")  # nothing installed
    # the router's own role (no superuser) is the one the server would refuse: `init --check` says so too
    for node in m.nodes:  # (pg_read_all_settings: the list is for superusers to read, else a warning)
        psql(node, f"CREATE ROLE {ROLE} LOGIN REPLICATION; GRANT pg_read_all_settings TO {ROLE}")
    run_config = tmp_path / "run.toml"
    run_config.write_text(m.config_text().replace("user=postgres", f"user={ROLE}"))
    checked = pgmesh(run_config, "init", "--check")
    assert checked.returncode == 1
    lines = checked.stdout.splitlines()
    at_a, at_b = lines[lines.index("node a"):lines.index("node b")], lines[lines.index("node b"):]
    assert not [line for line in at_a if "output_plugin_libraries" in line], checked.stdout
    refused = [line for line in at_b if "output_plugin_libraries" in line and "not allow pgoutput" in line]
    assert refused, checked.stdout
    assert "SELECT pg_reload_conf()" in checked.stdout


async def test_a_missing_database_is_named_as_missing(mesh: MeshFactory, tmp_path: Path) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, init=False)
    config = tmp_path / "c.toml"
    config.write_text(m.config_text().replace(m.nodes[1].dsn(), m.nodes[1].dsn(dbname="nosuchdb")))
    done = pgmesh(config, "init")
    assert done.returncode == 1
    assert "does not exist" in done.stdout and "node b is running" not in done.stdout.replace(
        "node b is running, but", ""), done.stdout


async def test_a_message_naming_another_role_is_never_replayed_as_it(mesh: MeshFactory) -> None:
    """The router replays a pgmesh.ddl message as the role it names: a role with no privilege at all must
    not be able to write one naming `postgres` (it ran as a superuser on every other node)."""
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    for node in m.nodes:
        psql(node, "CREATE ROLE mallory LOGIN; SET pgmesh.ddl_local = on;"
                   " GRANT CREATE ON SCHEMA public TO mallory")
    forged = ('{"sql": "CREATE ROLE mallory_super SUPERUSER LOGIN", "search_path": "public",'
              ' "role": "postgres", "tag": "CREATE ROLE"}')
    async with running_router(m.config):
        raw = psql(a, f"SELECT pg_logical_emit_message(true, 'pgmesh.ddl', '{forged}')", user="mallory",
                   check=False)
        assert raw.returncode != 0 and "permission denied" in raw.stderr, raw.stdout + raw.stderr
        through = psql(a, f"SELECT pgmesh.ddl_emit('{forged}')", user="mallory", check=False)
        assert through.returncode != 0 and "refused" in through.stderr, through.stdout + through.stderr
        # what mallory may do, it still may: DDL in its own name replicates
        psql(a, "CREATE TABLE mallorys (id int PRIMARY KEY)", user="mallory")
        psql(a, "INSERT INTO items VALUES (1, 'after')")
        await wait_identical(m.nodes)
    assert await fetch(b.dsn(), "SELECT count(*) FROM pg_roles WHERE rolname = 'mallory_super'") == [(0,)]


async def test_an_install_failure_names_the_stale_objects_behind_it(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    """A node with pgmesh's schema left by an earlier install of another shape: init fails, names what was
    there and how to remove it; done as it says, init succeeds."""
    m = await mesh(nodes=2, schema=SCHEMA, init=False)
    b = m.nodes[1]
    psql(b, "CREATE SCHEMA pgmesh; CREATE TABLE pgmesh.node_info (k text)")  # an older, other shape
    config = m.write_config(tmp_path / "c.toml")
    failed = pgmesh(config, "init")
    assert failed.returncode != 0
    said = failed.stdout + failed.stderr
    assert "node b held pgmesh objects before this init (schema pgmesh)" in said, said
    assert 'DROP SCHEMA "pgmesh" CASCADE' in said
    psql(b, 'DROP SCHEMA "pgmesh" CASCADE')
    # a slot of pgmesh's name left where pgmesh's schema is gone: its position is an earlier install's
    a = m.nodes[0]
    psql(a, f"SELECT pg_create_logical_replication_slot('{m.config.slot_name}', 'pgoutput')")
    psql(a, "INSERT INTO items VALUES (1, 'kept by the stale slot')")
    failed = pgmesh(config, "init")
    said = failed.stdout + failed.stderr
    assert failed.returncode != 0
    assert f"slot {m.config.slot_name} is left from an earlier installation" in said, said
    assert f"SELECT pg_drop_replication_slot('{m.config.slot_name}')" in said, said
    psql(a, f"SELECT pg_drop_replication_slot('{m.config.slot_name}'); DELETE FROM items")
    done = pgmesh(config, "init")
    assert done.returncode == 0, done.stdout + done.stderr
