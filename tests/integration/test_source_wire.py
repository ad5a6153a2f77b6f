"""The replication stream read past libpq (`router.stream.wire`) on a plain socket, against a real node.

The same transactions through both readers (libpq's, as over TLS, and pgmesh's own): large values
and transactions that span many reads; a walsender ended mid-stream (its ErrorResponse read off the
socket: the source reconnects and loses nothing); a START_REPLICATION refused; a rewind that must wake
the reader waiting on the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from protocol.messages import Insert
from protocol.transactions import Transaction
from router.errors import SlotError
from router.stream.connection import ReplicationConnection
from router.stream.items import SourceOptions
from router.stream.source import ReplicationSource
from router.testing.mesh import execute

FAST = SourceOptions(status_interval=0.2, backoff_initial=0.05, backoff_max=0.5, receive_timeout=10)


@pytest.fixture
async def node(pg_nodes: Any) -> Any:
    (n,) = pg_nodes(1)
    await execute(
        n.dsn(), "CREATE TABLE t (id int PRIMARY KEY, v text)", "CREATE PUBLICATION pub FOR TABLE t"
    )
    return n


async def take(source: ReplicationSource, n: int, wire: list[bool] | None = None) -> list[Transaction]:
    """`n` transactions, each confirmed; into `wire`, whether the stream was read past libpq."""
    out: list[Transaction] = []
    async with contextlib.aclosing(source.stream()) as items:
        while len(out) < n:
            item = await asyncio.wait_for(anext(items), 60)
            if isinstance(item, Transaction):
                out.append(item)
                source.confirm(item.end_lsn)
                if wire is not None:
                    wire.append(source.connection.reads_past_libpq)
        if n:
            await source.send_status()
    return out


def rows(txns: list[Transaction]) -> list[tuple[int, int]]:
    """(id, length of v) of every insert; text values (proto_version 1, text)."""
    out = []
    for txn in txns:
        for change in txn.changes:
            if isinstance(change, Insert):
                key, value = change.new.values[0], change.new.values[1]
                assert isinstance(key, bytes) and isinstance(value, bytes)
                out.append((int(key), len(value)))
    return out


def ids_of(txn: Transaction) -> list[int]:
    """The ids of a transaction's inserts (binary values)."""
    return [int.from_bytes(c.new.values[0], "big") for c in txn.changes if isinstance(c, Insert)]  # type: ignore[arg-type]


WORKLOAD = (
    "INSERT INTO t SELECT g, repeat('x', 100) FROM generate_series(1, 5000) g",  # many reads' worth
    "INSERT INTO t VALUES (5001, repeat(md5('a'), 200000))",  # one 6.4 MB message
    "INSERT INTO t VALUES (5002, 'small')",
)
EXPECTED = [(i, 100) for i in range(1, 5001)] + [(5001, 6_400_000), (5002, 5)]


@pytest.mark.parametrize("own_reads", [True, False], ids=["wire", "libpq"])
async def test_both_readers_hand_out_the_same_transactions(
    node: Any, own_reads: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ReplicationConnection, "own_reads", own_reads)
    options = SourceOptions(proto_version=1, binary=False, streaming=False, status_interval=0.2)
    source = ReplicationSource(node.name, node.dsn(), "s1", ["pub"], options=options)
    await source.create_slot()
    await execute(node.dsn(), *WORKLOAD)
    try:
        wire: list[bool] = []
        txns = await take(source, 3, wire)
        assert wire == [own_reads] * 3
    finally:
        await source.close()
    assert rows(txns) == EXPECTED
    assert source.stats.bytes_received > 6_400_000 + 5000 * 100
    info = await source.slot_info()
    assert info is not None and info.confirmed_flush_lsn == txns[-1].end_lsn  # status updates got there


async def test_walsender_ended_mid_stream_reconnects_without_loss(node: Any) -> None:
    source = ReplicationSource(node.name, node.dsn(), "s1", ["pub"], options=FAST)
    await source.create_slot()
    seen: list[int] = []
    try:
        async with contextlib.aclosing(source.stream()) as items:
            for first in (1, 11, 21):
                inserts = (f"INSERT INTO t VALUES ({i}, 'v')" for i in range(first, first + 10))
                await execute(node.dsn(), *inserts)
                while len(seen) < first + 9:
                    item = await asyncio.wait_for(anext(items), 60)
                    if isinstance(item, Transaction):
                        seen += ids_of(item)
                        source.confirm(item.end_lsn)
                assert source.connection.reads_past_libpq
                # the walsender's FATAL 57P01 arrives as an ErrorResponse on the socket
                await execute(node.dsn(), "SELECT pg_terminate_backend(pid) FROM pg_stat_replication")
    finally:
        await source.close()
    assert seen == list(range(1, 31))
    assert source.stats.reconnects >= 1


async def test_refused_start_is_a_slot_error(node: Any) -> None:
    source = ReplicationSource(node.name, node.dsn(), "no_such_slot", ["pub"], options=FAST)
    try:
        with pytest.raises(SlotError) as caught:
            await take(source, 1)
    finally:
        await source.close()
    assert caught.value.sqlstate == "42704"
    assert "does not exist" in str(caught.value)


async def test_rewind_wakes_the_reader_waiting_on_the_socket(node: Any) -> None:
    source = ReplicationSource(node.name, node.dsn(), "s1", ["pub"], options=FAST)
    await source.create_slot()
    await execute(node.dsn(), "INSERT INTO t VALUES (1, 'a')", "INSERT INTO t VALUES (2, 'b')")
    try:
        async with contextlib.aclosing(source.stream()) as items:
            first = await asyncio.wait_for(anext(items), 60)
            second = await asyncio.wait_for(anext(items), 60)
            assert isinstance(first, Transaction) and isinstance(second, Transaction)
            waiting = asyncio.ensure_future(anext(items))  # nothing more: the reader waits on the socket
            for _ in range(10):  # let it get there (no fixed sleep: a rewind before the wait is fine too)
                await asyncio.sleep(0)
            assert not waiting.done()
            source.rewind(first.end_lsn)
            again = await asyncio.wait_for(waiting, 30)
            assert isinstance(again, Transaction) and again.commit_lsn == second.commit_lsn
    finally:
        await source.close()
