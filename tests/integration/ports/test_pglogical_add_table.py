"""pglogical's add_table.sql, ported to a two-node pgmesh mesh with the router running (issue 17).

What applies of it: a table whose columns are in a different order on the two nodes (made by hand on
each before `pgmesh init`), and tables made by DDL while the router runs in a schema whose name needs
quoting, with a mixed-case column and a timestamptz default. Rows travel by column name, both ways.
pglogical's replication-set moves, per-table resynchronisation and sequence synchronisation do not apply
(see test_pglogical_replication_set.py and test_pglogical_copy.py for pgmesh's equivalents).
"""

from __future__ import annotations

import datetime
from typing import Any

from router.cluster.install import init_cluster
from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import healthy

STRANGE = """CREATE SCHEMA "strange.schema-IS";
CREATE TABLE public.test_nosync(id serial primary key, data text);
CREATE TABLE "strange.schema-IS".test_strangeschema(
    id serial primary key, "S0m3th1ng" timestamptz DEFAULT '1993-01-01 00:00:00 CET');
CREATE TABLE "strange.schema-IS".test_diff_repset(id serial primary key, data text DEFAULT '')"""

STRANGE_ROWS = 'SELECT id, "S0m3th1ng" FROM "strange.schema-IS".test_strangeschema ORDER BY id'
IN_1993 = datetime.datetime(1992, 12, 31, 23, 0, tzinfo=datetime.UTC)


async def _same(nodes: list[Any], query: str) -> bool:
    a, b = nodes
    return bool(await fetch(a.dsn(), query) == await fetch(b.dsn(), query))


async def _true(node: Any, query: str) -> bool:
    return bool(await fetch(node.dsn(), query) == [(True,)])


async def test_add_table(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, init=False)
    a, b = m.nodes
    await execute(a.dsn(), "CREATE TABLE public.test_publicschema(id serial primary key, data text)")
    await execute(b.dsn(), "CREATE TABLE public.test_publicschema(data text, id serial primary key)")
    report, _ = await init_cluster(m.config)
    assert report.ok, report.render()
    async with running_router(m.config) as router:
        await execute(a.dsn(), STRANGE)
        made = "SELECT to_regclass('\"strange.schema-IS\".test_diff_repset') IS NOT NULL"
        await wait_for(lambda: _same(m.nodes, made), "the strange schema's tables on b")

        await execute(a.dsn(), "INSERT INTO public.test_publicschema(data) VALUES('a')")
        await execute(a.dsn(), "INSERT INTO public.test_publicschema(data) VALUES('b')")
        await execute(b.dsn(), "INSERT INTO public.test_publicschema VALUES('c', 3)")  # b's column order
        await execute(b.dsn(), "INSERT INTO public.test_publicschema(id, data) VALUES(4, 'd')")
        await execute(a.dsn(), "INSERT INTO public.test_nosync(data) VALUES('a')")
        await execute(a.dsn(), "INSERT INTO public.test_nosync(data) VALUES('b')")
        await execute(a.dsn(), 'INSERT INTO "strange.schema-IS".test_strangeschema VALUES(DEFAULT, DEFAULT)')
        await execute(a.dsn(), 'INSERT INTO "strange.schema-IS".test_strangeschema VALUES(DEFAuLT, DEFAULT)')
        # b updates a's row 1 once it has it (the original runs its update after the sync)
        row_1 = 'SELECT count(*) FROM "strange.schema-IS".test_strangeschema WHERE id = 1'
        await wait_for(lambda: _has(b.dsn(), row_1, [(1,)]), "a's row 1 on b")
        await execute(b.dsn(), 'INSERT INTO "strange.schema-IS".test_strangeschema VALUES(3, DEFAULT)')
        await execute(b.dsn(), 'INSERT INTO "strange.schema-IS".test_strangeschema VALUES(4, DEFAULT)')
        await execute(b.dsn(), 'UPDATE "strange.schema-IS".test_strangeschema'
                               ' SET "S0m3th1ng" = NULL WHERE id = 1')
        await execute(a.dsn(), 'INSERT INTO "strange.schema-IS".test_diff_repset VALUES(1), (2)')
        await wait_converged(m.nodes, ["public.test_nosync"])
        public = "SELECT id, data FROM public.test_publicschema ORDER BY id"  # by name: the orders differ
        await wait_for(lambda: _same(m.nodes, public), "test_publicschema equal")
        await wait_for(lambda: _same(m.nodes, STRANGE_ROWS), "test_strangeschema equal")
        diff = 'SELECT id, data FROM "strange.schema-IS".test_diff_repset ORDER BY id'
        await wait_for(lambda: _same(m.nodes, diff), "test_diff_repset equal")

        for node in m.nodes:
            assert await fetch(node.dsn(), "SELECT id, data FROM public.test_publicschema ORDER BY id") == [
                (1, "a"), (2, "b"), (3, "c"), (4, "d")]
        assert await fetch(b.dsn(), "SELECT * FROM public.test_publicschema ORDER BY id") == [
            ("a", 1), ("b", 2), ("c", 3), ("d", 4)]  # b's own column order
        nosync = await fetch(b.dsn(), "SELECT id, data FROM public.test_nosync ORDER BY id")
        assert nosync == [(1, "a"), (2, "b")], nosync
        assert await fetch(a.dsn(), STRANGE_ROWS) == [(1, None), (2, IN_1993), (3, IN_1993), (4, IN_1993)]
        assert await fetch(b.dsn(), diff) == [(1, ""), (2, "")]

        await execute(a.dsn(), "DELETE FROM public.test_publicschema WHERE id > 1")
        await wait_for(lambda: _same(m.nodes, public), "test_publicschema equal")
        assert await fetch(b.dsn(), "SELECT id, data FROM public.test_publicschema") == [(1, "a")]

        await execute(a.dsn(), "DROP TABLE public.test_publicschema CASCADE",
                      "DROP TABLE public.test_nosync CASCADE", 'DROP SCHEMA "strange.schema-IS" CASCADE')
        gone = "SELECT count(*) = 0 FROM pg_namespace WHERE nspname = 'strange.schema-IS'"
        await wait_for(lambda: _true(b, gone), "the schema dropped on b")
        healthy(router)


async def _has(dsn: str, query: str, expected: list[tuple[object, ...]]) -> bool:
    return await fetch(dsn, query) == expected
