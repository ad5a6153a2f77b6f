"""DDL as people and migration tools write it, typed on one node of three with the router running: a
query string mixing writes and DDL, ADD COLUMN with a default each node would compute itself (serial,
identity, now()), enum labels added on two nodes at once, a partition detached and written afterwards,
and CREATE TABLE's messages. Each ends with every node identical, or a loud refusal with a hint.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import psycopg
import pytest

from router.testing.mesh import execute, fetch, free_port, running_router, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.real_use.users import pgmesh, psql, wait_identical

PGBENCH_LIKE = """
CREATE TABLE pgbench_branches (bid int PRIMARY KEY, bbalance int, filler char(88));
CREATE TABLE pgbench_history (tid int, bid int, aid int, delta int, mtime timestamp, filler char(22));
INSERT INTO pgbench_branches SELECT g, 0 FROM generate_series(1, 5) g;
"""


def refused(done: Any, *words: str) -> str:
    """psql's stderr, asserted to be pgmesh's refusal holding `words` and a hint."""
    assert done.returncode != 0, done.stdout
    for word in ("pgmesh:", "HINT:", *words):
        assert word in done.stderr, (word, done.stderr)
    return str(done.stderr)


async def typed(node: Any, text: str, *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`psql -c TEXT` in a thread: the router runs in this test's event loop, and a statement waiting for a
    lock one of its sessions holds would otherwise wait for ever."""
    return await asyncio.to_thread(psql, node, text, check=check)


async def no_link_error(router: Any) -> None:
    errors = {k: a.last_error for k, a in router.appliers.items() if a.last_error is not None}
    assert not errors, errors


async def test_dml_and_ddl_in_one_query_string(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=PGBENCH_LIKE + "CREATE TABLE keyed (id int PRIMARY KEY, v text);")
    a, b, c = m.nodes
    async with running_router(m.config) as router:
        # as the issue typed it: without the refusal b and c got the row twice (once replicated, once
        # when they replayed the string), and with a key their links stopped for good
        done = await typed(a, "insert into pgbench_history (tid, bid, aid, delta, mtime) values"
                              " (1, 1, 1, 5, now()); alter table pgbench_branches add column memo text",
                           check=False)
        refused(done, "ALTER TABLE refused", "insert into pgbench_history", "separate statements")
        done = await typed(a, "ALTER TABLE keyed ADD COLUMN memo text;"
                              " INSERT INTO keyed VALUES (1, 'one', 'm')", check=False)
        refused(done, "insert into keyed")
        done = await typed(a, "CREATE TABLE made (id int PRIMARY KEY); SELECT nextval('made_seq')",
                           check=False)
        refused(done, "select nextval")
        done = await typed(a, "DO $$ BEGIN CREATE TABLE d (id int PRIMARY KEY); INSERT INTO d VALUES (1);"
                              " END $$", check=False)
        refused(done, "a block that writes rows")
        # the same work as separate statements, in one transaction: replicated once
        async with await psycopg.AsyncConnection.connect(a.dsn()) as conn:
            await conn.execute("INSERT INTO pgbench_history (tid, bid, aid, delta, mtime)"
                               " VALUES (1, 1, 1, 5, '2026-01-01')")
            await conn.execute("ALTER TABLE pgbench_branches ADD COLUMN memo text")
            await conn.execute("INSERT INTO keyed VALUES (1, 'one')")
            await conn.execute("ALTER TABLE keyed ADD COLUMN memo text")
            await conn.execute("UPDATE keyed SET memo = 'm'")
        # what migration tools send as one string, which writes nothing: replayed once, as the same string
        await typed(b, "SET search_path TO public; CREATE TABLE mig (id int PRIMARY KEY, v text)")
        await typed(b, "SELECT pg_catalog.set_config('search_path', '', false);"
                       " CREATE TABLE public.mig2 (id int PRIMARY KEY);"
                       " CREATE INDEX mig2_id ON public.mig2 (id); SELECT 1")
        await typed(c, "CREATE FUNCTION note(t text) RETURNS void LANGUAGE plpgsql AS $f$"
                       " BEGIN INSERT INTO keyed VALUES (length(t), t); END $f$;"
                       " CREATE TABLE after_fn (id int PRIMARY KEY) -- ; insert")
        await typed(c, "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_type WHERE typname = 'kind') THEN"
                       " CREATE TYPE kind AS ENUM ('x', 'y'); END IF; END $$")
        await typed(a, "COMMENT ON TABLE keyed IS 'insert into keyed; delete';"
                       " ALTER TABLE keyed ADD COLUMN w int")
        # every CREATE TABLE went quietly: no NOTICE about a trigger that did not exist
        created = await typed(b, "CREATE TABLE quiet (id int PRIMARY KEY, v text)")
        assert "NOTICE" not in created.stderr, created.stderr
        await wait_for(lambda: _has(c, "SELECT to_regclass('mig') IS NOT NULL AND EXISTS (SELECT FROM"
                                       " pg_attribute WHERE attrelid = 'keyed'::regclass AND attname = 'w')"),
                       "b's table and a's column on c")
        await typed(c, "INSERT INTO mig VALUES (1, 'c'); INSERT INTO keyed VALUES (2, 'two', 'm2')")
        await wait_identical(m.nodes)
        for node in m.nodes:
            assert await fetch(node.dsn(), "SELECT count(*) FROM pgbench_history") == [(1,)]
            assert await fetch(node.dsn(), "SELECT count(*) FROM keyed") == [(2,)]
            assert await fetch(node.dsn(), "SELECT to_regclass('d'), to_regclass('made')") == [(None, None)]
        await no_link_error(router)


