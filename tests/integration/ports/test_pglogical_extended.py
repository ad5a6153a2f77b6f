"""pglogical's extended.sql ("complex datatype handling") ported to a two-node pgmesh mesh with the router
running (issue 17).

The types and tables (arrays, enums, composites as keys and nested, arrays of them, ranges) are made by
DDL on a while the router runs (pglogical: `replicate_ddl_command`), then each of the original's
statements runs on a and b must hold the same rows after each one (the original reads the subscriber
after each). Then VACUUM FULL (a table's files swapped) followed by more changes, writes on b, the same
rows written on both nodes while the links are paused, and the DROP of every table and type, replicated.
"""

from __future__ import annotations

from typing import Any

import psycopg

from router.testing.mesh import converged, execute, fetch, running_router, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import healthy

DDL = """
CREATE TABLE public.tst_one_array (a INTEGER PRIMARY KEY, b INTEGER[]);
CREATE TABLE public.tst_arrays (a INTEGER[] PRIMARY KEY, b TEXT[], c FLOAT[], d INTERVAL[]);
CREATE TYPE public.tst_enum_t AS ENUM ('a', 'b', 'c', 'd', 'e');
CREATE TABLE public.tst_one_enum (a INTEGER PRIMARY KEY, b public.tst_enum_t);
CREATE TABLE public.tst_enums (a public.tst_enum_t PRIMARY KEY, b public.tst_enum_t[]);
CREATE TYPE public.tst_comp_basic_t AS (a FLOAT, b TEXT, c INTEGER);
CREATE TYPE public.tst_comp_enum_t AS (a FLOAT, b public.tst_enum_t, c INTEGER);
CREATE TYPE public.tst_comp_enum_array_t AS (a FLOAT, b public.tst_enum_t[], c INTEGER);
CREATE TABLE public.tst_one_comp (a INTEGER PRIMARY KEY, b public.tst_comp_basic_t);
CREATE TABLE public.tst_comps (a public.tst_comp_basic_t PRIMARY KEY, b public.tst_comp_basic_t[]);
CREATE TABLE public.tst_comp_enum (a INTEGER PRIMARY KEY, b public.tst_comp_enum_t);
CREATE TABLE public.tst_comp_enum_array (a public.tst_comp_enum_t PRIMARY KEY, b public.tst_comp_enum_t[]);
CREATE TABLE public.tst_comp_one_enum_array (a INTEGER PRIMARY KEY, b public.tst_comp_enum_array_t);
CREATE TABLE public.tst_comp_enum_what (
  a public.tst_comp_enum_array_t PRIMARY KEY, b public.tst_comp_enum_array_t[]);
CREATE TYPE public.tst_comp_mix_t AS (
  a public.tst_comp_basic_t, b public.tst_comp_basic_t[], c public.tst_enum_t, d public.tst_enum_t[]);
CREATE TABLE public.tst_comp_mix_array (a public.tst_comp_mix_t PRIMARY KEY, b public.tst_comp_mix_t[]);
CREATE TABLE public.tst_range (a INTEGER PRIMARY KEY, b int4range);
CREATE TABLE public.tst_range_array (a INTEGER PRIMARY KEY, b TSTZRANGE, c int8range[]);
"""

COLUMNS = {
    "tst_one_array": "a, b", "tst_arrays": "a, b, c, d", "tst_one_enum": "a, b", "tst_enums": "a, b",
    "tst_one_comp": "a, b", "tst_comps": "a, b", "tst_comp_enum": "a, b", "tst_comp_enum_array": "a, b",
    "tst_comp_one_enum_array": "a, b", "tst_comp_enum_what": "a, b", "tst_comp_mix_array": "a, b",
    "tst_range": "a, b", "tst_range_array": "a, b, c",
}
TABLES = list(COLUMNS)
AUG4 = "'Mon Aug 04 00:00:00 2014 CEST'::timestamptz"

