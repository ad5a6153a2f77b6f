"""ReplicationSource against real PostgreSQL 15 nodes: streaming, crash + reconnect, feedback, snapshots."""

from __future__ import annotations

import asyncio
import itertools
import struct
from collections.abc import AsyncGenerator
from typing import Any

import psycopg
import pytest

from protocol.messages import Insert, Message
from protocol.transactions import Transaction
from router.errors import Action, ConnectionLost, SlotError, SourceError, decide
from router.stream.items import SourceOptions
from router.stream.source import ReplicationSource
from router.testing.mesh import wait_for

SCHEMA = """
CREATE TABLE t (id int PRIMARY KEY, v text);
CREATE PUBLICATION pub FOR ALL TABLES;
"""

FAST = SourceOptions(status_interval=0.2, backoff_initial=0.05, backoff_max=0.5, receive_timeout=10)


async def execute(dsn: str, *statements: str, params: Any = None) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            await conn.execute(statement, params)


async def insert_each(dsn: str, ids: range) -> None:
    """One transaction per id."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for i in ids:
            await conn.execute("INSERT INTO t VALUES (%s, %s)", [i, f"row {i}"])


def ids_of(txn: Transaction) -> list[int]:
    return [struct.unpack(">i", c.new.values[0])[0] for c in txn.changes if isinstance(c, Insert)]  # type: ignore[arg-type]


async def take(items: AsyncGenerator[Transaction | Message, None], n: int) -> list[Transaction]:
    out: list[Transaction] = []
    while len(out) < n:
        item = await asyncio.wait_for(anext(items), 60)
        if isinstance(item, Transaction):
            out.append(item)
    return out


@pytest.fixture
async def node(pg_nodes: Any) -> Any:
    (n,) = pg_nodes(1, settings={"wal_sender_timeout": "2s"})
    await execute(n.dsn(), SCHEMA)
    return n


async def new_source(node: Any, slot: str = "s1", **kw: Any) -> ReplicationSource:
    options = kw.pop("options", FAST)
    source = ReplicationSource(node.name, node.dsn(), slot, ["pub"], options=options, **kw)
    await source.create_slot()
    return source


async def test_streams_decoded_transactions_in_commit_order(node: Any) -> None:
    source = await new_source(node)
    info = await source.identify_system()
    assert info.dbname == "app" and info.timeline == 1
    await insert_each(node.dsn(), range(1, 6))
    await execute(node.dsn(), "UPDATE t SET v = 'changed' WHERE id = 3", "DELETE FROM t WHERE id = 4")
    items = source.stream()
    try:
        txns = await take(items, 7)
    finally:
        await items.aclose()
        await source.close()
    assert [ids_of(t) for t in txns[:5]] == [[1], [2], [3], [4], [5]]
    assert [type(t.changes[-1]).__name__ for t in txns[5:]] == ["Update", "Delete"]
    assert all(a.end_lsn <= b.commit_lsn for a, b in itertools.pairwise(txns))
    assert all(t.origin is None for t in txns)
    rel = txns[0].relations[txns[0].changes[-1].relid]  # type: ignore[union-attr]
    assert (rel.namespace, rel.name, rel.key_columns) == ("public", "t", ("id",))


async def test_crash_restart_resumes_without_loss_or_repeat(node: Any) -> None:
    """`pg_ctl restart -m immediate` mid-stream: every transaction arrives exactly once, in order."""
    source = await new_source(node)
    await insert_each(node.dsn(), range(1, 41))
    items = source.stream()
    seen: list[int] = []
    try:
        for i, txn in enumerate(await take(items, 25)):
            seen += ids_of(txn)
            if i % 7 == 0:
                source.confirm(txn.end_lsn)  # confirm only some: the rest must not come back twice
        await source.send_status()
        await asyncio.to_thread(node.restart, "immediate")
        await insert_each(node.dsn(), range(41, 61))
        for txn in await take(items, 35):
            seen += ids_of(txn)
            source.confirm(txn.end_lsn)
    finally:
        await items.aclose()
        await source.close()
    assert seen == list(range(1, 61))
    assert source.stats.reconnects >= 1


async def test_slot_confirmed_flush_equals_caller_position(node: Any) -> None:
    exact = SourceOptions(status_interval=0.1, advance_when_idle=False)
    source = await new_source(node, options=exact)
    await insert_each(node.dsn(), range(1, 11))
    items = source.stream()
    try:
        txns = await take(items, 10)
        target = txns[5].end_lsn
        source.confirm(target)

        async def confirmed_is(lsn: int) -> bool:
            info = await source.slot_info()
            return info is not None and info.confirmed_flush_lsn == lsn

        await wait_for(lambda: confirmed_is(target), "confirmed_flush_lsn == caller's position")
        sent = source.stats.status_updates_sent
        await wait_for(lambda: source.stats.status_updates_sent > sent + 3, "more status updates")
        assert await confirmed_is(target)  # several updates later it has not moved past the caller
        source.confirm(txns[3].end_lsn)  # going backwards is ignored
        assert source.confirmed_lsn == target
    finally:
        await items.aclose()
        await source.close()


async def test_idle_position_advances_once_everything_is_confirmed(node: Any) -> None:
    source = await new_source(node)
    await insert_each(node.dsn(), range(1, 4))
    items = source.stream()
    try:
        txns = await take(items, 3)
        source.confirm(txns[-1].end_lsn)
        # WAL that carries nothing for this slot (another table's unpublished writes would do; a
        # checkpoint and a logical message to another prefix are enough here).
        await execute(node.dsn(), "CHECKPOINT", "SELECT pg_logical_emit_message(false, 'other', 'x')")
        nxt = await asyncio.wait_for(anext(items), 30)
        assert isinstance(nxt, Message)
        source.confirm(nxt.lsn + 1)

        async def advanced() -> bool:
            info = await source.slot_info()
            return info is not None and (info.confirmed_flush_lsn or 0) > nxt.lsn

        await wait_for(advanced, "slot to advance past the idle position")
    finally:
        await items.aclose()
        await source.close()


async def test_keepalives_answered_while_caller_does_not_consume(node: Any) -> None:
    """wal_sender_timeout is 2 s: the walsender stays connected while nobody reads for much longer.

    The source's own receive timeout (2 s) must not fire either: a slow caller is not a dead node.
    """
    source = await new_source(node, options=SourceOptions(status_interval=0.3, receive_timeout=2))
    await execute(node.dsn(), "INSERT INTO t SELECT i, repeat('x', 200) FROM generate_series(1, 1) i")
    await execute(node.dsn(), "INSERT INTO t SELECT i, repeat('x', 200) FROM generate_series(2, 200001) i")
    items = source.stream()
    try:
        (first,) = await take(items, 1)
        pid = await _walsender_pid(node)
        t0 = await _server_now(node)

        async def replied_long_after() -> bool:
            query = "SELECT pid, reply_time > %s + interval '6 s' FROM pg_stat_replication"
            row = await _fetch(node, query, t0)
            assert row is not None and row[0] == pid, "the walsender went away"
            return bool(row[1])

        await wait_for(replied_long_after, "status replies 6 s (3x wal_sender_timeout) into the pause")
        (big,) = await take(items, 1)
        assert big.row_count == 200_000
        assert source.stats.reconnects == 0 and await _walsender_pid(node) == pid
        assert ids_of(first) == [1]
    finally:
        await items.aclose()
        await source.close()


async def _fetch(node: Any, query: str, *params: Any) -> tuple[Any, ...] | None:
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        cur = await conn.execute(query, params or None)
        return await cur.fetchone()


async def _walsender_pid(node: Any) -> int:
    row = await _fetch(node, "SELECT pid FROM pg_stat_replication")
    assert row is not None
    return int(row[0])


async def _server_now(node: Any) -> Any:
    row = await _fetch(node, "SELECT clock_timestamp()")
    assert row is not None
    return row[0]


async def test_exported_snapshot_stays_importable_while_streaming(node: Any) -> None:
    await insert_each(node.dsn(), range(1, 4))
    source = ReplicationSource(node.name, node.dsn(), "snap", ["pub"], options=FAST)
    created = await source.create_slot(export_snapshot=True)
    assert created.snapshot is not None
    snapshot = created.snapshot
    await insert_each(node.dsn(), range(4, 6))
    items = source.stream()
    try:
        txns = await take(items, 2)  # the source went on to START_REPLICATION and streams
        assert [ids_of(t) for t in txns] == [[4], [5]]  # exactly the rows after the snapshot
        for _ in range(2):  # several importers, one after another and at once
            async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
                await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                await conn.execute(f"SET TRANSACTION SNAPSHOT '{snapshot.name}'")
                cur = await conn.execute("SELECT array_agg(id ORDER BY id) FROM t")
                row = await cur.fetchone()
                assert row is not None and row[0] == [1, 2, 3]
        await snapshot.close()
        async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
            await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            # (PostgreSQL 18 says 42704, undefined object; older ones 22023, invalid parameter value)
            with pytest.raises((psycopg.errors.InvalidParameterValue, psycopg.errors.UndefinedObject)):
                await conn.execute(f"SET TRANSACTION SNAPSHOT '{snapshot.name}'")
    finally:
        await items.aclose()
        await source.close()


async def test_a_snapshot_that_cannot_be_held_is_a_clear_error_and_leaves_no_connection(node: Any) -> None:
    from router.stream.slots import keep_snapshot

    with pytest.raises(SlotError, match="cannot hold the snapshot exported by slot 'gone'") as caught:
        await keep_snapshot(node.dsn(), "00000003-0000001B-1", slot="gone", node=node.name,
                            application_name="pgmesh-held")
    assert caught.value.node == node.name

    async def none_left() -> bool:
        async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pgmesh-held-snapshot'")
            row = await cur.fetchone()
            return row is not None and row[0] == 0

    await wait_for(none_left, "the holder connection to go")


async def test_link_cut_and_restored_through_proxy(node: Any, tcp_proxy: Any) -> None:
    proxy = tcp_proxy("127.0.0.1", node.port)
    dsn = node.dsn().replace(f"port={node.port}", f"port={proxy.port}")
    source = ReplicationSource(node.name, dsn, "cut", ["pub"], options=FAST)
    await source.create_slot()
    await insert_each(node.dsn(), range(1, 11))
    items = source.stream()
    seen: list[int] = []
    try:
        for txn in await take(items, 5):
            seen += ids_of(txn)
        proxy.cut()
        await insert_each(node.dsn(), range(11, 21))
        reader = asyncio.ensure_future(take(items, 15))
        await wait_for(lambda: source.state == "reconnecting", "the source to notice the cut")
        proxy.restore()
        for txn in await asyncio.wait_for(reader, 60):
            seen += ids_of(txn)
    finally:
        await items.aclose()
        await source.close()
    assert seen == list(range(1, 21))
    assert source.stats.reconnects >= 1


async def test_clear_errors(node: Any, pg_nodes: Any) -> None:
    missing = ReplicationSource(node.name, node.dsn(), "nope", ["pub"], options=FAST)
    with pytest.raises(SlotError) as info:
        async for _ in missing.stream():
            pass
    assert "node" in str(info.value) and "nope" in str(info.value) and decide(info.value) is Action.FAIL

    (secured,) = pg_nodes(1, names=["locked"], password="s3cret-pw")
    bad = ReplicationSource(secured.name, secured.dsn(password="wrong-pw"), "x", ["pub"], options=FAST)
    with pytest.raises(SourceError) as info2:
        await bad.identify_system()
    text = str(info2.value)
    assert "node locked" in text and "password" in text and "wrong-pw" not in text and "s3cret" not in text

    with pytest.raises(SlotError):
        ReplicationSource(node.name, node.dsn(), "Bad-Name", ["pub"])

    await execute(node.dsn(), "DROP PUBLICATION pub")
    source = await new_source(node, slot="nopub")
    await insert_each(node.dsn(), range(1, 2))
    with pytest.raises(SourceError) as info3:
        async for _ in source.stream():
            pass
    assert "publication" in str(info3.value) and "node" in str(info3.value)

    down = ReplicationSource("ghost", "host=127.0.0.1 port=1 dbname=app user=postgres connect_timeout=2",
                             "x", ["pub"], options=FAST)
    with pytest.raises(ConnectionLost) as info4:
        await down.identify_system()
    assert "node ghost" in str(info4.value) and decide(info4.value) is Action.RETRY


async def test_stalled_link_detected_by_receive_timeout(node: Any, tcp_proxy: Any) -> None:
    """A link that stays open but carries nothing is declared dead, reconnected, and nothing is lost."""
    proxy = tcp_proxy("127.0.0.1", node.port)
    dsn = node.dsn().replace(f"port={node.port}", f"port={proxy.port}")
    options = SourceOptions(status_interval=0.2, receive_timeout=1.5, connect_timeout=2, backoff_initial=0.05)
    source = ReplicationSource(node.name, dsn, "stall", ["pub"], options=options)
    await source.create_slot()
    await insert_each(node.dsn(), range(1, 6))
    items = source.stream()
    seen: list[int] = []
    try:
        for txn in await take(items, 5):
            seen += ids_of(txn)
            source.confirm(txn.end_lsn)
        proxy.blackhole()
        await insert_each(node.dsn(), range(6, 11))
        reader = asyncio.ensure_future(take(items, 5))
        await wait_for(lambda: source.stats.reconnects >= 1, "the source to give up on the stalled link")
        proxy.restore()
        for txn in await asyncio.wait_for(reader, 60):
            seen += ids_of(txn)
    finally:
        await items.aclose()
        await source.close()
    assert seen == list(range(1, 11))


async def test_a_slot_busy_for_a_moment_is_waited_for(node: Any) -> None:
    """START_REPLICATION on a slot still active for another walsender (55006: this router's own of a
    moment ago, exiting after a reconnect) is retried for a while, not a failed source."""
    holder = await new_source(node)
    await insert_each(node.dsn(), range(1, 3))
    held = holder.stream()
    try:
        await take(held, 1)  # the slot is active for the holder's walsender
        second = ReplicationSource(node.name, node.dsn(), "s1", ["pub"], options=FAST)
        items = second.stream()
        pending = asyncio.ensure_future(take(items, 2))
        deadline = asyncio.get_running_loop().time() + 30
        while "active" not in (second.last_error or ""):
            assert asyncio.get_running_loop().time() < deadline, "the second source never met the busy slot"
            assert not pending.done(), pending
            await asyncio.sleep(0.05)
    finally:
        await held.aclose()
        await holder.close()
    try:
        txns = await asyncio.wait_for(pending, 60)  # the holder let go: the second one streams
        assert [ids_of(t) for t in txns] == [[1], [2]]
    finally:
        await items.aclose()
        await second.close()