BRANCHES = (
    "INSERT INTO pgbench_history SELECT g, g % 5 + 1, g, g, '2026-01-01'::timestamp + g * interval '1 s'"
    " FROM generate_series(1, 200) g"
)

# alembic's way, one statement each: add the column, fill it (replicated), then its default for new rows
ADD_FILL_DEFAULT = (
    "ALTER TABLE pgbench_history ADD COLUMN updated_at TIMESTAMP WITH TIME ZONE",
    "UPDATE pgbench_history SET updated_at = now()",
    "ALTER TABLE pgbench_history ALTER COLUMN updated_at SET DEFAULT now()",
    "ALTER TABLE pgbench_history ALTER COLUMN updated_at SET NOT NULL",
    "ALTER TABLE pgbench_history ADD COLUMN hid bigint",
    "UPDATE pgbench_history h SET hid = n.rn FROM (SELECT tid, row_number() OVER (ORDER BY tid) AS rn"
    " FROM pgbench_history) n WHERE h.tid = n.tid",
    "CREATE SEQUENCE pgbench_history_hid_seq OWNED BY pgbench_history.hid",
    "ALTER TABLE pgbench_history ALTER COLUMN hid SET DEFAULT nextval('pgbench_history_hid_seq')",
    "ALTER TABLE pgbench_history ADD PRIMARY KEY (hid)",
)


async def test_add_column_filled_at_ddl_time(mesh: MeshFactory, tmp_path: Path) -> None:
    m = await mesh(nodes=3, schema=PGBENCH_LIKE + BRANCHES + ";", admin_port=free_port())
    a, b, c = m.nodes
    config = tmp_path / "config.toml"
    config.write_text(m.config_text())
    async with running_router(m.config) as router:
        # rc 0 before, and each node numbered its own rows
        hid = "ALTER TABLE pgbench_history ADD COLUMN hid bigserial PRIMARY KEY"
        done = await asyncio.to_thread(pgmesh, config, "ddl", "--wait", hid)
        assert done.returncode != 0, done.stdout
        assert "ADD COLUMN hid" in done.stderr and "nextval" in done.stderr, done.stderr
        assert "hint" in done.stderr.lower() and "UPDATE" in done.stderr, done.stderr
        for statement, words in (
            (hid, "nextval"),
            ("ALTER TABLE pgbench_history ADD COLUMN seqno bigint GENERATED ALWAYS AS IDENTITY", "IDENTITY"),
            # alembic's server_default=sa.func.now(), nullable=False
            ("ALTER TABLE pgbench_history ADD COLUMN updated_at TIMESTAMP WITH TIME ZONE DEFAULT now()"
             " NOT NULL", "now()"),
            ("ALTER TABLE pgbench_branches ADD COLUMN at timestamptz DEFAULT CURRENT_TIMESTAMP",
             "CURRENT_TIMESTAMP"),
            ("ALTER TABLE pgbench_branches ADD COLUMN u uuid DEFAULT gen_random_uuid()", "gen_random_uuid()"),
            ("ALTER TABLE pgbench_branches ALTER COLUMN bbalance TYPE bigint USING (random() * 10)::bigint",
             "random()"),
        ):
            refused(await typed(b, statement, check=False), words)
        # on an empty table nothing is filled: new rows get their values where they are inserted
        await typed(a, "CREATE TABLE empty_one (id int PRIMARY KEY)")
        await typed(a, "ALTER TABLE empty_one ADD COLUMN at timestamptz DEFAULT now()")
        await typed(a, "ALTER TABLE empty_one ADD COLUMN n bigserial")
        # rows inserted earlier in the same transaction count: they reach the other nodes before the command
        with pytest.raises(psycopg.errors.FeatureNotSupported, match=r"ADD COLUMN at to table public\.fresh"):
            async with await psycopg.AsyncConnection.connect(c.dsn()) as conn:
                await conn.execute("CREATE TABLE fresh (id int PRIMARY KEY)")
                await conn.execute("INSERT INTO fresh VALUES (1)")
                await conn.execute("ALTER TABLE fresh ADD COLUMN at timestamptz DEFAULT now()")
        # a constant default, a stored generated column: the same values everywhere
        await typed(a, "ALTER TABLE pgbench_branches ADD COLUMN note text NOT NULL DEFAULT 'none'")
        await typed(a, "ALTER TABLE pgbench_branches ADD COLUMN double int"
                       " GENERATED ALWAYS AS (bbalance * 2) STORED")
        for statement in ADD_FILL_DEFAULT:
            if statement.startswith("UPDATE"):
                await typed(a, statement)
            else:
                done = await asyncio.to_thread(pgmesh, config, "ddl", "--wait", statement)
                assert done.returncode == 0, done.stderr
        # new rows: a generator no two nodes share (the sequence is each node's own until then)
        done = await asyncio.to_thread(pgmesh, config, "sequences", "convert", "pgbench_history")
        assert done.returncode == 0, done.stderr
        for node, tid in ((b, 201), (c, 202)):
            await typed(node, f"INSERT INTO pgbench_history (tid, bid, aid, delta, mtime)"
                              f" VALUES ({tid}, 1, 1, 1, now())")
        await typed(c, "INSERT INTO empty_one (id) VALUES (1)")
        await wait_identical(m.nodes)
        for node in m.nodes:
            assert await fetch(node.dsn(), "SELECT count(DISTINCT hid), count(DISTINCT updated_at) FROM"
                                           " pgbench_history WHERE tid <= 200") == [(200, 1)]
        await no_link_error(router)


