"""pglogical's functions.sql, ported to a two-node pgmesh mesh with the router running (issue 17).

Defaults computed by immutable and volatile functions and by nextval(), an empty transaction, columns
added on one node, a NOT NULL column added on one node, and a domain whose CHECK calls SQL functions.

pgmesh keeps one schema on every node: a column added on b is added on a too, so the original's
"subscriber has extra columns" cases become "the other node has them as well", and the NOT NULL column
that broke pglogical's apply is refused where the row is written instead (nothing breaks a link). The
original's keyless insert-only tables get REPLICA IDENTITY FULL, which pgmesh asks for (docs/ddl.md);
the keyless shape itself is in test_pglogical_foreign_key.py. Inserts run on both nodes.
"""

from __future__ import annotations

import datetime

import psycopg
import pytest

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import has, healthy, same_rows

ADD = """CREATE FUNCTION public.add(integer, integer) RETURNS integer
    AS 'select $1 + $2;'
    LANGUAGE SQL
    IMMUTABLE
    RETURNS NULL ON NULL INPUT"""
CENTURY = """create or replace function public.get_curr_century() returns double precision as
 'SELECT EXTRACT(CENTURY FROM NOW());'
language sql volatile"""
PRIMES = [
    """CREATE FUNCTION public.some_prime_numbers() RETURNS SETOF integer
    LANGUAGE sql IMMUTABLE STRICT LEAKPROOF
    AS $_$
  VALUES (2), (3), (5), (7), (11), (13), (17), (19), (23), (29), (31), (37), (41), (43), (47), (53), (59),
         (61), (67), (71), (73), (79), (83), (89), (97)
$_$""",
    """CREATE FUNCTION public.is_prime_lt_100(integer) RETURNS boolean
    LANGUAGE sql IMMUTABLE STRICT LEAKPROOF
    AS $_$
  SELECT EXISTS (SELECT FROM public.some_prime_numbers() s(p) WHERE p = $1)
$_$""",
    """CREATE DOMAIN public.prime AS integer
CONSTRAINT prime_check CHECK(public.is_prime_lt_100(VALUE))""",
    """CREATE TABLE public.prime_tbl (
    num public.prime NOT NULL,
    PRIMARY KEY(num)
)""",
]


def exists(name: str) -> str:
    return f"SELECT to_regclass('{name}') IS NOT NULL"