INSERTS = [
    ("tst_one_array", "INSERT INTO tst_one_array (a, b) VALUES (1, '{1, 2, 3}'), (2, '{2, 3, 1}'),"
                      " (3, '{3, 2, 1}'), (4, '{4, 3, 2}'), (5, '{5, NULL, 3}')"),
    ("tst_arrays", """INSERT INTO tst_arrays (a, b, c, d) VALUES
       ('{1, 2, 3}', '{"a", "b", "c"}', '{1.1, 2.2, 3.3}', '{"1 day", "2 days", "3 days"}'),
       ('{2, 3, 1}', '{"b", "c", "a"}', '{2.2, 3.3, 1.1}', '{"2 minutes", "3 minutes", "1 minute"}'),
       ('{3, 1, 2}', '{"c", "a", "b"}', '{3.3, 1.1, 2.2}', '{"3 years", "1 year", "2 years"}'),
       ('{4, 1, 2}', '{"d", "a", "b"}', '{4.4, 1.1, 2.2}', '{"4 years", "1 year", "2 years"}'),
       ('{5, NULL, NULL}', '{"e", NULL, "b"}', '{5.5, 1.1, NULL}', '{"5 years", NULL, NULL}')"""),
    ("tst_one_enum", "INSERT INTO tst_one_enum (a, b) VALUES (1, 'a'), (2, 'b'), (3, 'c'), (4, 'd'),"
                     " (5, NULL)"),
    ("tst_enums", "INSERT INTO tst_enums (a, b) VALUES ('a', '{b, c}'), ('b', '{c, a}'), ('c', '{b, a}'),"
                  " ('d', '{c, b}'), ('e', '{d, NULL}')"),
    ("tst_one_comp", "INSERT INTO tst_one_comp (a, b) VALUES (1, ROW(1.0, 'a', 1)), (2, ROW(2.0, 'b', 2)),"
                     " (3, ROW(3.0, 'c', 3)), (4, ROW(4.0, 'd', 4)), (5, ROW(NULL, NULL, 5))"),
    ("tst_comps", """INSERT INTO tst_comps (a, b) VALUES
       (ROW(1.0, 'a', 1), ARRAY[ROW(1, 'a', 1)::tst_comp_basic_t]),
       (ROW(2.0, 'b', 2), ARRAY[ROW(2, 'b', 2)::tst_comp_basic_t]),
       (ROW(3.0, 'c', 3), ARRAY[ROW(3, 'c', 3)::tst_comp_basic_t]),
       (ROW(4.0, 'd', 4), ARRAY[ROW(4, 'd', 3)::tst_comp_basic_t]),
       (ROW(5.0, 'e', NULL), ARRAY[NULL, ROW(5, NULL, 5)::tst_comp_basic_t])"""),
    ("tst_comp_enum", "INSERT INTO tst_comp_enum (a, b) VALUES (1, ROW(1.0, 'a', 1)), (2, ROW(2.0, 'b', 2)),"
                      " (3, ROW(3.0, 'c', 3)), (4, ROW(4.0, 'd', 4)), (5, ROW(NULL, 'e', NULL))"),
    ("tst_comp_enum_array", """INSERT INTO tst_comp_enum_array (a, b) VALUES
       (ROW(1.0, 'a', 1), ARRAY[ROW(1, 'a', 1)::tst_comp_enum_t]),
       (ROW(2.0, 'b', 2), ARRAY[ROW(2, 'b', 2)::tst_comp_enum_t]),
       (ROW(3.0, 'c', 3), ARRAY[ROW(3, 'c', 3)::tst_comp_enum_t]),
       (ROW(4.0, 'd', 3), ARRAY[ROW(3, 'd', 3)::tst_comp_enum_t]),
       (ROW(5.0, 'e', 3), ARRAY[ROW(3, 'e', 3)::tst_comp_enum_t, NULL])"""),
    ("tst_comp_one_enum_array", """INSERT INTO tst_comp_one_enum_array (a, b) VALUES
       (1, ROW(1.0, '{a, b, c}', 1)), (2, ROW(2.0, '{a, b, c}', 2)), (3, ROW(3.0, '{a, b, c}', 3)),
       (4, ROW(4.0, '{c, b, d}', 4)), (5, ROW(5.0, '{NULL, e, NULL}', 5))"""),
    ("tst_comp_enum_what", """INSERT INTO tst_comp_enum_what (a, b) VALUES
       (ROW(1.0, '{a, b, c}', 1), ARRAY[ROW(1, '{a, b, c}', 1)::tst_comp_enum_array_t]),
       (ROW(2.0, '{b, c, a}', 2), ARRAY[ROW(2, '{b, c, a}', 1)::tst_comp_enum_array_t]),
       (ROW(3.0, '{c, a, b}', 1), ARRAY[ROW(3, '{c, a, b}', 1)::tst_comp_enum_array_t]),
       (ROW(4.0, '{c, b, d}', 4), ARRAY[ROW(4, '{c, b, d}', 4)::tst_comp_enum_array_t]),
       (ROW(5.0, '{c, NULL, b}', NULL), ARRAY[ROW(5, '{c, e, b}', 1)::tst_comp_enum_array_t])"""),
    ("tst_comp_mix_array", """INSERT INTO tst_comp_mix_array (a, b) VALUES
       (ROW(ROW(1,'a',1), ARRAY[ROW(1,'a',1)::tst_comp_basic_t, ROW(2,'b',2)::tst_comp_basic_t], 'a',
            '{a,b,NULL,c}'),
        ARRAY[ROW(ROW(1,'a',1), ARRAY[ROW(1,'a',1)::tst_comp_basic_t, ROW(2,'b',2)::tst_comp_basic_t, NULL],
                  'a', '{a,b,c}')::tst_comp_mix_t])"""),
    ("tst_range", "INSERT INTO tst_range (a, b) VALUES (1, '[1, 10]'), (2, '[2, 20]'), (3, '[3, 30]'),"
                  " (4, '[4, 40]'), (5, '[5, 50]')"),
    ("tst_range_array", f"""INSERT INTO tst_range_array (a, b, c) VALUES
       (1, tstzrange({AUG4}, 'infinity'), '{{"[1,2]", "[10,20]"}}'),
       (2, tstzrange({AUG4} - interval '2 days', {AUG4}), '{{"[2,3]", "[20,30]"}}'),
       (3, tstzrange({AUG4} - interval '3 days', {AUG4}), '{{"[3,4]"}}'),
       (4, tstzrange({AUG4} - interval '4 days', {AUG4}), '{{"[4,5]", NULL, "[40,50]"}}'),
       (5, NULL, NULL)"""),
]