async def test_enum_labels_added_on_two_nodes_at_once(mesh: MeshFactory, tmp_path: Path) -> None:
    m = await mesh(nodes=3, admin_port=free_port(), schema="""
        CREATE TYPE mood AS ENUM ('sad', 'ok');
        CREATE TABLE feel (id int PRIMARY KEY, m mood);
    """)
    a, b, c = m.nodes
    config = tmp_path / "config.toml"
    config.write_text(m.config_text())
    async with running_router(m.config) as router:
        # typed on two nodes at once: each would sort the labels in its own order (refused)
        done = await asyncio.gather(*(
            typed(node, f"ALTER TYPE mood ADD VALUE 'x_{node.name}'", check=False) for node in (a, b)
        ))
        for one in done:
            refused(one, "ADD VALUE", "pgmesh ddl")
        # through `pgmesh ddl`, at once from two shells: one at a time, the same order everywhere
        done = await asyncio.gather(*(asyncio.to_thread(
            pgmesh, config, "ddl", "--node", node.name, f"ALTER TYPE mood ADD VALUE 'x_{node.name}'")
            for node in (a, b)))
        for one in done:
            assert one.returncode == 0, one.stderr
        refused(await typed(c, "ALTER TYPE mood ADD VALUE 'happy' AFTER 'ok'", check=False), "ADD VALUE")
        # as migration tools spell it (idempotent, in a DO block): refused too; one that adds nothing passes
        done = await typed(c, "DO $$ BEGIN ALTER TYPE mood ADD VALUE 'meh';"
                              " EXCEPTION WHEN duplicate_object THEN NULL; END $$", check=False)
        refused(done, "ADD VALUE")
        await typed(c, "ALTER TYPE mood ADD VALUE IF NOT EXISTS 'ok'")
        await execute(c.dsn(), "INSERT INTO feel VALUES (1, 'x_a'), (2, 'x_b'), (3, 'ok')")
        await wait_identical(m.nodes)
        orders = [await fetch(n.dsn(), "SELECT array_agg(enumlabel ORDER BY enumsortorder) FROM pg_enum"
                                       " WHERE enumtypid = 'mood'::regtype") for n in m.nodes]
        assert orders[0] == orders[1] == orders[2] and len(orders[0][0][0]) == 4, orders
        answers = [await fetch(n.dsn(), "SELECT count(*) FROM feel WHERE m > 'ok'") for n in m.nodes]
        assert answers == [[(2,)]] * 3, answers
        await no_link_error(router)