async def test_function_defaults(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), ADD)
        await execute(a.dsn(), "CREATE TABLE public.funct2("
                               "a integer, b integer, c integer DEFAULT public.add(10,12))",
                      "ALTER TABLE public.funct2 REPLICA IDENTITY FULL")
        await execute(a.dsn(), CENTURY)
        await execute(a.dsn(), "CREATE TABLE public.funct5("
                               "a integer, b integer, c double precision DEFAULT public.get_curr_century())",
                      "ALTER TABLE public.funct5 REPLICA IDENTITY FULL")
        await execute(a.dsn(), "CREATE SEQUENCE public.INSERT_SEQ")
        await execute(a.dsn(), "CREATE TABLE public.funct ("
                               "a integer, b INT DEFAULT nextval('public.insert_seq'))",
                      "ALTER TABLE public.funct REPLICA IDENTITY FULL")
        full = ("SELECT count(*) = 3 FROM pg_class WHERE relname IN ('funct2', 'funct5', 'funct')"
                " AND relreplident = 'f'")
        await wait_for(lambda: has(b.dsn(), full, [(True,)]), "the tables on b, REPLICA IDENTITY FULL")

        await execute(a.dsn(), "INSERT INTO public.funct2(a,b) VALUES (1,2)")  # c should be 22
        await execute(a.dsn(), "INSERT INTO public.funct2(a,b,c) VALUES (3,4,5)")  # c should be 5
        await execute(b.dsn(), "INSERT INTO public.funct2(a,b) VALUES (10,20)")
        await execute(a.dsn(), "INSERT INTO public.funct5(a,b) VALUES (1,2)")  # c: this century
        await execute(a.dsn(), "INSERT INTO public.funct5(a,b,c) VALUES (3,4,20)")  # c should be 20
        await execute(b.dsn(), "INSERT INTO public.funct5(a,b) VALUES (10,20)")
        for i in (1, 2, 3):
            await execute(a.dsn(), f"INSERT INTO public.funct (a) VALUES ({i})")
        await execute(b.dsn(), "INSERT INTO public.funct (a) VALUES (10)")  # b's own sequence: 1
        async with await psycopg.AsyncConnection.connect(a.dsn()) as conn:  # an empty transaction
            await conn.execute("BEGIN")
            await conn.commit()
        await wait_converged(m.nodes, ["funct2", "funct5", "funct"])

        assert await fetch(b.dsn(), "SELECT a, b, c FROM funct2 ORDER BY a") == [
            (1, 2, 22), (3, 4, 5), (10, 20, 22)]
        century = float((datetime.datetime.now(datetime.UTC).year - 1) // 100 + 1)
        assert await fetch(b.dsn(), "SELECT a, b, c FROM funct5 ORDER BY a") == [
            (1, 2, century), (3, 4, 20.0), (10, 20, century)]
        # the default is computed where the row is written: each node's sequence counts on its own
        assert await fetch(b.dsn(), "SELECT a, b FROM funct ORDER BY a") == [(1, 1), (2, 2), (3, 3), (10, 1)]
        healthy(router)


async def test_added_columns(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "CREATE TABLE public.nullcheck_tbl("
                               "id integer PRIMARY KEY, id1 integer, name text)")
        await wait_for(lambda: has(b.dsn(), exists("public.nullcheck_tbl"), [(True,)]), "nullcheck_tbl on b")
        await execute(a.dsn(), "INSERT INTO public.nullcheck_tbl(id,id1,name) VALUES (1,1,'name1')")
        await execute(a.dsn(), "INSERT INTO public.nullcheck_tbl(id,id1,name) VALUES (2,2,'name2')")
        rows = "SELECT * FROM public.nullcheck_tbl ORDER BY id"
        assert await same_rows(a, b, rows, "rows 1, 2 on b") == [(1, 1, "name1"), (2, 2, "name2")]

        await execute(b.dsn(), "ALTER TABLE public.nullcheck_tbl ADD COLUMN name1 text")
        await execute(a.dsn(), "INSERT INTO public.nullcheck_tbl(id,id1,name) VALUES (3,3,'name3')")
        await execute(a.dsn(), "INSERT INTO public.nullcheck_tbl(id,id1,name) VALUES (4,4,'name4')")
        await execute(a.dsn(), "UPDATE public.nullcheck_tbl SET name='name31' where id = 3")
        await execute(b.dsn(), "INSERT INTO public.nullcheck_tbl(id,id1,name) VALUES (6,6,'name6')")
        await wait_converged(m.nodes, ["nullcheck_tbl"])
        assert await fetch(a.dsn(), rows) == [
            (1, 1, "name1", None), (2, 2, "name2", None), (3, 3, "name31", None), (4, 4, "name4", None),
            (6, 6, "name6", None),
        ]

        # a NOT NULL column added on b: the same constraint holds on a, where the insert is refused
        await execute(a.dsn(), "CREATE TABLE public.not_nullcheck_tbl("
                               "id integer PRIMARY KEY, id1 integer, name text)")
        made = exists("public.not_nullcheck_tbl")
        await wait_for(lambda: has(b.dsn(), made, [(True,)]), "not_nullcheck_tbl on b")
        await execute(b.dsn(), "ALTER TABLE public.not_nullcheck_tbl ADD COLUMN id2 integer not null")
        attnotnull = ("SELECT attnotnull FROM pg_attribute"
                      " WHERE attrelid = to_regclass('public.not_nullcheck_tbl') AND attname = 'id2'")
        await wait_for(lambda: has(a.dsn(), attnotnull, [(True,)]), "id2 NOT NULL on a")
        for node, i in ((a, 1), (a, 2), (b, 3)):
            with pytest.raises(psycopg.errors.NotNullViolation, match="id2"):
                await execute(node.dsn(), "INSERT INTO public.not_nullcheck_tbl(id,id1,name)"
                                          f" VALUES ({i},{i},'name{i}')")
        await execute(b.dsn(), "ALTER TABLE public.not_nullcheck_tbl ALTER COLUMN id2 SET default 99")
        default = ("SELECT pg_get_expr(adbin, adrelid) FROM pg_attrdef"
                   " WHERE adrelid = to_regclass('public.not_nullcheck_tbl')")
        await wait_for(lambda: has(a.dsn(), default, [("99",)]), "id2's default on a")
        await execute(a.dsn(), "INSERT INTO public.not_nullcheck_tbl(id,id1,name) VALUES (4,4,'name4')")
        with pytest.raises(psycopg.errors.DuplicateColumn):  # a's own ADD COLUMN: b's is there already
            await execute(a.dsn(), "ALTER TABLE public.not_nullcheck_tbl"
                                   " ADD COLUMN id2 integer not null default 0")
        await execute(a.dsn(), "INSERT INTO public.not_nullcheck_tbl(id,id1,name) VALUES (5,5,'name5')")
        await wait_converged(m.nodes, ["not_nullcheck_tbl"])
        assert await fetch(b.dsn(), "SELECT * FROM public.not_nullcheck_tbl ORDER BY id") == [
            (4, 4, "name4", 99), (5, 5, "name5", 99)]
        healthy(router)


async def test_domain_with_function_check(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        for statement in PRIMES:  # one statement at a time, as psql sends a script
            await execute(a.dsn(), statement)
        await execute(a.dsn(), "INSERT INTO public.prime_tbl (num) VALUES(17), (31), (79)")
        await wait_for(lambda: has(b.dsn(), exists("public.prime_tbl"), [(True,)]), "prime_tbl on b")
        await execute(a.dsn(), "DELETE FROM public.prime_tbl WHERE num = 31")
        await execute(b.dsn(), "INSERT INTO public.prime_tbl (num) VALUES (2)")
        with pytest.raises(psycopg.errors.CheckViolation, match="prime_check"):
            await execute(b.dsn(), "INSERT INTO public.prime_tbl (num) VALUES (4)")
        await wait_converged(m.nodes, ["prime_tbl"])
        assert await fetch(b.dsn(), "SELECT num FROM public.prime_tbl ORDER BY num") == [(2,), (17,), (79,)]

        for statement in (
            "DROP TABLE public.prime_tbl CASCADE", "DROP DOMAIN public.prime",
            "DROP FUNCTION public.is_prime_lt_100(integer)", "DROP FUNCTION public.some_prime_numbers()",
        ):
            await execute(a.dsn(), statement)
        gone = "SELECT count(*) FROM pg_proc WHERE proname IN ('is_prime_lt_100', 'some_prime_numbers')"
        await wait_for(lambda: has(b.dsn(), gone, [(0,)]), "the functions dropped on b")
        healthy(router)


async def test_domain_and_rows_in_one_query_string(mesh: MeshFactory) -> None:
    """The original's exact shape: functions, domain, table and its rows in one query string (pglogical's
    replicate_ddl_command). The other nodes would replay the string whole and write the rows a second
    time, so it is refused where it is sent, with a hint (docs/ddl.md, "One query string with DDL and
    DML"), and nothing of it is kept; the same statements sent one by one replicate once."""
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        rows = "INSERT INTO public.prime_tbl (num) VALUES(17), (31), (79)"
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="also writes rows") as refused:
            await execute(a.dsn(), ";\n".join([*PRIMES, rows]))
        assert "separate statements" in (refused.value.diag.message_hint or "")
        assert await fetch(a.dsn(), exists("public.prime_tbl")) == [(False,)]
        for statement in [*PRIMES, rows]:
            await execute(a.dsn(), statement)
        await wait_for(lambda: has(b.dsn(), exists("public.prime_tbl"), [(True,)]), "prime_tbl on b")
        await execute(a.dsn(), "DELETE FROM public.prime_tbl WHERE num = 31")
        await wait_converged(m.nodes, ["prime_tbl"])
        assert await fetch(b.dsn(), "SELECT num FROM public.prime_tbl ORDER BY num") == [(17,), (79,)]
        assert router.appliers[("a", "b")].stats.conflicts == 0
        healthy(router)