# Each checked on b on its own, as the original reads the subscriber after each.
CHANGES = [
    ("tst_one_array", "UPDATE tst_one_array SET b = '{4, 5, 6}' WHERE a = 1"),
    ("tst_one_array", "UPDATE tst_one_array SET b = '{4, 5, 6, 1}' WHERE a > 3"),
    ("tst_one_array", "DELETE FROM tst_one_array WHERE a = 1"),
    ("tst_one_array", "DELETE FROM tst_one_array WHERE b = '{2, 3, 1}'"),
    ("tst_one_array", "DELETE FROM tst_one_array WHERE 1 = ANY(b)"),
    ("tst_arrays", """UPDATE tst_arrays SET b = '{"1a", "2b", "3c"}', c = '{1.0, 2.0, 3.0}',
       d = '{"1 day 1 second", "2 days 2 seconds", "3 days 3 second"}' WHERE a = '{1, 2, 3}'"""),
    ("tst_arrays", """UPDATE tst_arrays SET b = '{"c", "d", "e"}', c = '{3.0, 4.0, 5.0}',
       d = '{"3 day 1 second", "4 days 2 seconds", "5 days 3 second"}' WHERE a[1] > 3"""),
    ("tst_arrays", "DELETE FROM tst_arrays WHERE a = '{1, 2, 3}'"),
    ("tst_arrays", "DELETE FROM tst_arrays WHERE a[1] = 2"),
    ("tst_arrays", "DELETE FROM tst_arrays WHERE b[1] = 'c'"),
    ("tst_one_enum", "UPDATE tst_one_enum SET b = 'c' WHERE a = 1"),
    ("tst_one_enum", "UPDATE tst_one_enum SET b = NULL WHERE a > 3"),
    ("tst_one_enum", "DELETE FROM tst_one_enum WHERE a = 1"),
    ("tst_one_enum", "DELETE FROM tst_one_enum WHERE b = 'b'"),
    ("tst_enums", "UPDATE tst_enums SET b = '{e, NULL}' WHERE a = 'a'"),
    ("tst_enums", "UPDATE tst_enums SET b = '{e, d}' WHERE a > 'c'"),
    ("tst_enums", "DELETE FROM tst_enums WHERE a = 'a'"),
    ("tst_enums", "DELETE FROM tst_enums WHERE 'c' = ANY(b)"),
    ("tst_enums", "DELETE FROM tst_enums WHERE b[1] = 'b'"),
    ("tst_one_comp", "UPDATE tst_one_comp SET b = ROW(1.0, 'A', 1) WHERE a = 1"),
    ("tst_one_comp", "UPDATE tst_one_comp SET b = ROW(NULL, 'x', -1) WHERE a > 3"),
    ("tst_one_comp", "DELETE FROM tst_one_comp WHERE a = 1"),
    ("tst_one_comp", "DELETE FROM tst_one_comp WHERE (b).a = 2.0"),
    ("tst_comps", "UPDATE tst_comps SET b = ARRAY[ROW(9, 'x', -1)::tst_comp_basic_t] WHERE (a).a = 1.0"),
    ("tst_comps", "UPDATE tst_comps SET b = ARRAY[NULL, ROW(9, 'x', NULL)::tst_comp_basic_t]"
                  " WHERE (a).a > 3.9"),
    ("tst_comps", "DELETE FROM tst_comps WHERE (a).b = 'a'"),
    ("tst_comps", "DELETE FROM tst_comps WHERE (b[1]).a = 2.0"),
    ("tst_comps", "DELETE FROM tst_comps WHERE ROW(3, 'c', 3)::tst_comp_basic_t = ANY(b)"),
    ("tst_comp_enum", "UPDATE tst_comp_enum SET b = ROW(1.0, NULL, NULL) WHERE a = 1"),
    ("tst_comp_enum", "UPDATE tst_comp_enum SET b = ROW(4.0, 'd', 44) WHERE a > 3"),
    ("tst_comp_enum", "DELETE FROM tst_comp_enum WHERE a = 1"),
    ("tst_comp_enum", "DELETE FROM tst_comp_enum WHERE (b).a = 2.0"),
    ("tst_comp_enum_array", "UPDATE tst_comp_enum_array SET b = ARRAY[NULL, ROW(3, 'd', 3)::tst_comp_enum_t]"
                            " WHERE a = ROW(1.0, 'a', 1)::tst_comp_enum_t"),
    ("tst_comp_enum_array", "UPDATE tst_comp_enum_array SET b = ARRAY[ROW(1, 'a', 1)::tst_comp_enum_t,"
                            " ROW(2, 'b', 2)::tst_comp_enum_t] WHERE (a).a > 3"),
    ("tst_comp_enum_array", "DELETE FROM tst_comp_enum_array WHERE a = ROW(1.0, 'a', 1)::tst_comp_enum_t"),
    ("tst_comp_enum_array", "DELETE FROM tst_comp_enum_array WHERE (b[1]).b = 'b'"),
    ("tst_comp_enum_array", "DELETE FROM tst_comp_enum_array WHERE ROW(3, 'c', 3)::tst_comp_enum_t = ANY(b)"),
    ("tst_comp_one_enum_array", "UPDATE tst_comp_one_enum_array SET b = ROW(1.0, '{a, e, c}', NULL)"
                                " WHERE a = 1"),
    ("tst_comp_one_enum_array", "UPDATE tst_comp_one_enum_array SET b = ROW(4.0, '{c, b, d}', 4)"
                                " WHERE a > 3"),
    ("tst_comp_one_enum_array", "DELETE FROM tst_comp_one_enum_array WHERE a = 1"),
    ("tst_comp_one_enum_array", "DELETE FROM tst_comp_one_enum_array WHERE (b).c = 2"),
    ("tst_comp_one_enum_array", "DELETE FROM tst_comp_one_enum_array WHERE 'a' = ANY((b).b)"),
    ("tst_comp_enum_what", "UPDATE tst_comp_enum_what SET b = ARRAY[NULL,"
                           " ROW(1, '{a, b, c}', 1)::tst_comp_enum_array_t,"
                           " ROW(NULL, '{a, e, c}', 2)::tst_comp_enum_array_t] WHERE (a).a = 1"),
    ("tst_comp_enum_what", "UPDATE tst_comp_enum_what"
                           " SET b = ARRAY[ROW(5, '{a, b, c}', 5)::tst_comp_enum_array_t]"
                           " WHERE (a).a > 3"),
    ("tst_comp_enum_what", "DELETE FROM tst_comp_enum_what WHERE (a).a = 1"),
    ("tst_comp_enum_what", "DELETE FROM tst_comp_enum_what WHERE (b[1]).a = 2"),
    ("tst_comp_enum_what", "DELETE FROM tst_comp_enum_what WHERE (b[1]).b = '{c, a, b}'"),
    ("tst_comp_mix_array", "UPDATE tst_comp_mix_array SET b[2] = NULL WHERE ((a).a).a = 1"),
    ("tst_comp_mix_array", "DELETE FROM tst_comp_mix_array WHERE ((a).a).a = 1"),
    ("tst_range", "UPDATE tst_range SET b = '[100, 1000]' WHERE a = 1"),
    ("tst_range", "UPDATE tst_range SET b = '(1, 90)' WHERE a > 3"),
    ("tst_range", "DELETE FROM tst_range WHERE a = 1"),
    ("tst_range", "DELETE FROM tst_range WHERE b = '[2, 20]'"),
    ("tst_range", "DELETE FROM tst_range WHERE '[10,20]' && b"),
    ("tst_range_array", "UPDATE tst_range_array SET c = '{\"[100, 1000]\"}' WHERE a = 1"),
    ("tst_range_array", f"UPDATE tst_range_array SET b = tstzrange({AUG4}, 'infinity'),"
                        " c = '{NULL, \"[11,9999999]\"}' WHERE a > 3"),
    ("tst_range_array", "DELETE FROM tst_range_array WHERE a = 1"),
    ("tst_range_array", "DELETE FROM tst_range_array"
                        f" WHERE b = tstzrange({AUG4} - interval '2 days', {AUG4})"),
    ("tst_range_array", f"DELETE FROM tst_range_array WHERE tstzrange({AUG4},"
                        " 'Mon Aug 05 00:00:00 2014 CEST'::timestamptz) && b"),
]

