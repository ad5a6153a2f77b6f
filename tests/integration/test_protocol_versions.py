"""What each source asks its server for, on real PostgreSQL 15 and 18 (`router.stream.items.negotiate`).

Owns: proving on real servers that a source streams with the highest pgoutput proto_version its server
speaks (15: 2, streaming 'on'; 18: 4, streaming 'parallel', `origin 'none'`), that a mesh of mixed
majors replicates every kind of value both ways that way (bytea, numeric, timestamptz, jsonb, arrays, a
user enum; a large transaction with a rolled-back savepoint and one rolled back whole, streamed from
the 18 node under 'parallel'), and that binary values are asked for only when every target runs the
source's major. Must not: sleep (every wait polls a condition). A version not installed skips the test.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from protocol.messages import KIND_BINARY, KIND_NULL, KIND_TEXT, Insert
from protocol.transactions import Transaction
from router.stream.items import SourceOptions, StreamSettings
from router.stream.source import ReplicationSource
from router.testing.mesh import NODE_SETTINGS, execute, fetch, running_router, wait_converged, wait_for
from tests.fix_cluster import NodeFactory
from tests.fix_mesh import MeshFactory

pytestmark = pytest.mark.versions  # pins its nodes' versions: runs once, not again under PGMESH_TEST_PG

SCHEMA = """
CREATE TYPE "mood" AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE "vals" (
    "id" int PRIMARY KEY, "raw" bytea, "amount" numeric(20, 6), "at" timestamptz, "doc" jsonb,
    "tags" text[], "moods" "mood"[], "m" "mood"
);
CREATE TABLE "bulk" ("id" int PRIMARY KEY, "payload" text NOT NULL);
"""
ROW = (
    "'\\x00ff10'::bytea, 12345678901234.123456, '2024-02-29 23:59:59.123456+00', "
    """'{"k": [1, 2.5, "x"], "n": null}', '{a,"b c",NULL}', '{sad,happy}', 'ok'"""
)
# logical_decoding_work_mem is read by each walsender: 64kB makes the large transactions stream
STREAMING = {**NODE_SETTINGS, "logical_decoding_work_mem": "64kB"}


async def version_num(node: Any) -> int:
    rows = await fetch(node.dsn(), "SELECT current_setting('server_version_num')::int")
    return int(rows[0][0])


async def test_a_mixed_mesh_streams_what_each_server_speaks_and_replicates_all(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, versions=[15, 18], settings=STREAMING)
    old, new = m.nodes
    async with running_router(m.config) as router:
        def started() -> bool:
            return all(p.source.connection.settings is not None for p in router.pumps.values())

        await wait_for(started, "both sources streaming")
        settings = {name: p.source.connection.settings for name, p in router.pumps.items()}
        # (the router asks for text: its applier writes values through their input functions)
        assert settings[old.name] == StreamSettings(2, "on", False, messages=True, origin_none=False)
        assert settings[new.name] == StreamSettings(4, "parallel", False, messages=True, origin_none=True)

        await execute(old.dsn(), f'INSERT INTO "vals" VALUES (1, {ROW})')
        await execute(new.dsn(), f'INSERT INTO "vals" VALUES (2, {ROW})')
        await execute(new.dsn(), 'INSERT INTO "vals" ("id") VALUES (3)')  # NULLs
        # Streamed from 18 under 'parallel': a savepoint rolled back inside a committed transaction,
        # and a transaction rolled back whole (its Stream Abort carries the abort LSN and time).
        await execute(new.dsn(), """
            BEGIN;
            INSERT INTO "bulk" SELECT i, 'kept' FROM generate_series(1, 2000) AS i;
            SAVEPOINT s;
            INSERT INTO "bulk" SELECT i, 'rolled back' FROM generate_series(2001, 4000) AS i;
            ROLLBACK TO SAVEPOINT s;
            INSERT INTO "bulk" VALUES (5000, 'after');
            COMMIT;
        """)
        await _abort_after_streaming(new)
        await execute(new.dsn(), """INSERT INTO "bulk" VALUES (6000, 'last')""")
        await wait_for(
            lambda: _count(old, 'SELECT count(*) FROM "bulk" WHERE "id" = 6000'), "the last row on 15", 120
        )
        await wait_converged(m.nodes, ["vals", "bulk"], limit=120)
    for node in m.nodes:
        rows = await fetch(node.dsn(), 'SELECT "id", "raw", "amount"::text, "at", "doc"::text, "tags"::text,'
                           ' "moods"::text, "m"::text FROM "vals" ORDER BY "id"')
        assert [r[0] for r in rows] == [1, 2, 3], node.name
        for row in rows[:2]:
            assert row[1] == b"\x00\xff\x10" and row[2] == "12345678901234.123456", node.name
            assert row[3].isoformat() == "2024-02-29T23:59:59.123456+00:00", node.name
            assert row[4] == '{"k": [1, 2.5, "x"], "n": null}', node.name
            assert row[5:] == ('{a,"b c",NULL}', "{sad,happy}", "ok"), node.name
        assert rows[2][1:] == (None,) * 7, node.name
        bulk = await fetch(node.dsn(), 'SELECT "payload", count(*) FROM "bulk" GROUP BY 1 ORDER BY 1')
        assert bulk == [("after", 1), ("kept", 2000), ("last", 1)], node.name


async def _abort_after_streaming(node: Any) -> None:
    """A large transaction rolled back whole once the walsender has read past its rows (so it was
    streamed: 18 does not stream one it already knows aborted)."""
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        await conn.execute("BEGIN")
        await conn.execute("""INSERT INTO "bulk" SELECT i, 'gone' FROM generate_series(10001, 13000) AS i""")
        cur = await conn.execute("SELECT pg_current_wal_insert_lsn()::text")
        row = await cur.fetchone()
        assert row is not None
        query = (
            "SELECT count(*) FROM pg_stat_replication WHERE application_name LIKE 'pgmesh%'"
            f" AND sent_lsn >= '{row[0]}'::pg_lsn"
        )
        await wait_for(lambda: _count(node, query), "the walsender to read past the rows", 120)
        await conn.execute("ROLLBACK")


async def _count(node: Any, query: str) -> bool:
    rows = await fetch(node.dsn(), query)
    return int(rows[0][0]) > 0


async def _first_insert(source: ReplicationSource) -> Insert:
    """The first inserted row the source hands out (the stream starts at the slot's creation)."""
    async with asyncio.timeout(60):
        async for item in source.stream():
            if isinstance(item, Transaction):
                return next(c for c in item.changes if isinstance(c, Insert))
    raise AssertionError("the stream ended")


async def test_binary_values_only_when_every_target_runs_the_source_major(pg_nodes: NodeFactory) -> None:
    """A source asked for binary gets it from its server only when its targets run its major version:
    18 -> [18] binary; 18 -> [15] and 15 -> [18] text. What the server then sends says the same."""
    old, new, peer = pg_nodes(names=["old15", "new18", "peer18"], versions=[15, 18, 18])
    versions = {node.name: await version_num(node) for node in (old, new, peer)}
    for node in (old, new):
        await execute(node.dsn(), SCHEMA + 'CREATE PUBLICATION "pv" FOR TABLE "vals";')
    cases = [(new, peer, True), (new, old, False), (old, new, False)]
    sources = []
    for i, (source_node, target, _) in enumerate(cases):
        options = SourceOptions(binary=True, target_versions=(versions[target.name],), status_interval=0.5)
        source = ReplicationSource(source_node.name, source_node.dsn(), f"pv_{i}", ["pv"], options=options)
        await source.create_slot()
        sources.append(source)
    for node in (old, new):
        await execute(node.dsn(), f'INSERT INTO "vals" VALUES (1, {ROW})')
    try:
        for source, (source_node, target, binary) in zip(sources, cases, strict=True):
            insert = await _first_insert(source)
            settings = source.connection.settings
            assert settings is not None and settings.binary is binary, (source_node.name, target.name)
            assert settings.proto_version == (4 if versions[source_node.name] >= 160000 else 2)
            kinds = set(insert.new.kinds) - {KIND_NULL}
            assert kinds == {KIND_BINARY if binary else KIND_TEXT}, (source_node.name, target.name)
    finally:
        for source in sources:
            await source.close()
            await source.drop_slot(missing_ok=True)
