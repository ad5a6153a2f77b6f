"""pglogical's att_list.sql, ported to a two-node pgmesh mesh with the router running (issue 17).

pglogical replicates a column list of basic_dml (id, data, something) and then shows that even the
primary key column can be dropped at the provider while inserts, updates and deletes go on reaching the
subscriber. pgmesh replicates whole tables (no column lists; docs/limits.md): every node holds every
column. Dropping the key column is DDL replicated to every node, where the capture trigger makes the
table, now without a key, REPLICA IDENTITY FULL: the inserts, updates and deletes after it replicate
matched by all their columns, from both nodes, and both nodes end equal.
"""

from __future__ import annotations

from typing import Any

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import has, healthy, same_rows
from tests.integration.ports.test_pglogical_basic import copy_in

BASIC_DML = """CREATE TABLE public.basic_dml (
    id serial primary key,
    other integer,
    data text,
    something interval
)"""
COLUMNS = ("SELECT string_agg(attname, ',' ORDER BY attnum) FROM pg_attribute"
           " WHERE attrelid = to_regclass('public.basic_dml') AND attnum > 0 AND NOT attisdropped")
IDENTITY = "SELECT relreplident::text FROM pg_class WHERE oid = to_regclass('public.basic_dml')"


async def everywhere(nodes: list[Any], router: Any, query: str, expected: Any, what: str) -> None:
    async def check() -> bool:
        errors = {name: a.last_error for name, a in router.appliers.items() if a.last_error}
        assert not errors, errors
        return all([await fetch(n.dsn(), query) == expected for n in nodes])

    await wait_for(check, what)


async def test_att_list(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), BASIC_DML)
        await everywhere(m.nodes, router, COLUMNS, [("id,other,data,something",)], "basic_dml on b")
        # pglogical's inserts, updates and deletes (their port is test_pglogical_basic): the rows after
        # its TRUNCATE and COPY, and one of b's own
        await copy_in(a.dsn(), "COPY basic_dml FROM STDIN WITH CSV",
                      "9000,1,aaa,1 hour\n9001,2,bbb,2 years\n9002,3,ccc,3 minutes\n9003,4,ddd,4 days\n")
        await execute(b.dsn(), "INSERT INTO basic_dml VALUES (9100, 5, 'eee', '5 seconds')")
        await wait_converged(m.nodes, ["basic_dml"])

        # drop columns, even the primary key
        await execute(a.dsn(), "ALTER TABLE basic_dml DROP COLUMN id")
        await execute(a.dsn(), "ALTER TABLE basic_dml DROP COLUMN data")
        await everywhere(m.nodes, router, COLUMNS, [("other,something",)], "the columns dropped on b")
        await everywhere(m.nodes, router, IDENTITY, [("f",)], "REPLICA IDENTITY FULL on every node")
        # add a column, then insert, update and delete without a key
        await execute(a.dsn(), "ALTER TABLE basic_dml ADD COLUMN data1 text")
        await execute(a.dsn(), """INSERT INTO basic_dml(other, data1, something)
            VALUES (5, 'foo', '1 minute'::interval),
                   (4, 'bar', '12 weeks'::interval)""")
        await execute(a.dsn(), "UPDATE basic_dml set something = something - '10 seconds'::interval")
        await execute(a.dsn(), "DELETE FROM basic_dml WHERE other = 2")
        query = "SELECT other, something::text, data1 FROM basic_dml ORDER BY other, data1 NULLS FIRST"
        rows = await same_rows(a, b, query, "a's changes without a key on b")
        assert rows == [
            (1, "00:59:50", None), (3, "00:02:50", None), (4, "4 days -00:00:10", None),
            (4, "84 days -00:00:10", "bar"), (5, "-00:00:05", None), (5, "00:00:50", "foo"),
        ], rows
        # and b's
        await execute(b.dsn(), "INSERT INTO basic_dml(other, data1, something) VALUES (6, 'from b', '1 day')")
        await execute(b.dsn(), "UPDATE basic_dml SET data1 = 'upd' WHERE other = 3")
        await execute(b.dsn(), "DELETE FROM basic_dml WHERE other = 1")
        rows = await same_rows(a, b, query, "b's changes without a key on a")
        assert rows == [
            (3, "00:02:50", "upd"), (4, "4 days -00:00:10", None), (4, "84 days -00:00:10", "bar"),
            (5, "-00:00:05", None), (5, "00:00:50", "foo"), (6, "1 day", "from b"),
        ], rows
        await wait_converged(m.nodes, ["basic_dml"])
        healthy(router)

        await execute(a.dsn(), "DROP TABLE public.basic_dml CASCADE")
        gone = "SELECT to_regclass('public.basic_dml') IS NULL"
        await wait_for(lambda: has(b.dsn(), gone, [(True,)]), "basic_dml dropped on b")
