"""The tombstone recorder on real nodes (router.apply.recorder): a node's own deletes cost the
application no trigger and are recorded from its stream (a spilled one too); a remote change that rewrote a
deleted key before the recorder got there is decided late, as with the tombstone there, and recorded;
where the stream does not carry the key, the trigger stays ALWAYS."""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = """
CREATE TABLE items (id int PRIMARY KEY, v text NOT NULL);
CREATE TABLE bulk (id int PRIMARY KEY, pad text NOT NULL);
CREATE TABLE alt (id int PRIMARY KEY, code int NOT NULL UNIQUE, v text);
ALTER TABLE alt REPLICA IDENTITY USING INDEX alt_code_key;
"""
TOMBSTONES = "SELECT key FROM pgmesh.tombstones WHERE table_name = %s ORDER BY key"


async def count(dsn: str, query: str, params: Any = None) -> int:
    return int((await fetch(dsn, query, params))[0][0])


async def test_own_deletes_recorded_from_the_stream_and_late_changes_decided(mesh: MeshFactory) -> None:
    # spill_mb = 1: the 20,000-row delete below spills to disk; the recorder reads it back
    m = await mesh(nodes=2, schema=SCHEMA, replication="spill_mb = 1\n", cluster="rec")
    a, b = (n.dsn() for n in m.nodes)
    await execute(a, "INSERT INTO items VALUES (1, 'one'), (2, 'two'), (3, 'three')")
    await execute(a, "INSERT INTO bulk SELECT g, repeat('x', 100) FROM generate_series(1, 20000) g")
    await execute(a, "INSERT INTO alt VALUES (1, 10, 'a')")
    fires = ("SELECT tgenabled::text FROM pg_trigger"
             " WHERE tgname = 'pgmesh_tombstone' AND tgrelid = %s::regclass")
    assert (await fetch(a, fires, ["items"]))[0][0] == "R"
    assert (await fetch(a, fires, ["alt"]))[0][0] == "A"  # the stream carries code, not the key id

    # The application's deletes, router stopped: no tombstone yet, except on alt (trigger ALWAYS).
    async with await psycopg.AsyncConnection.connect(a, autocommit=True) as conn:
        async with conn.transaction():
            deleted = (await (await conn.execute("SELECT pg_current_xact_id()::text")).fetchall())[0][0]
            await conn.execute("DELETE FROM items WHERE id IN (1, 2)")
        await conn.execute("DELETE FROM bulk")
        await conn.execute("DELETE FROM alt")
        row = await (await conn.execute(
            "SELECT pg_xact_commit_timestamp(%s::xid8::xid)", [deleted])).fetchone()
        assert row is not None
        when: dt.datetime = row[0]
    assert await fetch(a, TOMBSTONES, ["public.items"]) == []
    assert await fetch(a, TOMBSTONES, ["public.alt"]) == [(["1"],)]

    # Two changes from b meet the deleted keys on a before the recorder ran (as an applier that read
    # no tombstone yet would apply them): one older than the deletion, one newer.
    origin = m.config.origin_name("b")
    async with await psycopg.AsyncConnection.connect(a, autocommit=True) as conn:
        await conn.execute("SET session_replication_role = replica")
        await conn.execute("SELECT pg_replication_origin_session_setup(%s)", [origin])
        for key, shift in ((1, -3600), (2, 3600)):
            async with conn.transaction():
                await conn.execute("SELECT pg_replication_origin_xact_setup('0/1', %s)",
                                   [when + dt.timedelta(seconds=shift)])
                await conn.execute("INSERT INTO items VALUES (%s, 'from b')", [key])
        # what the applier records when it meets neither row nor tombstone (key 2's change): replaced by
        # the recorder's late decision (one conflict, one record)
        await conn.execute(
            "INSERT INTO pgmesh.conflict_history (source, table_name, key, conflict_type, resolution,"
            " resolver, reason, remote_origin, remote_commit_time, remote_lsn)"
            " VALUES ('b', 'public.items', '2', 'update_missing', 'apply_remote', 'last_update_wins',"
            " 'no local row and no record of a deletion: insert it', 'b', %s, '0/1')",
            [when + dt.timedelta(seconds=3600)])

    async with running_router(m.config, admin=False) as router:
        recorder = router.recorders["a"]

        async def recorded() -> bool:
            return (await count(a, "SELECT count(*) FROM pgmesh.tombstones WHERE table_name = 'public.bulk'")
                    == 20000 and len(await fetch(a, TOMBSTONES, ["public.items"])) == 2)

        await wait_for(recorded, "a's own deletes recorded (a spilled one too)")
        await wait_for(lambda: recorder.late == 2, "the two late changes decided")
        assert recorder.replaced == 1  # key 2's, in place of the applier's update_missing record
        await wait_for(lambda: recorder.progress.flushed >= recorder.progress.enqueued, "recorded durably")
        await wait_for(lambda: _empty(b), "a's deletes applied on b")
        status = router.status().recorders
        assert [(s.node, s.late_decisions, s.last_error) for s in status] == [("a", 2, None), ("b", 0, None)]

    # the tombstones carry the deleting transaction's xid (so its commit time and origin)
    xids = await fetch(a, "SELECT DISTINCT xid::text FROM pgmesh.tombstones WHERE table_name = %s",
                       ["public.items"])
    assert xids == [(deleted,)]
    # older than the deletion: removed; newer: stays. Both recorded as what they were.
    assert await fetch(a, "SELECT id, v FROM items ORDER BY id") == [(2, "from b"), (3, "three")]
    history = await fetch(
        a, "SELECT key, conflict_type, resolution, source, local_origin FROM pgmesh.conflict_history"
        " ORDER BY key")
    assert history == [("1", "update_deleted", "keep_local", "b", "a"),
                       ("2", "update_deleted", "apply_remote", "b", "a")]
    reasons = [r[0] for r in await fetch(a, "SELECT reason FROM pgmesh.conflict_history ORDER BY key")]
    assert all(r.startswith("late: ") for r in reasons), reasons
    assert "in place of the update_missing" in reasons[1] and "in place of" not in reasons[0], reasons
    # b got a's deletes as usual, and nothing of the recorder's own writes on a (no echo)
    assert await fetch(b, "SELECT id FROM items ORDER BY id") == [(3,)]
    assert await count(a, "SELECT count(*) FROM pgmesh.tombstones_recorded") == 1


