"""pglogical's basic.sql, ported to a two-node pgmesh mesh with the router running (issue 17).

The table is created by DDL while the router runs (pglogical's replicate_ddl_command), the "subscriber only"
columns are added on b (pgmesh replicates them to a: every node holds the whole table), then the same
inserts, updates, deletes, TRUNCATE and COPY run on a, with writes of b's own mixed in.
"""

from __future__ import annotations

import psycopg

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import has, healthy, same_rows

BASIC_DML = """CREATE TABLE public.basic_dml (
    id serial primary key,
    other integer,
    data text,
    something interval
)"""

# intervals as text (IntervalStyle postgres): what pglogical's expected output shows, in another style
ROWS = "SELECT id, other, data, something::text FROM basic_dml ORDER BY id"
ALL_ROWS = "SELECT id, other, data, something::text, subonly, subonly_def FROM basic_dml ORDER BY id"


async def copy_in(dsn: str, statement: str, data: str) -> None:
    """Run a COPY ... FROM STDIN of `data`, as psql's \\copy does."""
    async with (
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn,
        conn.cursor().copy(statement) as copy,
    ):
        await copy.write(data)


async def test_basic(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), BASIC_DML)
        exists = "SELECT to_regclass('public.basic_dml') IS NOT NULL"
        await wait_for(lambda: has(b.dsn(), exists, [(True,)]), "basic_dml on b")
        await execute(b.dsn(), "ALTER TABLE public.basic_dml ADD COLUMN subonly integer",
                      "ALTER TABLE public.basic_dml ADD COLUMN subonly_def integer DEFAULT 99")
        columns = ("SELECT count(*) FROM pg_attribute"
                   " WHERE attrelid = to_regclass('basic_dml') AND attname LIKE 'sub%'")
        await wait_for(lambda: has(a.dsn(), columns, [(2,)]), "b's new columns on a")

        # basic insert replication
        await execute(a.dsn(), """INSERT INTO basic_dml(other, data, something)
            VALUES (5, 'foo', '1 minute'::interval),
                   (4, 'bar', '12 weeks'::interval),
                   (3, 'baz', '2 years 1 hour'::interval),
                   (2, 'qux', '8 months 2 days'::interval),
                   (1, NULL, NULL)""")
        rows = await same_rows(a, b, ALL_ROWS, "the inserts on b")
        assert rows == [
            (1, 5, "foo", "00:01:00", None, 99), (2, 4, "bar", "84 days", None, 99),
            (3, 3, "baz", "2 years 01:00:00", None, 99), (4, 2, "qux", "8 mons 2 days", None, 99),
            (5, 1, None, None, None, 99),
        ], rows
        # b's own rows (explicit ids: each node's serial counts on its own, see docs/sequences.md)
        await execute(b.dsn(), "INSERT INTO basic_dml(id, other, data, something, subonly)"
                               " VALUES (101, 101, 'from b', '1 day', 7)")

        # update one row
        await execute(a.dsn(), "UPDATE basic_dml SET other = '4', data = NULL, something = '3 days'::interval"
                               " WHERE id = 4")
        rows = await same_rows(a, b, ROWS, "the update of one row on b")
        assert rows[3] == (4, 4, None, "3 days"), rows

        # update multiple rows (here on b, the rows a wrote included)
        await execute(b.dsn(), "UPDATE basic_dml SET other = id, data = data || id::text")
        rows = await same_rows(a, b, ROWS, "the update of every row on a")
        assert rows == [
            (1, 1, "foo1", "00:01:00"), (2, 2, "bar2", "84 days"), (3, 3, "baz3", "2 years 01:00:00"),
            (4, 4, None, "3 days"), (5, 5, None, None), (101, 101, "from b101", "1 day"),
        ], rows

        await execute(a.dsn(), "UPDATE basic_dml SET other = id,"
                               " something = something - '10 seconds'::interval WHERE id < 3")
        await execute(a.dsn(), "UPDATE basic_dml SET other = id,"
                               " something = something + '10 seconds'::interval WHERE id > 3")
        rows = await same_rows(a, b, ALL_ROWS, "both updates on b")
        assert rows == [
            (1, 1, "foo1", "00:00:50", None, 99), (2, 2, "bar2", "84 days -00:00:10", None, 99),
            (3, 3, "baz3", "2 years 01:00:00", None, 99), (4, 4, None, "3 days 00:00:10", None, 99),
            (5, 5, None, None, None, 99), (101, 101, "from b101", "1 day 00:00:10", 7, 99),
        ], rows

        # delete one row, then several (one delete on each node)
        await execute(a.dsn(), "DELETE FROM basic_dml WHERE id = 2")
        rows = await same_rows(a, b, ROWS, "the delete of one row on b")
        assert [r[0] for r in rows] == [1, 3, 4, 5, 101], rows
        await execute(b.dsn(), "DELETE FROM basic_dml WHERE id < 4")
        rows = await same_rows(a, b, ROWS, "the delete of rows on a")
        assert [r[0] for r in rows] == [4, 5, 101], rows

        # truncate
        await execute(a.dsn(), "TRUNCATE basic_dml")
        assert await same_rows(a, b, "SELECT count(*) FROM basic_dml", "the TRUNCATE on b") == [(0,)]

        # copy, on a and on b (a column list: the columns added on b are on a too)
        await copy_in(a.dsn(), "COPY basic_dml (id, other, data, something) FROM STDIN WITH CSV",
                      "9000,1,aaa,1 hour\n9001,2,bbb,2 years\n9002,3,ccc,3 minutes\n9003,4,ddd,4 days\n")
        await copy_in(b.dsn(), "COPY basic_dml (id, other, data, something) FROM STDIN",
                      "9100\t5\teee\t5 seconds\n")
        await wait_converged(m.nodes, ["basic_dml"])
        rows = await fetch(b.dsn(), ALL_ROWS)
        assert rows == [
            (9000, 1, "aaa", "01:00:00", None, 99), (9001, 2, "bbb", "2 years", None, 99),
            (9002, 3, "ccc", "00:03:00", None, 99), (9003, 4, "ddd", "4 days", None, 99),
            (9100, 5, "eee", "00:00:05", None, 99),
        ], rows

        await execute(a.dsn(), "DROP TABLE public.basic_dml CASCADE")
        gone = "SELECT to_regclass('public.basic_dml') IS NULL"
        await wait_for(lambda: has(b.dsn(), gone, [(True,)]), "basic_dml dropped on b")
        healthy(router)


