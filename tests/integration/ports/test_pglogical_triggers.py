"""pglogical's triggers.sql, ported to a two-node pgmesh mesh with the router running (issue 17).

User triggers and pgmesh: the applier runs with `session_replication_role = replica`, so an ordinary
trigger fires where the user writes and not where the change is applied (each change is counted once in
the cluster), and a trigger made `ENABLE REPLICA` fires where changes are applied. pgmesh replicates the
CREATE FUNCTION / CREATE TRIGGER / ALTER TABLE ... ENABLE REPLICA TRIGGER too, so the trigger is on every
node (pglogical's test makes it on the subscriber only).

The history table is outside the replicated set (config `exclude`): each node keeps the history of what
its trigger saw. The second part is pglogical's row filter by trigger: an `ENABLE REPLICA` BEFORE trigger
that returns NULL for some rows makes each node skip those rows when they come from the other node. The
nodes then differ on purpose (the user asked for it), and no link stops on a skipped row.
"""

from __future__ import annotations

from typing import Any

import psycopg

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import healthy

HIST_FN = """CREATE FUNCTION test_trg_data_hist_fn() RETURNS TRIGGER AS $$
BEGIN
    IF (TG_OP = 'UPDATE') THEN
        INSERT INTO test_trg_hist (table_name,action,original_data,new_data)
        VALUES (TG_TABLE_NAME::TEXT, substring(TG_OP,1,1), ROW(OLD.*), ROW(NEW.*));
        RETURN NEW;
    ELSIF (TG_OP = 'DELETE') THEN
        INSERT INTO test_trg_hist (table_name,action,original_data)
        VALUES (TG_TABLE_NAME::TEXT, substring(TG_OP,1,1), ROW(OLD.*));
        RETURN OLD;
    ELSIF (TG_OP = 'INSERT') THEN
        INSERT INTO test_trg_hist (table_name,action,new_data)
        VALUES (TG_TABLE_NAME::TEXT, substring(TG_OP,1,1), ROW(NEW.*));
        RETURN NEW;
    ELSE
        RAISE WARNING 'Unknown action';
        RETURN NULL;
    END IF;
END;
$$ LANGUAGE plpgsql"""

FILTER_FN = """CREATE FUNCTION filter_basic_dml_fn() RETURNS TRIGGER AS $$
BEGIN
    IF (TG_OP in ('UPDATE', 'INSERT')) THEN
-- treating 'DELETE' as pass-through
        IF (NEW.id > 1 AND NEW.data IS DISTINCT FROM 'baz' AND NEW.data IS DISTINCT FROM 'bbb') THEN
            RETURN NEW;
        ELSE
            RETURN NULL;
        END IF;
    ELSE
        RAISE WARNING 'Unknown action';
        RETURN NULL;
    END IF;
END;
$$ LANGUAGE plpgsql"""

HIST = "SELECT action, original_data, new_data FROM test_trg_hist ORDER BY action_id"


async def _true(node: Any, query: str) -> bool:
    return bool(await fetch(node.dsn(), query) == [(True,)])


async def test_history_trigger(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, replication='exclude = ["public.test_trg_hist"]')
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "CREATE TABLE public.test_trg_data(id serial primary key, data text)")
        made = "SELECT to_regclass('test_trg_data') IS NOT NULL"
        await wait_for(lambda: _true(b, made), "test_trg_data on b")
        await execute(b.dsn(), "CREATE TABLE test_trg_hist("
                               "table_name text, action text, action_id serial,"
                               " original_data text, new_data text)")
        await execute(b.dsn(), HIST_FN)
        await execute(b.dsn(), "CREATE TRIGGER test_trg_data_hist_trg AFTER INSERT OR UPDATE OR DELETE"
                               " ON test_trg_data FOR EACH ROW EXECUTE PROCEDURE test_trg_data_hist_fn()")
        trigger = "SELECT EXISTS (SELECT FROM pg_trigger WHERE tgname = 'test_trg_data_hist_trg')"
        await wait_for(lambda: _true(a, trigger), "the trigger on a")

        # an ordinary trigger: fires on a, where the row is written; not on b, where it is applied
        await execute(a.dsn(), "INSERT INTO test_trg_data(data) VALUES ('no_history')")
        await wait_converged(m.nodes, ["test_trg_data"])
        assert await fetch(b.dsn(), "SELECT id, data FROM test_trg_data") == [(1, "no_history")]
        assert await fetch(b.dsn(), HIST) == []
        assert await fetch(a.dsn(), HIST) == [("I", None, "(1,no_history)")]

        # ENABLE REPLICA: fires where changes are applied (the ALTER reaches a too)
        await execute(b.dsn(), "ALTER TABLE test_trg_data ENABLE REPLICA TRIGGER test_trg_data_hist_trg")
        enabled = "SELECT tgenabled = 'R' FROM pg_trigger WHERE tgname = 'test_trg_data_hist_trg'"
        await wait_for(lambda: _true(a, enabled), "ENABLE REPLICA on a")
        await execute(a.dsn(), "INSERT INTO test_trg_data(data) VALUES ('yes_history')")
        await execute(a.dsn(), "UPDATE test_trg_data SET data = 'yes_history'")
        await execute(a.dsn(), "DELETE FROM test_trg_data")
        await execute(b.dsn(), "INSERT INTO test_trg_data VALUES (10, 'from b')")
        await wait_converged(m.nodes, ["test_trg_data"])
        five = "SELECT count(*) = 5 FROM test_trg_hist"
        await wait_for(lambda: _true(b, five), "b's history of a's changes")
        assert sorted(await fetch(b.dsn(), HIST), key=str) == sorted([
            ("I", None, "(2,yes_history)"),
            ("U", "(1,no_history)", "(1,yes_history)"),
            ("U", "(2,yes_history)", "(2,yes_history)"),
            ("D", "(1,yes_history)", None),
            ("D", "(2,yes_history)", None),
        ], key=str)
        two = "SELECT count(*) = 2 FROM test_trg_hist"
        await wait_for(lambda: _true(a, two), "a's history of b's insert")
        assert await fetch(a.dsn(), HIST) == [("I", None, "(1,no_history)"), ("I", None, '(10,"from b")')]
        healthy(router)


