"""A streamed transaction is applied on the target while it is still in progress on the source.

The server streams a transaction in progress once it outgrows logical_decoding_work_mem (64 kB here);
past `replication.spill_mb` the router announces it (router.stream.source EarlyStream) and each link applies
it on a side session, in one open target transaction, while the main session goes on with what commits
before it. At its commit the side session commits it, in commit order, under the source's origin.

1. Three nodes: while A's transaction is still open, B and C each hold an open transaction that wrote
   its rows; a transaction on another table commits on A meanwhile and lands first; after A's commit
   both targets have every row, committed by the side session with A's origin and commit time, and
   what the side sessions wrote comes back from B and C as echoes only (no conflict, nothing applied);
   on PostgreSQL 16+ nothing comes back (origin 'none'), and the note the side session writes after its
   commit (pgmesh.applied) tells B's and C's seen vectors that they have A's transaction.
2. A's transaction is rolled back after B started on it: B rolls back too and has none of it.
3. A transaction that commits before it writes the same table: the side transaction is rolled back
   (the main session never waits for it) and the big one is applied at its commit, after it.
4. A subtransaction rolled back inside it: the side session applies its rows as they come, learns of
   the rollback at the commit and gives up; the whole transaction is applied at its commit without the
   subtransaction's rows.
5. Its commit comes in one batch right behind a transaction on a table its tail also writes: the side
   session waits for that table while the other runs and commits right after (this hung before the
   side session was told that the main session's tables shrank).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
import pytest

from protocol.lsn import datetime_to_pg_us
from router.apply import parts as large_apply
from router.service.supervisor import Router
from router.testing.mesh import (
    NODE_SETTINGS,
    execute,
    fetch,
    running_router,
    wait_converged,
    wait_for,
)
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE big (id int PRIMARY KEY, v text); CREATE TABLE small (id int PRIMARY KEY, v text);"
# The server streams these transactions while they are in progress; the mesh spills them past 1 MB.
SETTINGS = {**NODE_SETTINGS, "logical_decoding_work_mem": "64kB"}
ROWS = 60_000
BIG = f"INSERT INTO big SELECT i, repeat('x', 40) || i FROM generate_series(1, {ROWS}) AS i"


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of 5,000 changes: the side session starts after the first spill, not the third."""
    monkeypatch.setattr(large_apply, "LARGE_PART_CHANGES", 5000)


async def writing_open_transaction(dsn: str) -> bool:
    """Whether a pgmesh session here holds an open transaction that has written something."""
    rows = await fetch(dsn, "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction'"
                            " AND backend_xid IS NOT NULL AND pid <> pg_backend_pid()")
    return bool(rows[0][0])


async def side_started(router: Router, targets: Sequence[Any]) -> None:
    for node in targets:
        applier = router.appliers[("a", node.name)]
        await wait_for(lambda applier=applier: applier.stats.early_streams >= 1,
                       f"a -> {node.name} to start early")
        await wait_for(lambda node=node: writing_open_transaction(node.dsn()),
                       f"{node.name} to hold the open transaction", limit=120)


async def test_streamed_transaction_is_applied_before_its_commit(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, settings=SETTINGS, replication="spill_mb = 1")
    nodes, config = m.nodes, m.config
    a, b, c = nodes
    async with running_router(config) as router:
        async with await psycopg.AsyncConnection.connect(a.dsn()) as writer:
            await writer.execute(BIG)  # not committed yet
            await side_started(router, [b, c])
            await execute(a.dsn(), "INSERT INTO small VALUES (1, 'meanwhile')")
            await wait_for(lambda: fetch_count(b.dsn(), "small", 1), "the small one on b")
            assert await fetch(b.dsn(), "SELECT count(*) FROM big") == [(0,)]
            await writer.execute("UPDATE big SET v = 'last' WHERE id = 7")
            await writer.commit()
            query = "SELECT pg_xact_commit_timestamp(xmin) FROM big WHERE id = 1"
            ((when,),) = await fetch(a.dsn(), query)
        await wait_converged(nodes, ["big", "small"], limit=240)
        for node in (b, c):
            applier = router.appliers[("a", node.name)]
            stats = applier.stats
            assert stats.early_streams_committed == 1, (node.name, stats.early_streams_dropped)
            assert stats.early_streams_dropped == 0
        await wait_for(lambda: router.spool.files == 0, "the spool file to go")
        # what the side sessions wrote came back from b and c as echoes, not as their own
        for (source, target), applier in router.appliers.items():
            assert applier.stats.conflicts == 0, (source, target)
            if source != "a":
                assert applier.stats.applied_transactions == 0, (source, target)
        # PostgreSQL 16+ (origin 'none'): no echo is decoded or sent, not even of the side sessions' rows
        # written under the early origin; the side session's pgmesh.applied note stands for its echo
        ((version,),) = await fetch(b.dsn(), "SELECT current_setting('server_version_num')::int")
        for node in (b, c):
            pump = router.pumps[node.name]
            echoes = pump.stats.echoes
            assert echoes >= 1 if version < 160000 else echoes == 0, (node.name, echoes)
            await wait_for(lambda pump=pump: dict(pump.seen.snapshot).get("a", 0) >= datetime_to_pg_us(when),
                           f"{node.name}'s seen vector to hold a's commit")

        def exported() -> bool:
            child = router.metrics.early_transactions_total.find(source="a", target="b")
            return child is not None and child.get() >= 1

        await wait_for(exported, "pgmesh_early_transactions_total on /metrics")
    for node in (b, c):
        rows = await fetch(node.dsn(), "SELECT count(*), count(DISTINCT x.roname), min(t.timestamp),"
                                       " max(v) FILTER (WHERE id = 7)"
                                       " FROM big, pg_xact_commit_timestamp_origin(big.xmin) t"
                                       " JOIN pg_replication_origin x ON x.roident = t.roident")
        assert rows == [(ROWS, 1, when, "last")]


