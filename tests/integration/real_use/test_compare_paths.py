"""`pgmesh compare` and `pgmesh repair` as a DBA runs them, on three nodes with the router running:
a table without a key (pgbench_history's kind, made REPLICA IDENTITY FULL by init) that differs, identity
and generated columns, and a table the config's `tables` matches that is not in the publication.

Differences are hidden the way they happen: rows written on one node in a session under a replication
origin of its own (as another replication tool would write), which pgmesh does not carry. Each test ends
with every node identical, or with compare's loud answer asserted.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import psycopg

from router.testing.mesh import free_port, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.real_use.users import pgmesh, psql, wait_identical

KEYLESS = """
CREATE TABLE hist (tid int, delta int, note text);
CREATE TABLE acct (id bigint PRIMARY KEY, balance int NOT NULL);
INSERT INTO acct SELECT g, 0 FROM generate_series(1, 100) g;
"""


async def unreplicated(node: Any, *statements: str) -> None:
    """Run `statements` on `node` in one transaction under a foreign replication origin: pgmesh does not
    carry it (as rows another replication tool wrote)."""
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        await conn.execute("SELECT pg_replication_origin_create('other_tool') WHERE NOT EXISTS"
                           " (SELECT 1 FROM pg_replication_origin WHERE roname = 'other_tool')")
        await conn.execute("SELECT pg_replication_origin_session_setup('other_tool')")
        async with conn.transaction():
            for statement in statements:
                await conn.execute(statement.encode())


async def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`pgmesh ARGS` as a process, the event loop (and the router on it) running meanwhile."""
    return await asyncio.to_thread(pgmesh, config, *args)


async def compare_json(config: Path, *tables: str) -> tuple[int, dict[str, Any]]:
    done = await cli(config, "compare", "--json", *tables)
    assert done.stdout.strip(), done.stderr
    return done.returncode, json.loads(done.stdout)