async def test_truncate_at_once_with_an_insert_on_the_other_node(mesh: MeshFactory) -> None:
    """basic.sql's TRUNCATE, with the other node writing at the same time (links held: truly concurrent).
    a truncates, then b inserts a row (later). On a, b's insert arrives after the TRUNCATE: the row is
    there. On b, a's TRUNCATE arrives after b's insert, and it removes only the rows older than it: the
    newer row stays (recorded once, as `truncate_newer_rows`). Every node ends alike."""
    m = await mesh(nodes=2, schema=f"{BASIC_DML.replace('serial', 'int')}")
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO basic_dml VALUES (1, 1, 'before', NULL)")
        await wait_converged(m.nodes, ["basic_dml"])
        await router.pause(None)
        await execute(a.dsn(), "TRUNCATE basic_dml")
        await execute(b.dsn(), "INSERT INTO basic_dml VALUES (2, 2, 'b, after the TRUNCATE', NULL)")
        await router.resume(None)
        await wait_converged(m.nodes, ["basic_dml"], 15)
        assert await fetch(b.dsn(), ROWS) == [(2, 2, "b, after the TRUNCATE", None)]
        assert await fetch(a.dsn(), ROWS) == [(2, 2, "b, after the TRUNCATE", None)]
        kept = ("SELECT conflict_type, source, table_name, reason FROM pgmesh.conflict_history"
                " WHERE conflict_type = 'truncate_newer_rows'")
        assert await fetch(b.dsn(), kept) == [
            ("truncate_newer_rows", "a", "public.basic_dml",
             "the TRUNCATE removed the rows older than it; 1 newer row(s) stay")]
        healthy(router)


async def test_an_insert_older_than_a_truncate_that_arrives_after_it_goes(mesh: MeshFactory) -> None:
    """The other order: b inserts a row, then a truncates (later), links held. On b, a's TRUNCATE arrives
    after the insert and removes it (older). On a, b's insert arrives after the TRUNCATE: it is older than
    the table's tombstone, so its row goes too (swept, recorded as `write_truncated`), and a row a writes
    after its TRUNCATE stays on both."""
    m = await mesh(nodes=2, schema=f"{BASIC_DML.replace('serial', 'int')}")
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO basic_dml VALUES (1, 1, 'before', NULL)")
        await wait_converged(m.nodes, ["basic_dml"])
        await router.pause(None)
        await execute(b.dsn(), "INSERT INTO basic_dml VALUES (2, 2, 'b, before the TRUNCATE', NULL)")
        await execute(a.dsn(), "TRUNCATE basic_dml")
        await execute(a.dsn(), "INSERT INTO basic_dml VALUES (3, 3, 'a, after its TRUNCATE', NULL)")
        await router.resume(None)
        lost = ("SELECT conflict_type, source, key, resolution, local_origin FROM pgmesh.conflict_history"
                " WHERE conflict_type = 'write_truncated'")
        swept = [("write_truncated", "b", "2", "keep_local", "a")]
        await wait_for(lambda: has(a.dsn(), lost, swept), "b's older insert removed on a, and recorded")
        await wait_converged(m.nodes, ["basic_dml"], 15)
        want = [(3, 3, "a, after its TRUNCATE", None)]
        assert await fetch(a.dsn(), ROWS) == want
        assert await fetch(b.dsn(), ROWS) == want
        healthy(router)


async def test_a_third_node_gets_the_truncate_before_an_older_insert(mesh: MeshFactory) -> None:
    """Three nodes, links held: c inserts a row, then a truncates (later). b gets a's TRUNCATE first (only
    a -> b resumed) and c's older insert after it: b never truncated anything itself, and still removes
    that row (its appliers recorded the table tombstone; the recorder's sweep finds it), as a, where it
    arrives after the TRUNCATE too, and c, where the TRUNCATE arrives after it."""
    m = await mesh(nodes=3, schema=f"{BASIC_DML.replace('serial', 'int')}")
    a, b, c = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO basic_dml VALUES (1, 1, 'before', NULL)")
        await wait_converged(m.nodes, ["basic_dml"])
        await router.pause(None)
        await execute(c.dsn(), "INSERT INTO basic_dml VALUES (2, 2, 'c, before the TRUNCATE', NULL)")
        await execute(a.dsn(), "TRUNCATE basic_dml")
        await router.resume("b", "a")
        await wait_for(lambda: has(b.dsn(), ROWS, []), "a's TRUNCATE on b")
        await router.resume(None)
        lost = "SELECT source, key FROM pgmesh.conflict_history WHERE conflict_type = 'write_truncated'"
        for node in (a, b):
            await wait_for(lambda node=node: has(node.dsn(), lost, [("c", "2")]),
                           f"c's row removed on {node.name}, and recorded")
        await wait_converged(m.nodes, ["basic_dml"], 15)
        for node in m.nodes:
            assert await fetch(node.dsn(), ROWS) == []
        healthy(router)
