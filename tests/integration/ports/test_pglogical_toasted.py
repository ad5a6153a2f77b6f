"""pglogical's toasted.sql, ported to a two-node pgmesh mesh with the router running (issue 17).

A table whose `data` column is stored out of line (STORAGE EXTERNAL) is made by DDL while the router runs.
Inserts of toasted values, updates that leave them unchanged (pgoutput sends such a cell as "unchanged
TOAST", which must leave the target's value alone), updates that change them, and COPY, on a and on b.
"""

from __future__ import annotations

import psycopg
import pytest

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import has, healthy

TOASTED = """CREATE TABLE public.toasted (
    id serial primary key,
    other text,
    data text NOT NULL
)"""

# lengths, not values: 3,000-character values are hard to read in an assertion
ROWS = "SELECT id, left(other, 10), length(other), left(data, 12), length(data) FROM toasted ORDER BY id"


async def copy_in(dsn: str, statement: str, data: str) -> None:
    """Run a COPY ... FROM STDIN of `data`, as psql's \\copy does."""
    async with (
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn,
        conn.cursor().copy(statement) as copy,
    ):
        await copy.write(data)


async def test_toasted(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        async with await psycopg.AsyncConnection.connect(a.dsn()) as conn:  # one transaction, as the original
            await conn.execute(TOASTED)
            await conn.execute("ALTER TABLE public.toasted ALTER COLUMN data SET STORAGE EXTERNAL")
            await conn.commit()
        storage = ("SELECT attstorage FROM pg_attribute"
                   " WHERE attrelid = to_regclass('toasted') AND attname = 'data'")
        await wait_for(lambda: has(b.dsn(), storage, [("e",)]), "toasted, STORAGE EXTERNAL, on b")

        await execute(a.dsn(), "INSERT INTO toasted(other, data) VALUES('foo', repeat('1234567890', 300))")
        await execute(a.dsn(), "UPDATE toasted SET other = 'foo2'")  # the toasted value is unchanged
        await execute(a.dsn(), "UPDATE toasted SET other = 'foo3', data = '-'||data")
        await wait_converged(m.nodes, ["toasted"])
        rows = await fetch(b.dsn(), ROWS)
        assert rows == [(1, "foo3", 4, "-12345678901", 3001)], rows
        # the value really is out of line on b, and it is the whole value
        (row,) = await fetch(b.dsn(), "SELECT data = '-' || repeat('1234567890', 300),"
                                      " pg_column_size(data) < length(data) FROM toasted")
        assert row == (True, False), row  # EXTERNAL: stored uncompressed, out of line

        # the same from b: a row of its own, an update that leaves a toasted value alone, one that changes it
        await execute(b.dsn(), "INSERT INTO toasted(id, other, data)"
                               " VALUES(2, 'from b', repeat('abcdefghij', 400))")
        await execute(b.dsn(), "UPDATE toasted SET other = 'b2'")  # both rows, toasted values unchanged
        await wait_converged(m.nodes, ["toasted"])
        await execute(b.dsn(), "UPDATE toasted SET data = data || '+' WHERE id = 2")
        await wait_converged(m.nodes, ["toasted"])
        rows = await fetch(a.dsn(), ROWS)
        assert rows == [(1, "b2", 2, "-12345678901", 3001), (2, "b2", 2, "abcdefghijab", 4001)], rows

        # COPY of long values in either column
        long_a = "a" * 3000
        await copy_in(a.dsn(), "COPY toasted FROM STDIN WITH CSV",
                      f"9000,{long_a},bar\n9001,bbb,ccc\n9002,ddd,eee\n9003,bar,{long_a}\n9004,fff,hhh\n")
        await copy_in(b.dsn(), "COPY toasted FROM STDIN WITH CSV", f"9100,{long_a}b,{long_a}c\n")
        await wait_converged(m.nodes, ["toasted"])
        rows = await fetch(b.dsn(), ROWS)
        assert rows == [
            (1, "b2", 2, "-12345678901", 3001), (2, "b2", 2, "abcdefghijab", 4001),
            (9000, "aaaaaaaaaa", 3000, "bar", 3), (9001, "bbb", 3, "ccc", 3), (9002, "ddd", 3, "eee", 3),
            (9003, "bar", 3, "aaaaaaaaaaaa", 3000), (9004, "fff", 3, "hhh", 3),
            (9100, "aaaaaaaaaa", 3001, "aaaaaaaaaaaa", 3001),
        ], rows
        # an update of the short column of a row whose both values are long, on a, and a delete on b
        await execute(a.dsn(), "UPDATE toasted SET other = other || 'x' WHERE id = 9000")
        await execute(a.dsn(), "UPDATE toasted SET id = 9101 WHERE id = 9100")  # the key moves, data stays
        await execute(b.dsn(), "DELETE FROM toasted WHERE id = 9003")
        await wait_converged(m.nodes, ["toasted"])
        long_values = await fetch(b.dsn(), "SELECT id, other = repeat('a', 3000) || 'x', data,"
                                           " other = repeat('a', 3000)"
                                           " || 'b', data = repeat('a', 3000) || 'c'"
                                           " FROM toasted WHERE id IN (9000, 9101) ORDER BY id")
        assert long_values == [(9000, True, "bar", False, False), (9101, False, long_a + "c", True, True)]
        assert await fetch(b.dsn(), "SELECT id FROM toasted WHERE id >= 9000 ORDER BY id") == [
            (9000,), (9001,), (9002,), (9004,), (9101,)]

        await execute(a.dsn(), "DROP TABLE public.toasted CASCADE")
        gone = "SELECT to_regclass('toasted') IS NULL"
        await wait_for(lambda: has(b.dsn(), gone, [(True,)]), "toasted dropped on b")
        healthy(router)


@pytest.mark.slow  # while it fails: waits 15 s for nodes that stay apart
async def test_concurrent_updates_of_a_toasted_row(mesh: MeshFactory) -> None:
    """b changes the toasted value, a changes another column of the same row a moment later (links held,
    so each node writes over the version it had). a's update is later: it wins on both nodes
    (last_update_wins), so both must hold a's row: `other` from a and the toasted value as a had it. b
    receives a's update with the toasted column as "unchanged TOAST" and, today, keeps its own value."""
    m = await mesh(nodes=2, schema=f"{TOASTED.replace('serial', 'int')};"
                                   " ALTER TABLE public.toasted ALTER COLUMN data SET STORAGE EXTERNAL")
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO toasted VALUES (1, 'foo', repeat('1234567890', 300))")
        await wait_converged(m.nodes, ["toasted"])
        await router.pause(None)
        await execute(b.dsn(), "UPDATE toasted SET data = 'b' || data")
        await execute(a.dsn(), "UPDATE toasted SET other = 'a, later'")
        await router.resume(None)
        decided = "the conflict decided on both nodes"
        await wait_for(lambda: all(x.stats.conflicts for x in router.appliers.values()), decided)
        await wait_converged(m.nodes, ["toasted"], 15)
        assert await fetch(b.dsn(), ROWS) == [(1, "a, later", 8, "123456789012", 3000)]
        healthy(router)