DROP = """
DROP TABLE public.tst_one_array CASCADE;
DROP TABLE public.tst_arrays CASCADE;
DROP TABLE public.tst_one_enum CASCADE;
DROP TABLE public.tst_enums CASCADE;
DROP TABLE public.tst_one_comp CASCADE;
DROP TABLE public.tst_comps CASCADE;
DROP TABLE public.tst_comp_enum CASCADE;
DROP TABLE public.tst_comp_enum_array CASCADE;
DROP TABLE public.tst_comp_one_enum_array CASCADE;
DROP TABLE public.tst_comp_enum_what CASCADE;
DROP TABLE public.tst_comp_mix_array CASCADE;
DROP TABLE public.tst_range CASCADE;
DROP TABLE public.tst_range_array CASCADE;
DROP TYPE public.tst_comp_mix_t;
DROP TYPE public.tst_comp_enum_array_t;
DROP TYPE public.tst_comp_enum_t;
DROP TYPE public.tst_comp_basic_t;
DROP TYPE public.tst_enum_t;
"""


async def _rows(dsn: str, table: str) -> list[tuple[Any, ...]]:
    cells = ", ".join(f"{c.strip()}::text" for c in COLUMNS[table].split(","))
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(f'SELECT {cells} FROM "{table}" ORDER BY a')
        return await cur.fetchall()


