"""pglogical's bidirectional.sql, ported to a two-node pgmesh mesh with the router running (issue 17).

pglogical adds a second subscription, b -> a, with `forward_origins := '{}'`; a pgmesh mesh is that shape
from the start. The table is created by DDL on b (the original's subscriber), rows are inserted on a and
updated on b, and each side sees the other's writes; then both nodes write at once.
"""

from __future__ import annotations

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import has, healthy, same_rows

BASIC_DML = """CREATE TABLE public.basic_dml (
    id serial primary key,
    other integer,
    data text,
    something interval
)"""

ROWS = "SELECT id, other, data, something::text FROM basic_dml ORDER BY id"


async def test_bidirectional(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(b.dsn(), BASIC_DML)
        exists = "SELECT to_regclass('public.basic_dml') IS NOT NULL"
        await wait_for(lambda: has(a.dsn(), exists, [(True,)]), "basic_dml on a")

        await execute(a.dsn(), """INSERT INTO basic_dml(other, data, something)
            VALUES (5, 'foo', '1 minute'::interval),
                   (4, 'bar', '12 weeks'::interval),
                   (3, 'baz', '2 years 1 hour'::interval),
                   (2, 'qux', '8 months 2 days'::interval),
                   (1, NULL, NULL)""")
        rows = await same_rows(a, b, ROWS, "a's inserts on b")
        assert rows == [
            (1, 5, "foo", "00:01:00"), (2, 4, "bar", "84 days"), (3, 3, "baz", "2 years 01:00:00"),
            (4, 2, "qux", "8 mons 2 days"), (5, 1, None, None),
        ], rows

        await execute(b.dsn(), "UPDATE basic_dml SET other = id,"
                               " something = something - '10 seconds'::interval WHERE id < 3")
        await execute(b.dsn(), "UPDATE basic_dml SET other = id,"
                               " something = something + '10 seconds'::interval WHERE id > 3")
        rows = await same_rows(a, b, ROWS, "b's updates on a")
        assert rows == [
            (1, 1, "foo", "00:00:50"), (2, 2, "bar", "84 days -00:00:10"), (3, 3, "baz", "2 years 01:00:00"),
            (4, 4, "qux", "8 mons 2 days 00:00:10"), (5, 5, None, None),
        ], rows

        # both nodes write at once, to different rows and to new rows of their own
        await execute(a.dsn(), "UPDATE basic_dml SET data = 'a' WHERE id IN (1, 2)",
                      "INSERT INTO basic_dml VALUES (10, 10, 'new on a', NULL)")
        await execute(b.dsn(), "UPDATE basic_dml SET data = 'b' WHERE id IN (4, 5)",
                      "INSERT INTO basic_dml VALUES (20, 20, 'new on b', NULL)")
        await wait_converged(m.nodes, ["basic_dml"])
        rows = await fetch(a.dsn(), "SELECT id, data FROM basic_dml ORDER BY id")
        assert rows == [
            (1, "a"), (2, "a"), (3, "baz"), (4, "b"), (5, "b"), (10, "new on a"), (20, "new on b"),
        ], rows

        await execute(a.dsn(), "DROP TABLE public.basic_dml CASCADE")
        gone = "SELECT to_regclass('public.basic_dml') IS NULL"
        await wait_for(lambda: has(b.dsn(), gone, [(True,)]), "basic_dml dropped on b")
        healthy(router)
