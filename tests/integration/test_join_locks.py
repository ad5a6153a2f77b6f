"""Join against the application's locks (issue 17): TRUNCATE and ALTER on donor tables during a join.

The join's sessions on the donor (the snapshot's lock holder, the schema dump, the copy planner, the Spark
tasks) take ACCESS SHARE locks; an application's TRUNCATE or ALTER TABLE queues for ACCESS EXCLUSIVE behind
them, and any join session that asks for a lock after it queues behind the application. The join must give
way (the application's statement waits a bounded time), copy again under its snapshot (a table truncated
since is left to the stream; one rewritten needs a new snapshot), finish, and leave every node, the new one
included, equal.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import psycopg
import pytest

from router.cluster.copy.locks import SnapshotLocks
from router.errors import PgmeshError
from router.ops.join import join_node
from router.testing.mesh import execute, fetch, free_port, running_router, wait_converged, wait_for
from tests.fix_cluster import NodeFactory
from tests.fix_mesh import MeshFactory

slow = pytest.mark.slow  # each join attempt copies with Spark (a JVM)

SCHEMA = """
CREATE TABLE "acct" ("id" int PRIMARY KEY, "v" int NOT NULL, "who" text);
CREATE TABLE "scratch" ("id" int PRIMARY KEY, "note" text);
CREATE TABLE "big" ("id" bigint PRIMARY KEY, "pad" text);
"""
SEED = """
INSERT INTO "big" SELECT g, repeat('p', 200) FROM generate_series(1, 300000) g;
INSERT INTO "scratch" SELECT g, 'seed' FROM generate_series(1, 1000) g;
"""
TABLES = ["acct", "scratch", "big"]
SYNC = '[sync]\nspark_master = "local[2]"\npartitions_per_table = 4\n'
# The application's own bound on its statements: the join must have given way long before it runs out
# (without that, the application's TRUNCATE waited for the whole join, or for ever).
APP_LOCK_TIMEOUT = "60s"
JOIN_SESSIONS = "pgmesh\\_t\\_join%"


async def writer(node: Any, base: int, stop: asyncio.Event, seed: int, *, scratch: bool = False) -> int:
    """Inserts and updates on keys only this node touches, in `acct` (and `scratch`), until `stop`.

    Only the donor writes `scratch`, the table it truncates: a TRUNCATE is ordered against its own
    node's writes only (docs/ddl.md), so rows another node wrote meanwhile would stay on some nodes."""
    rng = random.Random(seed)
    written = 0
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        while not stop.is_set():
            key = base + written
            await conn.execute('INSERT INTO "acct" ("id", "v", "who") VALUES (%s, 0, %s)', [key, node.name])
            if scratch:
                await conn.execute('INSERT INTO "scratch" ("id", "note") VALUES (%s, %s)', [key, node.name])
            if written % 4 == 1:
                await conn.execute('UPDATE "acct" SET "v" = "v" + 1 WHERE "id" = %s',
                                   [base + rng.randrange(written)])
            written += 1
            await asyncio.sleep(0.005)
    return written


async def join_lockers(dsn: str, table: str) -> set[int]:
    """Join sessions on the donor that hold a lock on `table`."""
    rows = await fetch(
        dsn,
        "SELECT DISTINCT l.pid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.granted AND l.relation = %s::regclass AND a.application_name LIKE %s",
        [f'"{table}"', JOIN_SESSIONS],
    )
    return {pid for (pid,) in rows}