async def test_keyless_table_compared_as_a_multiset_and_repaired_from_a_node(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    """A table without a key holding duplicates compares equal; an extra copy on one node, a row missing on
    another and a row changed on a third are each found, with their copies per node; `repair` without
    `--from` refuses them with the way out; `repair --from a` makes every node hold a's copies."""
    m = await mesh(nodes=3, schema=KEYLESS, admin_port=free_port())
    a, b, c = m.nodes
    config = m.write_config(tmp_path / "pgmesh.toml")
    async with running_router(m.config):
        psql(a, "INSERT INTO hist SELECT g % 50, g, 'seed' FROM generate_series(1, 2000) g;"
                " INSERT INTO hist VALUES (1, 10, 'twice'), (1, 10, 'twice'), (2, 20, 'once'),"
                " (3, 30, 'once'), (5, 50, 'before')")
        await wait_identical(m.nodes)

        same = await cli(config, "compare")
        assert same.returncode == 0, same.stdout + same.stderr
        assert "0 difference(s)" in same.stdout and "not compared" not in same.stdout, same.stdout

        await unreplicated(b, "INSERT INTO hist VALUES (2, 20, 'once')")  # a second copy on b
        await unreplicated(c, "DELETE FROM hist WHERE tid = 3 AND note = 'once'",  # gone from c
                           "DELETE FROM hist WHERE ctid = (SELECT min(ctid) FROM hist WHERE note = 'twice')")
        await unreplicated(a, "UPDATE hist SET note = 'after' WHERE tid = 5 AND note = 'before'")

        printed = await cli(config, "compare")
        assert printed.returncode == 1, printed.stdout + printed.stderr
        assert "(2,20,once)" in printed.stdout and "2 copies" in printed.stdout, printed.stdout
        code, report = await compare_json(config)
        assert code == 1
        counts = {d["key"]: d["counts"] for d in report["differences"] if d["table"] == "public.hist"}
        assert counts == {
            "(2,20,once)": {"a": 1, "b": 2, "c": 1},
            "(3,30,once)": {"a": 1, "b": 1, "c": 0},
            "(1,10,twice)": {"a": 2, "b": 2, "c": 1},
            "(5,50,after)": {"a": 1, "b": 0, "c": 0},
            "(5,50,before)": {"a": 0, "b": 1, "c": 1},
        }, report
        assert report["skipped"] == [] and report["unreplicated"] == []

        refused = await cli(config, "repair")
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "not repaired: public.hist" in refused.stdout and "--from" in refused.stdout, refused.stdout

        fixed = await cli(config, "repair", "--from", "a", "hist")
        assert fixed.returncode == 0, fixed.stdout + fixed.stderr
        await wait_identical(m.nodes)
        again = await cli(config, "compare")
        assert again.returncode == 0, again.stdout + again.stderr
        rows = await _count(b, "SELECT count(*) FROM hist WHERE note = 'twice'")
        assert rows == 2  # a's two copies, never more


async def test_repair_writes_identity_columns_and_never_generated_ones(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    """A key GENERATED ALWAYS AS IDENTITY, a second identity column numbered per node and a STORED
    generated column: repair inserts a missing row (OVERRIDING SYSTEM VALUE), replaces a row whose
    identity column differs, and leaves the generated column to the server."""
    schema = """
    CREATE TABLE item (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, price int NOT NULL,
                       price_x2 int GENERATED ALWAYS AS (price * 2) STORED);
    ALTER TABLE item ADD COLUMN seqno bigint GENERATED ALWAYS AS IDENTITY;
    """
    m = await mesh(nodes=3, schema=schema, admin_port=free_port())
    a, b, c = m.nodes
    config = m.write_config(tmp_path / "pgmesh.toml")
    async with running_router(m.config):
        psql(a, "INSERT INTO item (id, price, seqno) OVERRIDING SYSTEM VALUE"
                " SELECT g, g * 10, g FROM generate_series(1, 20) g")
        await wait_identical(m.nodes)
        await unreplicated(b, "DELETE FROM item WHERE id = 3")
        await unreplicated(c, "UPDATE item SET seqno = DEFAULT WHERE id = 5",  # numbered by c's sequence
                           "UPDATE item SET price = 999 WHERE id = 7")
        code, report = await compare_json(config)
        assert code == 1
        assert {d["key"] for d in report["differences"]} == {"(3)", "(5)", "(7)"}, report

        done = await cli(config, "repair")
        assert done.returncode == 0, done.stdout + done.stderr
        await wait_identical(m.nodes)
        again = await cli(config, "compare")
        assert again.returncode == 0, again.stdout + again.stderr
        assert await _count(a, "SELECT price_x2 FROM item WHERE id = 7") == 1998


async def test_a_table_that_matches_tables_but_is_not_published_is_not_skipped(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    """A table `tables = ["*.*"]` matches that is in no node's publication (as a detached partition was):
    compare without table names compares it all the same, says it is not replicated, and exits non-zero;
    a row written on one node shows as a difference; what compare says to do (init, then repair) brings
    the table back."""
    m = await mesh(nodes=3, schema=KEYLESS + "CREATE TABLE loose (id int PRIMARY KEY, v text);",
                   admin_port=free_port())
    a, b, _ = m.nodes
    config = m.write_config(tmp_path / "pgmesh.toml")
    publication = m.config.publication_name
    async with running_router(m.config):
        for node in m.nodes:  # out of the replicated set on every node, by hand
            await unreplicated(node, f'ALTER PUBLICATION "{publication}" DROP TABLE public.loose')
        out = await cli(config, "compare")
        assert out.returncode == 4, out.stdout + out.stderr
        assert "not replicated: public.loose" in out.stdout, out.stdout

        psql(a, "INSERT INTO loose VALUES (1, 'only on a')")
        code, report = await compare_json(config)
        assert code == 1
        assert "public.loose" in report["tables"]
        assert [(d["table"], d["key"]) for d in report["differences"]] == [("public.loose", "(1)")]
        named = await cli(config, "compare", "loose")
        assert named.returncode == 1 and "not replicated: public.loose" in named.stdout, named.stdout

        # what compare says to do: init puts it back in the publication, repair copies what stayed on a
        added = await cli(config, "init")
        assert added.returncode == 0, added.stdout + added.stderr
        fixed = await cli(config, "repair", "loose")
        assert fixed.returncode == 0, fixed.stdout + fixed.stderr
        psql(b, "INSERT INTO loose VALUES (2, 'from b, replicated again')")
        await wait_identical(m.nodes)
        final = await cli(config, "compare")
        assert final.returncode == 0, final.stdout + final.stderr


async def _count(node: Any, query: str) -> int:
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        row = await (await conn.execute(query)).fetchone()
    assert row is not None
    return int(row[0])


async def test_a_detached_partition_is_compared(mesh: MeshFactory, tmp_path: Path) -> None:
    """`ALTER TABLE m DETACH PARTITION m_2024`, then a row written into m_2024 on one node: compare without
    table names covers m_2024 (it matches `tables`): every node identical and compare agrees, or compare
    says loudly that it is not replicated and shows the row."""
    schema = """
    CREATE TABLE m (id int, at date, v text, PRIMARY KEY (id, at)) PARTITION BY RANGE (at);
    CREATE TABLE m_2024 PARTITION OF m FOR VALUES FROM ('2024-01-01') TO ('2025-01-01');
    CREATE TABLE m_2025 PARTITION OF m FOR VALUES FROM ('2025-01-01') TO ('2026-01-01');
    """
    m = await mesh(nodes=3, schema=schema, admin_port=free_port())
    a, _, _ = m.nodes
    config = m.write_config(tmp_path / "pgmesh.toml")
    async with running_router(m.config):
        psql(a, "INSERT INTO m SELECT g, date '2024-03-01' + g, 'seed' FROM generate_series(1, 500) g")
        await wait_identical(m.nodes)
        detached = psql(a, "ALTER TABLE m DETACH PARTITION m_2024", check=False)
        if detached.returncode != 0:  # refused: loudly, with what to do
            assert "HINT" in detached.stderr, detached.stderr
            return
        await wait_identical(m.nodes)
        psql(a, "INSERT INTO m_2024 VALUES (9999, '2024-06-01', 'after the detach')")
        code, report = await compare_json(config)
        if any(u.startswith("public.m_2024:") for u in report["unreplicated"]):
            assert code == 1 and "public.m_2024" in report["tables"], report
            assert [(d["table"], d["key"]) for d in report["differences"]] == [
                ("public.m_2024", '(9999,2024-06-01)')], report
        else:  # it stayed replicated
            await wait_identical(m.nodes)
            code, report = await compare_json(config)
            assert code == 0 and "public.m_2024" in report["tables"], report