async def _empty(dsn: str) -> bool:
    return await count(dsn, "SELECT (SELECT count(*) FROM bulk) + (SELECT count(*) FROM alt)") == 0


async def test_a_key_update_takes_the_old_key_away_on_every_node(mesh: MeshFactory) -> None:
    """b moves row 3 to key 100 after c updated row 3: the old key's tombstone (recorded from b's stream
    on b; written by the applying transaction where b's update is applied, router.apply.scripts.
    moved_key_tombstone) makes c's older update lose wherever it arrives after the move, so no node
    keeps a row 3."""
    m = await mesh(nodes=3, schema="CREATE TABLE t (id int PRIMARY KEY, v int);", cluster="keyup")
    a, b, c = (n.dsn() for n in m.nodes)
    await execute(a, "INSERT INTO t VALUES (3, 0)")
    async with running_router(m.config):
        await wait_converged(m.nodes, ["t"])
    await execute(c, "UPDATE t SET v = 1 WHERE id = 3")  # router stopped: both commit before either applies
    await execute(b, "UPDATE t SET id = 100 WHERE id = 3")  # later
    async with running_router(m.config) as router:
        await wait_for(lambda: all(x.stats.applied_transactions >= 1 for (s, _), x in router.appliers.items()
                                   if s != "a"), "b's and c's updates applied everywhere")
        await wait_converged(m.nodes, ["t"])
    for dsn in (a, b, c):
        assert await fetch(dsn, "SELECT id, v FROM t") == [(100, 0)]
        assert await fetch(dsn, TOMBSTONES, ["public.t"]) == [(["3"],)]


async def test_replicated_insert_waiting_on_a_local_insert_then_delete_converges(mesh: MeshFactory) -> None:
    """a's insert of key 1 reaches b while a local transaction on b holds key 1 (inserted, not committed):
    the applier's INSERT waits on the unique index; the local transaction deletes the row again and
    commits, and the INSERT goes in on b without any tombstone to see. b's deletion is the newer: the
    recorder, writing its tombstone, finds a's row on the key and removes it, so b ends as a does."""
    m = await mesh(nodes=2, schema="CREATE TABLE t (id int PRIMARY KEY, v int);", cluster="wait")
    a, b = (n.dsn() for n in m.nodes)
    await execute(a, "INSERT INTO t VALUES (1, 0)")  # router stopped: applied on b when it starts
    waiting = ("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
               " AND backend_type = 'client backend'")
    async with await psycopg.AsyncConnection.connect(b, autocommit=True) as local:
        await local.execute("BEGIN")
        await local.execute("INSERT INTO t VALUES (1, 2)")
        async with running_router(m.config) as router:
            await wait_for(lambda: _count_is(b, waiting, 1), "a's insert waiting on b's uncommitted key")
            await local.execute("DELETE FROM t WHERE id = 1")
            await local.execute("COMMIT")  # the newest change of key 1: its deletion, on b
            await wait_for(lambda: all(x.stats.applied_transactions >= 1 for x in router.appliers.values()),
                           "each node's transaction applied on the other")
            await wait_converged(m.nodes, ["t"])
            assert router.recorders["b"].late == 1  # decided by the recorder, late
    for dsn in (a, b):
        assert await fetch(dsn, "SELECT id FROM t") == []


async def _count_is(dsn: str, query: str, n: int) -> bool:
    return await count(dsn, query) == n