async def test_filter_trigger(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "CREATE TABLE public.basic_dml ("
                               "id serial primary key, other integer, data text, something interval)")
        await wait_for(lambda: _true(b, "SELECT to_regclass('basic_dml') IS NOT NULL"), "basic_dml on b")
        await execute(b.dsn(), FILTER_FN)
        await execute(b.dsn(), "CREATE TRIGGER filter_basic_dml_trg BEFORE INSERT OR UPDATE ON basic_dml"
                               " FOR EACH ROW EXECUTE PROCEDURE filter_basic_dml_fn()")
        made = "SELECT EXISTS (SELECT FROM pg_trigger WHERE tgname = 'filter_basic_dml_trg')"
        await wait_for(lambda: _true(a, made), "the trigger on a")

        # not enabled for replica yet: every copied row reaches b (the trigger fires on a: 5001 'bbb' is
        # filtered where it is written)
        async with (
            await psycopg.AsyncConnection.connect(a.dsn(), autocommit=True) as conn,
            conn.cursor().copy("COPY basic_dml FROM STDIN WITH CSV") as copy,
        ):
            await copy.write("5000,1,aaa,1 hour\n5001,2,bbb,2 years\n"
                             "5002,3,ccc,3 minutes\n5003,4,ddd,4 days\n")
        await wait_converged(m.nodes, ["basic_dml"])
        assert await fetch(b.dsn(), "SELECT id, data FROM basic_dml ORDER BY id") == [
            (5000, "aaa"), (5002, "ccc"), (5003, "ddd")]

        await execute(b.dsn(), "ALTER TABLE basic_dml ENABLE REPLICA TRIGGER filter_basic_dml_trg")
        enabled = "SELECT tgenabled = 'R' FROM pg_trigger WHERE tgname = 'filter_basic_dml_trg'"
        await wait_for(lambda: _true(a, enabled), "ENABLE REPLICA on a")
        await execute(a.dsn(), "TRUNCATE basic_dml")
        await execute(a.dsn(), """INSERT INTO basic_dml(other, data, something)
            VALUES (5, 'foo', '1 minute'::interval),
                   (4, 'bar', '12 weeks'::interval),
                   (3, 'baz', '2 years 1 hour'::interval),
                   (2, 'qux', '8 months 2 days'::interval),
                   (1, NULL, NULL)""")
        await execute(b.dsn(), "INSERT INTO basic_dml VALUES (100, 0, 'baz', NULL), (101, 0, 'b', NULL)")
        marker = "SELECT EXISTS (SELECT FROM basic_dml WHERE id = 101)"
        await wait_for(lambda: _true(a, marker), "b's rows on a")
        await wait_for(lambda: _true(b, "SELECT count(*) = 5 FROM basic_dml"), "a's rows, filtered, on b")
        # rows filtered on apply, on each node: 1 (id) and 3 ('baz') on b, 100 ('baz') on a
        assert await fetch(b.dsn(), "SELECT id, data FROM basic_dml ORDER BY id") == [
            (2, "bar"), (4, "qux"), (5, None), (100, "baz"), (101, "b")]
        assert await fetch(a.dsn(), "SELECT id, data FROM basic_dml ORDER BY id") == [
            (1, "foo"), (2, "bar"), (3, "baz"), (4, "qux"), (5, None), (101, "b")]
        healthy(router)