async def test_detached_partition_stays_replicated(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema="""
        CREATE TABLE m (id int, at date, v text, PRIMARY KEY (id, at)) PARTITION BY RANGE (at);
        CREATE TABLE m_2024 PARTITION OF m FOR VALUES FROM ('2024-01-01') TO ('2025-01-01');
        CREATE TABLE m_2025 PARTITION OF m FOR VALUES FROM ('2025-01-01') TO ('2026-01-01');
        CREATE TABLE logs (at date, line text) PARTITION BY RANGE (at);
        CREATE TABLE logs_2024 PARTITION OF logs FOR VALUES FROM ('2024-01-01') TO ('2025-01-01');
    """)
    a, b, c = m.nodes
    async with running_router(m.config) as router:
        await typed(a, "INSERT INTO m SELECT g, '2024-03-01'::date + g, 'a' FROM generate_series(1, 50) g;"
                       " INSERT INTO logs SELECT '2024-05-01', 'line ' || g FROM generate_series(1, 10) g")
        await wait_identical(m.nodes)
        done = await typed(a, "ALTER TABLE m DETACH PARTITION m_2024 CONCURRENTLY", check=False)
        refused(done, "CONCURRENTLY")
        await typed(a, "ALTER TABLE m DETACH PARTITION m_2024")
        await typed(b, "ALTER TABLE logs DETACH PARTITION logs_2024")  # no key: REPLICA IDENTITY FULL
        await wait_for(lambda: _published(m.nodes, ["m_2024", "logs_2024"]), "the detached tables published")
        # written afterwards on every node: before, these writes stayed on the node that made them
        await typed(b, "INSERT INTO m_2024 VALUES (1000, '2024-06-01', 'b');"
                       " UPDATE m_2024 SET v = 'b2' WHERE id = 3")
        await typed(c, "DELETE FROM m_2024 WHERE id = 4; INSERT INTO m_2024 VALUES (1001, '2030-01-01', 'c')")
        await typed(a, "INSERT INTO logs_2024 VALUES ('2024-01-02', 'after');"
                       " DELETE FROM logs_2024 WHERE line = 'line 1'")
        await typed(c, "INSERT INTO m VALUES (2000, '2025-02-02', 'c')")
        await wait_identical(m.nodes)
        for node in m.nodes:
            assert await fetch(node.dsn(), "SELECT count(*) FROM m_2024") == [(51,)]
            assert await fetch(node.dsn(), "SELECT count(*) FROM logs_2024") == [(10,)]
        # attached back: it leaves the publication as itself (the root publishes its rows again)
        await typed(a, "DELETE FROM m_2024 WHERE at >= '2025-01-01'")
        await wait_identical(m.nodes)
        await typed(a, "ALTER TABLE m ATTACH PARTITION m_2024"
                       " FOR VALUES FROM ('2024-01-01') TO ('2025-01-01')")
        await wait_for(lambda: _published(m.nodes, ["logs_2024"]), "m_2024 published through its root only")
        await typed(b, "INSERT INTO m VALUES (3000, '2024-07-01', 'b'); UPDATE m SET v = 'b3' WHERE id = 5")
        await wait_identical(m.nodes)
        for node in m.nodes:
            assert await fetch(node.dsn(), "SELECT count(*), count(*) FILTER (WHERE v = 'b3') FROM m"
                                           " WHERE at < '2025-01-01'") == [(51, 1)]
        await no_link_error(router)


async def _has(node: Any, query: str) -> bool:
    return bool(await fetch(node.dsn(), query) == [(True,)])


async def _published(nodes: list[Any], tables: list[str]) -> bool:
    """Whether pgmesh's publication lists exactly `tables` of m_2024 and logs_2024 on every node."""
    for node in nodes:
        rows = await fetch(
            node.dsn(), "SELECT tablename::text FROM pg_publication_tables WHERE tablename = ANY(%s)",
            [["m_2024", "logs_2024"]],
        )
        if sorted(r[0] for r in rows) != sorted(tables):
            return False
    return True


async def test_replica_identity_changed_then_rows_in_one_transaction(mesh: MeshFactory) -> None:
    """A migration in one transaction: the replica identity moved to another unique index, then an
    update and a delete sent as separate statements (as they must be now). Before, the same work in one
    query string hid this: b replayed the string and so ran the update and the delete itself."""
    m = await mesh(nodes=2, schema="""
        CREATE TABLE ri (a int NOT NULL, b int NOT NULL);
        CREATE UNIQUE INDEX ri_a ON ri (a);
        CREATE UNIQUE INDEX ri_b ON ri (b);
        ALTER TABLE ri REPLICA IDENTITY USING INDEX ri_a;
        INSERT INTO ri VALUES (1, 1), (2, 2);
    """)
    a, _ = m.nodes
    async with running_router(m.config):
        await execute(a.dsn(), "BEGIN", "ALTER TABLE ri REPLICA IDENTITY USING INDEX ri_b",
                      "UPDATE ri SET a = -a WHERE a = 1", "DELETE FROM ri WHERE a = 2", "COMMIT")
        await wait_identical(m.nodes, limit=30)
