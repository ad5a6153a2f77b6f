"""`pgmesh run` as a role that is not a superuser (issue 23): a superuser runs the script of `pgmesh init
--print-sql` on each node, the run role passes `pgmesh init --check` and replicates inserts, updates,
deletes and a conflict both ways; a privilege taken away is one clear error naming node and privilege."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from router.config.model import parse_config
from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE items (id int PRIMARY KEY, v text);"
ROLE = "pgmesh_run"


def pgmesh(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "router", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def node_sections(script: str) -> dict[str, str]:
    """The script's part for each node, by the `-- node NAME (database ...)` lines."""
    parts = re.split(r"^-- node (\w+) \(database \w+\)$", script, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


async def _has(dsn: str, query: str) -> bool:
    return bool((await fetch(dsn, query))[0][0])


async def rows(node: Any) -> list[tuple[Any, ...]]:
    return await fetch(node.dsn(), "SELECT id, v FROM items ORDER BY id")


async def test_a_role_with_only_the_documented_privileges_runs_the_router(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, init=False)
    a, b = m.nodes
    for node in m.nodes:
        await execute(node.dsn(), f"CREATE ROLE {ROLE} LOGIN")  # no privilege yet: the script grants them
        # the application's tables belong to its owner role; the run role is a member (docs/security.md:
        # replayed DDL runs as the run role)
        await execute(node.dsn(), "CREATE ROLE app_owner", "ALTER TABLE items OWNER TO app_owner",
                      "GRANT CREATE ON SCHEMA public TO app_owner", f"GRANT app_owner TO {ROLE}")
    run_text = m.config_text().replace("user=postgres", f"user={ROLE}")
    run_config = tmp_path / "run.toml"
    run_config.write_text(run_text)

    printed = pgmesh("init", "--print-sql", "--config", str(run_config))  # as the run role: reads only
    assert printed.returncode == 0, printed.stderr
    assert not await fetch(a.dsn(), "SELECT 1 FROM pg_namespace WHERE nspname = 'pgmesh'")  # nothing ran
    sections = node_sections(printed.stdout)
    assert set(sections) == {"a", "b"}
    for name, part in sections.items():
        assert "CREATE EVENT TRIGGER" in part and "pg_create_logical_replication_slot" in part
        assert f"GRANT SET ON PARAMETER session_replication_role TO \"{ROLE}\"" in part
        await execute(m.node(name).dsn(), part)  # the DBA's run, as a superuser

    checked = pgmesh("init", "--check", "--config", str(run_config))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "every privilege pgmesh run needs" in checked.stdout
    (superuser,) = await fetch(a.dsn(user=ROLE), "SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
    assert superuser == (False,)

    config = parse_config(run_text)
    async with running_router(config):
        await execute(a.dsn(), "INSERT INTO items VALUES (1, 'a'), (2, 'a')")
        await execute(b.dsn(), "INSERT INTO items VALUES (3, 'b')")
        await wait_converged(m.nodes, ["items"])
        await execute(b.dsn(), "UPDATE items SET v = 'b2' WHERE id = 1", "DELETE FROM items WHERE id = 2")
        await execute(a.dsn(), "UPDATE items SET v = 'a3' WHERE id = 3")
        await wait_converged(m.nodes, ["items"])
        assert await rows(a) == [(1, "b2"), (3, "a3")]
        # DDL, run by the tables' owner on a, replayed on b by the run role
        await execute(a.dsn(), "SET ROLE app_owner", "ALTER TABLE items ADD COLUMN note text DEFAULT 'n'",
                      "CREATE TABLE more (id int PRIMARY KEY, items_id int)")
        has_more = "SELECT count(*) FROM pg_tables WHERE tablename = 'more'"
        await wait_for(lambda: _has(b.dsn(), has_more), "the table created on a, on b")
        await execute(b.dsn(), "INSERT INTO more VALUES (1, 1)")
        await wait_converged(m.nodes, ["items", "more"])
        assert await fetch(b.dsn(), "SELECT note FROM items WHERE id = 1") == [("n",)]
        owners = "SELECT tableowner FROM pg_tables WHERE tablename = 'more'"
        assert await fetch(a.dsn(), owners) == [("app_owner",)]
        # the application's own role (no superuser, no right on pgmesh's tables) deletes and truncates:
        # pgmesh's triggers on its tables work for it
        await execute(a.dsn(), "SET ROLE app_owner", "DELETE FROM items WHERE id = 3", "TRUNCATE more")
        await wait_converged(m.nodes, ["items", "more"])
        assert await fetch(b.dsn(), "SELECT count(*) FROM more") == [(0,)]
    # a conflict: the same key inserted on both nodes while no router runs
    await execute(a.dsn(), "INSERT INTO items VALUES (10, 'from a')")
    await execute(b.dsn(), "INSERT INTO items VALUES (10, 'from b')")
    async with running_router(config):
        await wait_converged(m.nodes, ["items"])

        async def recorded() -> bool:
            found = await fetch(a.dsn(), "SELECT count(*) FROM pgmesh.conflict_history")
            found += await fetch(b.dsn(), "SELECT count(*) FROM pgmesh.conflict_history")
            return sum(n for (n,) in found) >= 1

        await wait_for(recorded, "the conflict recorded")
    assert (await rows(a)) == (await rows(b))


async def test_a_missing_privilege_is_one_error_naming_node_and_privilege(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)  # installed by a superuser's init
    a, b = m.nodes
    for node in m.nodes:
        await execute(node.dsn(), f"CREATE ROLE {ROLE} LOGIN")
    run_config = tmp_path / "run.toml"
    run_config.write_text(m.config_text().replace("user=postgres", f"user={ROLE}"))
    admin = m.write_config(tmp_path / "admin.toml")  # the DBA's: a superuser
    printed = pgmesh("init", "--print-sql", "--role", ROLE, "--config", str(admin))
    assert printed.returncode == 0, printed.stderr
    for name, part in node_sections(printed.stdout).items():  # the GRANTs only: init ran already
        await execute(m.node(name).dsn(), part[part.index("-- the role the config connects as"):])
    assert pgmesh("init", "--check", "--config", str(run_config)).returncode == 0

    await execute(b.dsn(), f"REVOKE DELETE ON items FROM {ROLE}")
    checked = pgmesh("init", "--check", "--config", str(run_config))
    assert checked.returncode == 1
    failed = [line for line in checked.stdout.splitlines() if line.lstrip().startswith("✗")]
    assert len(failed) == 1, checked.stdout
    assert "table public.items: role lacks DELETE" in failed[0]
    assert "1 problem(s) on node b" in checked.stdout
    assert f'GRANT DELETE ON TABLE "public"."items" TO "{ROLE}"' in checked.stdout

    await execute(a.dsn(), f"REVOKE SET ON PARAMETER session_replication_role FROM {ROLE}")
    checked = pgmesh("init", "--check", "--config", str(run_config))
    failed = [line for line in checked.stdout.splitlines() if line.lstrip().startswith("✗")]
    assert len(failed) == 2, checked.stdout
    assert "parameter session_replication_role: role lacks SET" in failed[0]
    # init, which installs, still wants a superuser, and says what to do instead
    refused = pgmesh("init", "--config", str(run_config))
    assert refused.returncode == 1 and "--print-sql" in refused.stdout