async def _same(m: Any, router: Any, table: str, statement: str) -> None:
    a, b = m.nodes

    async def check() -> bool:
        healthy(router)
        return await _rows(a.dsn(), table) == await _rows(b.dsn(), table)

    await wait_for(check, f"{table} equal on both nodes after: {statement}", 60)


async def _equal(m: Any, router: Any, what: str) -> None:
    async def check() -> bool:
        healthy(router)
        return await converged(m.nodes, TABLES)

    await wait_for(check, what, 120)


async def test_extended(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), DDL)
        tables = "SELECT count(*) FROM pg_tables WHERE schemaname = 'public' AND tablename LIKE 'tst\\_%'"

        async def made() -> bool:
            return await fetch(b.dsn(), tables) == [(len(TABLES),)]

        await wait_for(made, "the tables made by DDL on a, on b", 60)
        for _, statement in INSERTS:
            await execute(a.dsn(), statement)
        await _equal(m, router, "the inserts on b")
        assert [len(await _rows(b.dsn(), t)) for t in TABLES] == [5] * 10 + [1, 5, 5]
        for table, statement in CHANGES:
            await execute(a.dsn(), statement)
            await _same(m, router, table, statement)
        left = {t: len(await _rows(b.dsn(), t)) for t in TABLES}
        assert left == {
            "tst_one_array": 0, "tst_arrays": 0, "tst_one_enum": 3, "tst_enums": 2, "tst_one_comp": 3,
            "tst_comps": 2, "tst_comp_enum": 3, "tst_comp_enum_array": 2, "tst_comp_one_enum_array": 2,
            "tst_comp_enum_what": 2, "tst_comp_mix_array": 0, "tst_range": 0, "tst_range_array": 1,
        }, left

        # VACUUM FULL gives the table new files; changes after it still replicate, from both nodes
        await execute(a.dsn(), "VACUUM FULL tst_one_array")
        await execute(a.dsn(), "INSERT INTO tst_one_array VALUES (10, '{10}'), (11, NULL)")
        await execute(b.dsn(), "VACUUM FULL tst_comps",
                      "UPDATE tst_one_array SET b = b || 11 WHERE a = 10",
                      "INSERT INTO tst_comps VALUES (ROW(7.5, 'g', 7), '{}')",
                      "UPDATE tst_comps SET b = b || ROW(0, 'b', 0)::tst_comp_basic_t",
                      "DELETE FROM tst_comp_enum_array WHERE (a).a = 4.0",
                      "INSERT INTO tst_comp_mix_array VALUES (ROW(ROW(2, 'b', 2), NULL, 'e', '{}'), NULL)",
                      "UPDATE tst_enums SET b = b || 'a'::tst_enum_t")
        await _equal(m, router, "the writes after VACUUM FULL and on b, on both nodes")

        # the same rows (composite, nested composite and enum keys) written on both nodes at once
        await router.pause(None)
        await execute(a.dsn(), "UPDATE tst_comps SET b = ARRAY[ROW(1, 'a', 1)::tst_comp_basic_t]",
                      "UPDATE tst_comp_mix_array SET b = ARRAY[NULL::tst_comp_mix_t]",
                      "UPDATE tst_enums SET b = '{a}'", "DELETE FROM tst_comp_enum_what WHERE (a).a = 2",
                      "INSERT INTO tst_comp_enum_array VALUES (ROW(9, 'e', 9), '{}')")
        await execute(b.dsn(), "UPDATE tst_comps SET b = NULL",
                      "UPDATE tst_comp_mix_array SET b = '{}'",
                      "UPDATE tst_enums SET b = '{b}'",
                      "UPDATE tst_comp_enum_what SET b = '{}' WHERE (a).a = 2",
                      "INSERT INTO tst_comp_enum_array VALUES (ROW(9, 'e', 9), NULL)")
        await router.resume(None)
        await _equal(m, router, "both nodes equal after writing the same rows on both")

        # dropping every table and type replicates
        await execute(a.dsn(), DROP)
        gone = ("SELECT count(*) FROM pg_type WHERE typnamespace = 'public'::regnamespace"
                " AND typname LIKE 'tst\\_%'")

        async def dropped() -> bool:
            healthy(router)
            return await fetch(b.dsn(), tables) == [(0,)] and await fetch(b.dsn(), gone) == [(0,)]

        await wait_for(dropped, "every table and type dropped on b", 60)