async def app_statement(dsn: str, statement: str) -> None:
    """The application's DDL, waiting for its lock at most APP_LOCK_TIMEOUT."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(f"SET lock_timeout = '{APP_LOCK_TIMEOUT}'")
        await conn.execute(statement)


@slow
async def test_join_gives_way_to_truncate_and_alter_on_the_donor(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA + SEED, spares=["c"], admin_port=free_port(), extra=SYNC)
    nodes = m.all_nodes
    a, b, c = nodes
    two, three = m.config, m.config_for(nodes)
    stop = asyncio.Event()
    writers = [asyncio.create_task(writer(a, 1_000_000, stop, 0, scratch=True)),
               asyncio.create_task(writer(b, 2_000_000, stop, 1))]
    try:
        async with running_router(two, reload=lambda: three) as router:
            await wait_for(lambda: all(p.stats.transactions > 20 for p in router.pumps.values()),
                           "writes flowing")
            join = asyncio.create_task(join_node(three, "c", donor="a"))
            # 1. as soon as the join holds its snapshot's locks, the application truncates a donor table:
            #    the join's next lock (schema dump, copy planning, copy) queues behind the TRUNCATE
            first: set[int] = set()

            async def locked_scratch() -> bool:
                first.update(await join_lockers(a.dsn(), "scratch"))
                return bool(first) or join.done()

            await wait_for(locked_scratch, "the join to lock the donor's tables", 180)
            assert not join.done(), join.result()
            await app_statement(a.dsn(), 'TRUNCATE "scratch"')
            # 2. while a later attempt copies, the application adds a column (replicated DDL) to a donor table
            copying = "SELECT count(*) > 0 FROM pg_stat_activity WHERE query ILIKE 'COPY %FROM STDIN%'"

            async def copying_again() -> bool:
                if join.done():
                    return True
                lockers = await join_lockers(a.dsn(), "acct")
                return bool(lockers - first) and await fetch(c.dsn(), copying) == [(True,)]

            await wait_for(copying_again, "a new round of the join to copy", 240)
            assert not join.done(), join.result()
            await app_statement(a.dsn(), """ALTER TABLE "acct" ADD COLUMN "note" text DEFAULT 'n'""")
            report = await asyncio.wait_for(join, 600)  # bounded: the join finishes (or fails clearly)
            # it gave way twice and copied again under its snapshot: "scratch", truncated since, is left
            # to the stream (c replays the TRUNCATE); "acct" (a column added, not rewritten) is copied
            assert report.rounds >= 3 and report.attempts == 1, report
            assert report.truncated == ("public.scratch",), report
            await wait_for(lambda: router.running and ("c", "a") in router.appliers, "the router with c")
            writers.append(asyncio.create_task(writer(c, 3_000_000, stop, 2)))
            await wait_for(lambda: router.appliers[("c", "a")].stats.applied_transactions > 20, "c's writes")
            stop.set()
            await asyncio.gather(*writers)
            await wait_converged(nodes, TABLES, 240)
            links = {(link.source, link.target): link.state for link in router.status().links}
            assert set(links.values()) == {"streaming"}, links
    finally:
        stop.set()
        await asyncio.gather(*writers, return_exceptions=True)
    for node in nodes:
        assert await fetch(node.dsn(), 'SELECT count(*) FROM "scratch" WHERE "note" = %s', ["seed"]) == [(0,)]
        assert await fetch(node.dsn(), 'SELECT count(*) FROM "acct" WHERE "note" IS NULL') == [(0,)]
        assert await fetch(node.dsn(), 'SELECT count(*) FROM "big"') == [(300_000,)]


@slow
async def test_a_join_the_application_keeps_locked_out_fails_clearly_and_a_retry_succeeds(
    mesh: MeshFactory,
) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, spares=["c"])
    nodes = m.all_nodes
    a, _, c = nodes
    config = m.config_for(nodes)
    await execute(a.dsn(), """INSERT INTO "scratch" SELECT g, 'a' FROM generate_series(1, 500) g""")
    async with await psycopg.AsyncConnection.connect(a.dsn()) as app:  # a transaction left open
        await app.execute('LOCK TABLE "scratch" IN ACCESS EXCLUSIVE MODE')
        # (its ACCESS EXCLUSIVE gave it a transaction id: the join's snapshot must wait for it to end)
        with pytest.raises(PgmeshError, match="waited 1 s for transactions running on the donor") as failed:
            await join_node(config, "c", lock_wait_s=1, slot_wait_s=1)
        assert failed.value.sqlstate == "55P03" and failed.value.node == "a", failed.value
        # nothing half done: the donor keeps only pgmesh's slot and no session of the join; the new
        # node keeps the marker only
        assert await fetch(a.dsn(), "SELECT slot_name FROM pg_replication_slots") == [("pgmesh_t",)]
        joins = "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s"
        assert await fetch(a.dsn(), joins, [JOIN_SESSIONS]) == [(0,)]
        assert await fetch(c.dsn(), "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'") == [(0,)]
        assert await fetch(c.dsn(), "SELECT count(*) FROM pgmesh_join.state") == [(1,)]
        await app.rollback()
    report = await join_node(config, "c", lock_wait_s=1)  # the retry: no --force
    assert report.rows == 500 and report.attempts == 1, report
    async with running_router(config):
        await execute(c.dsn(), """INSERT INTO "scratch" VALUES (0, 'from c')""")
        await wait_converged(nodes, TABLES)


# ---------------------------------------------------------------------------------------------------------
# The lock holder alone (no Spark): a snapshot exported by a session of the test's


async def test_the_lock_holder_plans_under_its_locks_and_sees_the_snapshots_tables(
    pg_nodes: NodeFactory,
) -> None:
    (node,) = pg_nodes(names=["a"])
    dsn = node.dsn()
    await execute(dsn, SCHEMA, """INSERT INTO "scratch" SELECT g, 's' FROM generate_series(1, 2000) g""",
                  """INSERT INTO "acct" SELECT g, g, 'a' FROM generate_series(1, 10) g""")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as exporter:
        await exporter.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        snapshot = (await (await exporter.execute("SELECT pg_export_snapshot()")).fetchone() or [""])[0]
        # after the snapshot: a column (no rewrite), a new table, and a truncated table
        await execute(dsn, """ALTER TABLE "acct" ADD COLUMN "note" text""",
                      """CREATE TABLE "later" ("id" int PRIMARY KEY)""")
        wanted = [("public", "acct"), ("public", "big"), ("public", "later")]
        locks = await asyncio.to_thread(SnapshotLocks.open, dsn, snapshot, wanted, lock_wait_s=1,
                                        application_name="test-locks")
        try:
            assert [(t.name, t.columns) for t in locks.tables] == [("acct", ("id", "v", "who")),
                                                                  ("big", ("id", "pad"))]
            leaves = [(leaf.name, leaf.nblocks > 0) for leaf in locks.leaves]
            assert leaves == [("acct", True), ("big", False)]
            # the application's TRUNCATE waits for the holder (the test's own bound), the holder for nobody
            with pytest.raises(psycopg.errors.LockNotAvailable):
                async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as app:
                    await app.execute("SET lock_timeout = '200ms'")
                    await app.execute('TRUNCATE "acct"')
        finally:
            await asyncio.to_thread(locks.close)
        await execute(dsn, 'TRUNCATE "scratch"')  # once the holder is gone, the application goes on
        # truncated after the snapshot: not copied (the new node replays the TRUNCATE), not locked
        wanted = [("public", "acct"), ("public", "scratch")]
        locks = await asyncio.to_thread(SnapshotLocks.open, dsn, snapshot, wanted, lock_wait_s=1,
                                        application_name="test-locks")
        try:
            assert locks.truncated == [("public", "scratch")], locks.truncated
            assert [t.name for t in locks.tables] == ["acct"] and [lf.name for lf in locks.leaves] == ["acct"]
            await execute(dsn, 'TRUNCATE "scratch"')  # no longer waits for the join
        finally:
            await asyncio.to_thread(locks.close)
        # VACUUM FULL moves the rows with their versions: the snapshot still sees them, copied as usual
        await execute(dsn, 'VACUUM FULL "acct"')
        locks = await asyncio.to_thread(SnapshotLocks.open, dsn, snapshot, [("public", "acct")],
                                        lock_wait_s=1, application_name="test-locks")
        try:
            assert locks.truncated == [] and [lf.name for lf in locks.leaves] == ["acct"]
        finally:
            await asyncio.to_thread(locks.close)
        # a rewriting ALTER TABLE: the snapshot's rows cannot be read any more, a new snapshot is needed
        await execute(dsn, 'ALTER TABLE "acct" ALTER COLUMN "v" TYPE bigint')
        with pytest.raises(PgmeshError, match="rewritten after the join's snapshot") as rewritten:
            await asyncio.to_thread(SnapshotLocks.open, dsn, snapshot, [("public", "acct")], lock_wait_s=1,
                                    application_name="test-locks")
        assert rewritten.value.sqlstate == "40001" and rewritten.value.relation == "public.acct"
        async with await psycopg.AsyncConnection.connect(dsn) as app:  # a lock held in an open transaction
            await app.execute('LOCK TABLE "big" IN ACCESS EXCLUSIVE MODE')
            with pytest.raises(PgmeshError, match="could not lock the tables to copy within 1 s") as late:
                await asyncio.to_thread(SnapshotLocks.open, dsn, snapshot, [("public", "big")], lock_wait_s=1,
                                        application_name="test-locks")
            assert late.value.sqlstate == "55P03"