async def fetch_count(dsn: str, table: str, wanted: int) -> bool:
    return (await fetch(dsn, f"SELECT count(*) FROM {table}"))[0][0] == wanted


async def test_rolled_back_streamed_transaction_leaves_nothing(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, settings=SETTINGS, replication="spill_mb = 1")
    nodes, config = m.nodes, m.config
    a, b = nodes
    async with running_router(config) as router:
        applier = router.appliers[("a", "b")]
        async with await psycopg.AsyncConnection.connect(a.dsn()) as writer:
            await writer.execute(BIG)
            await side_started(router, [b])
            await writer.rollback()
        await wait_for(lambda: applier.stats.early_streams_dropped == 1, "b to give it up")
        await wait_for(lambda: not_writing(b.dsn()), "b's side transaction to end")
        await execute(a.dsn(), "INSERT INTO small VALUES (1, 'after')")
        await wait_converged(nodes, ["big", "small"])
        await wait_for(lambda: router.spool.files == 0, "the spool file to go")
        assert applier.stats.early_streams_committed == 0
    assert await fetch(b.dsn(), "SELECT count(*) FROM big") == [(0,)]


async def not_writing(dsn: str) -> bool:
    return not await writing_open_transaction(dsn)


async def test_earlier_commit_on_the_same_table_rolls_the_side_back(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, settings=SETTINGS, replication="spill_mb = 1")
    nodes, config = m.nodes, m.config
    a, b = nodes
    async with running_router(config) as router:
        applier = router.appliers[("a", "b")]
        async with await psycopg.AsyncConnection.connect(a.dsn()) as writer:
            await writer.execute(BIG)
            await side_started(router, [b])
            await execute(a.dsn(), f"INSERT INTO big VALUES ({ROWS + 1}, 'first')")
            await wait_for(lambda: applier.stats.early_streams_dropped == 1, "b to give the side one up")
            await wait_for(lambda: fetch_count(b.dsn(), "big", 1), "the small one on b")
            await writer.commit()
        await wait_converged(nodes, ["big"], limit=240)
        assert applier.stats.early_streams_committed == 0
    assert await fetch(b.dsn(), "SELECT count(*) FROM big") == [(ROWS + 1,)]


async def test_subtransaction_rolled_back_inside_a_streamed_transaction(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, settings=SETTINGS, replication="spill_mb = 1")
    nodes, config = m.nodes, m.config
    a, b = nodes
    async with running_router(config) as router:
        applier = router.appliers[("a", "b")]
        async with await psycopg.AsyncConnection.connect(a.dsn()) as writer:
            await writer.execute(BIG)
            await side_started(router, [b])
            await writer.execute("SAVEPOINT s")
            await writer.execute(f"INSERT INTO big SELECT i, 'gone' FROM generate_series({ROWS + 1},"
                                 f" {ROWS + 20000}) AS i")
            await writer.execute("ROLLBACK TO SAVEPOINT s")
            await writer.execute(f"INSERT INTO big VALUES ({ROWS + 1}, 'kept')")
            await writer.commit()
        await wait_converged(nodes, ["big"], limit=240)
        assert applier.stats.early_streams_committed == 0 and applier.stats.early_streams_dropped == 1
        await wait_for(lambda: router.spool.files == 0, "the spool file to go")
    rows = await fetch(b.dsn(), "SELECT count(*), count(*) FILTER (WHERE v = 'gone') FROM big")
    assert rows == [(ROWS + 1, 0)]


async def test_side_waits_for_a_table_while_the_commit_before_it_runs(mesh: MeshFactory) -> None:
    """The main session is held (a row lock on B) while, on A, T1 writes `small` and the streamed
    transaction, whose side session is running, also writes `small` and commits. When B lets go, the
    main session applies T1 and then the streamed one's commit in one batch: the side session must
    wait for `small` while T1 runs and take it right after, or both would wait for each other."""
    m = await mesh(nodes=2, schema=SCHEMA, settings=SETTINGS, replication="spill_mb = 1")
    nodes, config = m.nodes, m.config
    a, b = nodes
    async with running_router(config) as router:
        applier = router.appliers[("a", "b")]
        await execute(a.dsn(), "INSERT INTO small VALUES (0, 'start')")
        await wait_for(lambda: fetch_count(b.dsn(), "small", 1), "row 0 on b")
        async with await psycopg.AsyncConnection.connect(b.dsn()) as holder, \
                await psycopg.AsyncConnection.connect(a.dsn()) as writer:
            await holder.execute("SELECT * FROM small WHERE id = 0 FOR UPDATE")
            await writer.execute(BIG)
            await side_started(router, [b])
            await execute(a.dsn(), "UPDATE small SET v = 't0' WHERE id = 0")  # held on b
            await execute(a.dsn(), "INSERT INTO small VALUES (1, 't1')")
            await writer.execute("INSERT INTO small VALUES (2, 'streamed')")
            await writer.commit()
            await wait_for(lambda: applier.pending >= 3, "t1 and the streamed commit queued behind t0")
            await holder.rollback()
        await wait_converged(nodes, ["big", "small"], limit=120)
        assert applier.stats.early_streams_committed == 1, applier.stats.early_streams_dropped
    assert await fetch(b.dsn(), "SELECT count(*) FROM small") == [(3,)]
