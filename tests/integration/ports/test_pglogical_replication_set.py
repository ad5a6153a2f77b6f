"""pglogical's replication_set.sql, ported to a two-node pgmesh mesh with the router running (issue 17).

pglogical manages named replication sets (which tables, which of insert / update / delete / truncate) with
SQL functions; none of that API applies. pgmesh's replicated set is `[replication] tables` and `exclude`
in config.toml (patterns over schema.table), and every replicated table carries every kind of change.
The original's tables are made by DDL in one query string while the router runs: in the public schema,
a plain schema and a schema whose name needs quoting, a table without a key and an UNLOGGED table
(which pglogical refuses to add to a set). What pgmesh does with each:
- tables in the set replicate inserts, updates, deletes and TRUNCATE, whatever their schema's name;
- a table the config excludes exists everywhere (its DDL is replicated) but its rows stay local;
- an UNLOGGED table is never decoded by PostgreSQL: it exists everywhere, its rows stay local.
"""

from __future__ import annotations

from typing import Any

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import healthy

SCHEMA = """CREATE SCHEMA normalschema;
CREATE SCHEMA "strange.schema-IS";
CREATE TABLE public.test_publicschema(id serial primary key, data text);
CREATE TABLE normalschema.test_normalschema(id serial primary key);
CREATE TABLE "strange.schema-IS".test_strangeschema(id serial primary key);
CREATE TABLE public.test_nopkey(id int);
CREATE UNLOGGED TABLE public.test_unlogged(id int primary key);
CREATE TABLE public.test_local_only(id int primary key)"""

STRANGE = '"strange.schema-IS".test_strangeschema'
REPLICATED = ["public.test_publicschema", "normalschema.test_normalschema", STRANGE]


async def _count(node: Any, table: str) -> int:
    ((n,),) = await fetch(node.dsn(), f"SELECT count(*) FROM {table}")
    return int(n)


async def _published(node: Any) -> list[tuple[str, str]]:
    rows = await fetch(node.dsn(), "SELECT schemaname, tablename FROM pg_publication_tables ORDER BY 1, 2")
    return [(str(s), str(t)) for s, t in rows]


async def test_replication_set(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, replication='exclude = ["public.test_local_*"]')
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), SCHEMA)
        made = "SELECT to_regclass('public.test_local_only') IS NOT NULL"
        await wait_for(lambda: _has(b, made), "the tables on b")
        published = [
            ("normalschema", "test_normalschema"), ("public", "test_nopkey"), ("public", "test_publicschema"),
            ("strange.schema-IS", "test_strangeschema"),
        ]
        for node in m.nodes:  # (the keyless table: REPLICA IDENTITY FULL by default, or left out)
            assert [t for t in await _published(node) if t != ("public", "test_nopkey")] == [
                t for t in published if t != ("public", "test_nopkey")]

        for node, first in ((a, 1), (b, 100)):
            for table in REPLICATED:
                await execute(node.dsn(), f"INSERT INTO {table} (id) VALUES ({first}), ({first + 1})")
            await execute(node.dsn(), f"INSERT INTO test_unlogged VALUES ({first})",
                          f"INSERT INTO test_local_only VALUES ({first})")
        # a updates b's row 100 and b deletes a's row 1: both must have arrived first
        await wait_for(lambda: _has(a, "SELECT EXISTS (SELECT 1 FROM test_publicschema WHERE id = 100)"),
                       "b's row 100 on a")
        await wait_for(lambda: _has(b, f"SELECT EXISTS (SELECT 1 FROM {STRANGE} WHERE id = 1)"),
                       "a's row 1 on b")
        await execute(a.dsn(), "UPDATE test_publicschema SET data = 'upd' WHERE id = 100")
        await execute(b.dsn(), 'DELETE FROM "strange.schema-IS".test_strangeschema WHERE id = 1')
        await execute(a.dsn(), "TRUNCATE normalschema.test_normalschema")
        await wait_converged(m.nodes, REPLICATED[:2])  # (it reads "schema.table" names only)
        strange = f"SELECT array_agg(id ORDER BY id) FROM {STRANGE}"
        await wait_for(lambda: _has(b, f"SELECT ({strange}) = '{{2, 100, 101}}'"), "rows of {STRANGE}")
        assert await fetch(b.dsn(), "SELECT id, data FROM test_publicschema ORDER BY id") == [
            (1, None), (2, None), (100, "upd"), (101, None)]
        assert await _count(b, "normalschema.test_normalschema") == 0
        assert await fetch(a.dsn(), 'SELECT id FROM "strange.schema-IS".test_strangeschema ORDER BY id') == [
            (2,), (100,), (101,)]
        # the excluded and the unlogged table: every node holds its own rows only
        for node, first in ((a, 1), (b, 100)):
            assert await fetch(node.dsn(), "SELECT id FROM test_unlogged") == [(first,)]
            assert await fetch(node.dsn(), "SELECT id FROM test_local_only") == [(first,)]

        # dropping a replicated table is plain DDL (pglogical refuses it while the table is in a set)
        await execute(a.dsn(), "DROP TABLE public.test_publicschema")
        gone = "SELECT to_regclass('public.test_publicschema') IS NULL"
        await wait_for(lambda: _has(b, gone), "test_publicschema dropped on b")
        healthy(router)


async def _has(node: Any, query: str) -> bool:
    return await fetch(node.dsn(), query) == [(True,)]
