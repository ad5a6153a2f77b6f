"""A DBA's first week, as typed: CREATE INDEX CONCURRENTLY, a partition attached with its rows, a role
and its GRANTs, VACUUM FULL / FREEZE on a busy table, a schema renamed, a table made UNLOGGED. Each path
runs on three nodes with the router and writers on every node, and ends with every table (keyless ones
as multisets) and every schema identical, or a loud refusal that names what to do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg

from router.testing.mesh import execute, fetch, free_port, running_router, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.real_use.users import pgmesh, psql, wait_identical

SCHEMA = """
CREATE TABLE app_user (id bigint PRIMARY KEY, name text, score int NOT NULL DEFAULT 0);
CREATE TABLE audit (at timestamptz NOT NULL DEFAULT '2026-01-01', who text, what text);
"""


Work = Callable[[Any, psycopg.AsyncConnection[Any], int], Awaitable[None]]


async def writing(nodes: list[Any], work: Work, body: Callable[[], Awaitable[None]]) -> list[int]:
    """Run `work(node, conn, i)` in a loop on every node while `body` runs; how many rounds each did."""
    stop = asyncio.Event()

    async def loop(node: Any) -> int:
        done = 0
        async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
            while not stop.is_set() or done < 5:
                try:
                    await work(node, conn, done)
                except psycopg.errors.UndefinedTable:
                    pass  # a rename reached this node between two rounds
                done += 1
                await asyncio.sleep(0.01)
        return done

    tasks = [asyncio.create_task(loop(n)) for n in nodes]
    try:
        await body()
    finally:
        stop.set()
    return list(await asyncio.gather(*tasks))


async def users_work(node: Any, conn: psycopg.AsyncConnection[Any], i: int) -> None:
    base = ord(node.name) * 1_000_000
    await conn.execute("INSERT INTO app_user (id, name) VALUES (%s, %s)", [base + i, f"{node.name}{i}"])
    await conn.execute("UPDATE app_user SET score = score + 1 WHERE id = %s", [i % 20])  # shared keys
    await conn.execute("INSERT INTO audit (who, what) VALUES (%s, 'login')", [node.name])


async def test_create_index_concurrently(mesh: MeshFactory, tmp_path: Path) -> None:
    """Typed as in every PostgreSQL runbook: refused with a hint on the node; the hint's two ways (pgmesh
    ddl without CONCURRENTLY; CONCURRENTLY on every node with pgmesh.ddl_local) both give every node the
    index, under writes."""
    seed = "INSERT INTO app_user SELECT g, 'seed' FROM generate_series(0, 99) g;"
    m = await mesh(nodes=3, schema=SCHEMA + seed, admin_port=free_port())
    a, b, c = m.nodes
    config = m.write_config(tmp_path / "pgmesh.toml")
    async with running_router(m.config):
        async def body() -> None:
            refused = psql(a, "CREATE INDEX CONCURRENTLY app_user_name ON app_user (name)", check=False)
            assert refused.returncode != 0
            assert "CONCURRENTLY is not replicated" in refused.stderr, refused.stderr
            assert "HINT" in refused.stderr, refused.stderr
            done = await asyncio.to_thread(
                pgmesh, config, "ddl", "--wait", "CREATE INDEX app_user_name ON app_user (name)")
            assert done.returncode == 0, done.stderr
            for node in m.nodes:
                # (two -c: CONCURRENTLY cannot run in the implicit transaction of one string)
                psql(node, "SET pgmesh.ddl_local = on", "CREATE INDEX CONCURRENTLY audit_who ON audit (who)")

        await writing(m.nodes, users_work, body)
        await wait_identical(m.nodes)
    for node in m.nodes:
        names = await fetch(node.dsn(), "SELECT indexname FROM pg_indexes WHERE indexname IN"
                            " ('app_user_name', 'audit_who') ORDER BY 1")
        assert names == [("app_user_name",), ("audit_who",)], (node.name, names)
    _ = b, c


async def test_partition_attached_with_its_rows(mesh: MeshFactory) -> None:
    """A monthly partition prepared as a table of its own (rows loaded into it first), then attached, as
    people load partitions; writes from every node go on through the root."""
    m = await mesh(nodes=3, schema="""
        CREATE TABLE reading (at date NOT NULL, sensor int NOT NULL, v numeric, PRIMARY KEY (at, sensor))
            PARTITION BY RANGE (at);
        CREATE TABLE reading_2026_01 PARTITION OF reading FOR VALUES FROM ('2026-01-01') TO ('2026-02-01');
    """)
    a, b, c = m.nodes

    async def work(node: Any, conn: psycopg.AsyncConnection[Any], i: int) -> None:
        await conn.execute("INSERT INTO reading VALUES ('2026-01-15', %s, %s) ON CONFLICT (at, sensor)"
                           " DO UPDATE SET v = excluded.v", [ord(node.name) * 100_000 + i, i])

    async with running_router(m.config):
        async def body() -> None:
            psql(b, "CREATE TABLE reading_2026_02 (LIKE reading INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
            psql(b, "INSERT INTO reading_2026_02 SELECT date '2026-02-01' + g % 28, g, g FROM"
                    " generate_series(1, 500) g")
            psql(b, "ALTER TABLE reading_2026_02 ADD PRIMARY KEY (at, sensor)")
            psql(b, "ALTER TABLE reading ATTACH PARTITION reading_2026_02"
                    " FOR VALUES FROM ('2026-02-01') TO ('2026-03-01')")
            await wait_for(lambda: attached(m.nodes), "the partition attached on every node")
            psql(c, "INSERT INTO reading VALUES ('2026-02-10', 1, -1) ON CONFLICT (at, sensor)"
                    " DO UPDATE SET v = -1")

        await writing(m.nodes, work, body)
        await wait_identical(m.nodes)
    for node in (a, b, c):
        # b's 500 rows, and the row c added (sensor 1 had its February reading on the 2nd)
        assert await fetch(node.dsn(), "SELECT count(*) FROM reading WHERE at >= '2026-02-01'") == [(501,)]
        assert await fetch(node.dsn(), "SELECT v FROM reading WHERE at = '2026-02-10' AND sensor = 1") \
            == [(-1,)]


async def attached(nodes: list[Any]) -> bool:
    query = "SELECT count(*) FROM pg_inherits WHERE inhrelid = 'reading_2026_02'::regclass"
    for node in nodes:
        if await fetch(node.dsn(), "SELECT to_regclass('reading_2026_02') IS NOT NULL") != [(True,)]:
            return False
        if await fetch(node.dsn(), query) != [(1,)]:
            return False
    return True


async def test_role_and_grants(mesh: MeshFactory, tmp_path: Path) -> None:
    """Roles are per server (no event trigger sees them): created on every node first, as docs/ddl.md says,
    then GRANT / REVOKE on one node reach every node. A GRANT naming a role one node lacks pauses the link
    into it with the error and a hint, and resumes once the role exists there, with nothing lost."""
    m = await mesh(nodes=3, schema=SCHEMA, admin_port=free_port())
    a, b, c = m.nodes
    config = m.write_config(tmp_path / "pgmesh.toml")
    for node in m.nodes:
        psql(node, "CREATE ROLE reporting NOLOGIN")
    async with running_router(m.config) as router:
        psql(a, "GRANT SELECT ON app_user, audit TO reporting")
        await wait_for(lambda: granted(m.nodes, "audit"), "the GRANT on every node")
        # (a GRANT and a REVOKE of one table typed at once on two nodes are DDL at once: `pgmesh ddl`)
        psql(b, "REVOKE SELECT ON audit FROM reporting")
        psql(a, "CREATE ROLE auditor NOLOGIN")  # on a only
        psql(b, "CREATE ROLE auditor NOLOGIN")
        psql(a, "GRANT SELECT ON audit TO auditor")
        psql(a, "INSERT INTO app_user VALUES (1, 'after the grant')")
        link = router.appliers[("a", "c")]
        await wait_for(lambda: link.last_error is not None, "the link into c to pause on the missing role")
        assert 'role "auditor" does not exist' in link.last_error, link.last_error
        psql(c, "CREATE ROLE auditor NOLOGIN")
        resumed = await asyncio.to_thread(pgmesh, config, "resume", "--target", "c", "--source", "a")
        assert resumed.returncode == 0, resumed.stderr
        await wait_identical(m.nodes)
    query = ("SELECT has_table_privilege('reporting', 'app_user', 'SELECT'),"
             " has_table_privilege('reporting', 'audit', 'SELECT'),"
             " has_table_privilege('auditor', 'audit', 'SELECT')")
    for node in m.nodes:
        assert await fetch(node.dsn(), query) == [(True, False, True)], node.name


async def granted(nodes: list[Any], table: str) -> bool:
    for node in nodes:
        query = "SELECT has_table_privilege('reporting', %s, 'SELECT')"
        if await fetch(node.dsn(), query, [table]) != [(True,)]:
            return False
    return True


async def test_vacuum_full_and_freeze_on_a_busy_table(mesh: MeshFactory) -> None:
    """VACUUM FULL rewrites the table and VACUUM FREEZE forgets the rows' commit times (frozen xids): the
    conflict rules for rows without a commit time must still give every node the same rows while every
    node updates the same keys."""
    seed = "INSERT INTO app_user SELECT g, 'seed' FROM generate_series(0, 999) g;"
    m = await mesh(nodes=3, schema=SCHEMA + seed)
    a, b, c = m.nodes
    async with running_router(m.config):
        async def body() -> None:
            for _ in range(3):
                psql(a, "VACUUM FULL app_user")
                psql(b, "VACUUM (FREEZE, ANALYZE) app_user")
                psql(c, "VACUUM FULL audit")

        rounds = await writing(m.nodes, users_work, body)
        await wait_identical(m.nodes)
    assert all(r >= 5 for r in rounds), rounds


async def test_schema_renamed(mesh: MeshFactory) -> None:
    """`ALTER SCHEMA app RENAME TO billing` on one node, behind the barrier, then writes through the new
    name on every node: the tables stay replicated (they still match `*.*`) and converge."""
    m = await mesh(nodes=3, schema="""
        CREATE SCHEMA app;
        CREATE TABLE app.invoice (id bigint PRIMARY KEY, total numeric NOT NULL);
        CREATE TABLE app.line (invoice bigint, what text);
    """)
    a, b, c = m.nodes
    async with running_router(m.config):
        for node in m.nodes:
            base = ord(node.name) * 1000
            await execute(node.dsn(),
                          f"INSERT INTO app.invoice SELECT {base} + g, g FROM generate_series(1, 50) g",
                          f"INSERT INTO app.line SELECT {base} + g, 'x' FROM generate_series(1, 50) g")
        await wait_identical(m.nodes)
        psql(b, "ALTER SCHEMA app RENAME TO billing")
        await wait_for(lambda: all_renamed(m.nodes), "the schema renamed on every node")
        for node in m.nodes:
            base = ord(node.name) * 1000 + 500
            psql(node, f"INSERT INTO billing.invoice SELECT {base} + g, g FROM generate_series(1, 50) g;")
            psql(node, f"UPDATE billing.invoice SET total = total + 1 WHERE id % 7 = {ord(node.name) % 7}")
            psql(node, f"INSERT INTO billing.line VALUES ({base}, '{node.name}')")
        await wait_identical(m.nodes)
    for node in (a, b, c):
        assert await fetch(node.dsn(), "SELECT count(*) FROM billing.invoice") == [(300,)]
        published = await fetch(node.dsn(),
                                "SELECT schemaname, tablename FROM pg_publication_tables ORDER BY 2")
        assert published == [("billing", "invoice"), ("billing", "line")], (node.name, published)


async def all_renamed(nodes: list[Any]) -> bool:
    for node in nodes:
        if await fetch(node.dsn(), "SELECT count(*) FROM pg_namespace WHERE nspname = 'billing'") != [(1,)]:
            return False
    return True


async def test_table_made_unlogged(mesh: MeshFactory) -> None:
    """`ALTER TABLE ... SET UNLOGGED` (a bulk-load habit): an unlogged table cannot be published, so its
    rows could never travel again. Refused on the node with a hint, or it stays replicated: never a
    table that quietly stops replicating."""
    m = await mesh(nodes=3, schema=SCHEMA)
    a, b, c = m.nodes
    async with running_router(m.config):
        done = psql(a, "ALTER TABLE audit SET UNLOGGED", check=False)
        if done.returncode == 0:
            psql(b, "INSERT INTO audit (who, what) VALUES ('b', 'after unlogged')")
            psql(a, "INSERT INTO audit (who, what) VALUES ('a', 'after unlogged')")
        else:
            # PostgreSQL itself refuses it for a published table, saying why
            assert "Unlogged relations cannot be replicated" in done.stderr, done.stderr
            psql(b, "INSERT INTO audit (who, what) VALUES ('b', 'refused')")
        await wait_identical(m.nodes)
    _ = c
