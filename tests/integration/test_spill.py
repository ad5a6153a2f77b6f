"""A huge transaction against a real PostgreSQL 15: the source keeps a bounded part of it in memory.

The node runs with logical_decoding_work_mem = 64kB, so pgoutput (proto_version 2, streaming on)
sends the transaction while it is decoded, in many stream blocks; with streaming off the server spills
on its side and sends it whole at the commit. Either way the source holds at most `spill_bytes` (plus
one message) per open transaction, the rest goes to the spool, and `iter_chunks` gives back every row,
in order. A rewind in the middle drops the partial file: the server sends the transaction again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest

from protocol.messages import Insert, Message
from protocol.transactions import Transaction
from router.stream.items import SourceOptions
from router.stream.source import ReplicationSource
from router.stream.spool import SpillFile, Spool, iter_chunks, let_go
from router.testing.mesh import peak_rss_kb, reset_peak_rss, wait_for

logger = logging.getLogger(__name__)

ROWS = 200_000
BOUND = 256 * 1024
SCHEMA = """
CREATE TABLE big (id int PRIMARY KEY, v text);
CREATE PUBLICATION pub FOR ALL TABLES;
"""
WORKLOAD = f"INSERT INTO big SELECT i, 'row number ' || i FROM generate_series(1, {ROWS}) AS i"


async def execute(dsn: str, *statements: str) -> None:
    import psycopg

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            await conn.execute(statement)


@pytest.fixture
async def node(pg_nodes: Any) -> Any:
    (n,) = pg_nodes(1, settings={"logical_decoding_work_mem": "64kB", "wal_sender_timeout": "30s"})
    await execute(n.dsn(), SCHEMA)
    return n


async def next_transaction(items: AsyncGenerator[Transaction | Message, None]) -> Transaction:
    while True:
        item = await asyncio.wait_for(anext(items), 120)
        if isinstance(item, Transaction):
            return item


class Watch:
    """Samples the most the source's assembler holds whenever the reader lets other tasks run."""

    def __init__(self, source: ReplicationSource) -> None:
        self.source = source
        self.held = 0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.held = max(self.held, self.source._assembler.buffered_bytes)
            await asyncio.sleep(0)

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def ids_in_order(txn: Transaction, max_changes: int) -> list[int]:
    ids: list[int] = []
    for chunk in iter_chunks(txn, max_changes=max_changes):
        assert 0 < len(chunk) <= max_changes
        ids.extend(struct.unpack(">i", c.new.values[0])[0] for c in chunk if isinstance(c, Insert))  # type: ignore[arg-type]
    return ids


@pytest.mark.parametrize("streaming", [True, False], ids=["streamed", "whole"])
async def test_huge_transaction_spills_within_the_bound(node: Any, tmp_path: Path, streaming: bool) -> None:
    spool = Spool(tmp_path, cluster="spilltest")
    options = SourceOptions(proto_version=2, streaming=streaming, binary=True, status_interval=0.5,
                            spill_bytes=BOUND)
    source = ReplicationSource(node.name, node.dsn(), "s1", ["pub"], options=options, spool=spool)
    await source.create_slot()
    await execute(node.dsn(), WORKLOAD)
    before = reset_peak_rss()
    items = source.stream()
    watch = Watch(source)
    started = time.perf_counter()
    try:
        txn = await next_transaction(items)
        elapsed = time.perf_counter() - started
    finally:
        await watch.stop()
        await items.aclose()
        await source.close()
    growth = peak_rss_kb() - before
    largest_message = 64  # an Insert of (int, 'row number N') in binary: well under this
    assert txn.streamed is streaming
    assert txn.row_count == ROWS and txn.spilled + len(txn.changes) == ROWS + 1  # + the Relation
    assert source.stats.spills >= (ROWS * 20) // BOUND  # about 30 bytes a row
    assert source.stats.spill_peak_bytes <= BOUND + largest_message  # never more than the bound + one message
    assert watch.held <= BOUND + largest_message and txn.nbytes <= BOUND
    handle = txn.spill
    assert isinstance(handle, SpillFile) and handle.path.exists()
    assert handle.path.parent.parent == tmp_path
    assert ids_in_order(txn, 7_000) == list(range(1, ROWS + 1))
    assert source.stats.raw_inserts > ROWS // 2  # after the first spill, rows stay the server's bytes
    handle.acquire(2)  # two links took it
    let_go(txn)
    assert handle.path.exists()
    let_go(txn)
    assert not handle.path.exists() and spool.files == 0
    directory = handle.path.parent
    spool.close()
    assert not directory.exists()
    logger.warning(
        "spill test (%s): %d rows in %.2f s (%.0f rows/s incl. decode and spill), %d spills, %d bytes on"
        " disk, held at most %d bytes, peak RSS growth %d kB",
        "streamed" if streaming else "whole", ROWS, elapsed, ROWS / elapsed, source.stats.spills,
        spool.bytes_written, max(watch.held, source.stats.spill_peak_bytes), growth,
    )
    assert growth < 32_000  # kB; held in memory, the decoded rows alone take about 60 MB (300 bytes each)


@pytest.mark.parametrize("how", ["rewind", "reconnect"])
async def test_restart_in_the_middle_drops_the_partial_file(
    node: Any, tmp_path: Path, tcp_proxy: Any, how: str
) -> None:
    """The transaction is still open on the node while its first half streams in and spills; the
    source then rewinds (or loses its connection): the partial file goes, the server sends it again."""
    import psycopg

    proxy = tcp_proxy("127.0.0.1", node.port)
    dsn = node.dsn().replace(f"port={node.port}", f"port={proxy.port}")
    spool = Spool(tmp_path, cluster="spilltest")
    options = SourceOptions(proto_version=2, streaming=True, binary=True, status_interval=0.5,
                            backoff_initial=0.05, backoff_max=0.2, spill_bytes=BOUND)
    source = ReplicationSource(node.name, dsn, "s1", ["pub"], options=options, spool=spool)
    await source.create_slot()
    half = ROWS // 2
    items = source.stream()
    reader = asyncio.ensure_future(next_transaction(items))
    try:
        async with await psycopg.AsyncConnection.connect(node.dsn()) as writer:
            await writer.execute(WORKLOAD.replace(str(ROWS), str(half)))  # not committed yet
            await wait_for(lambda: source.stats.spills >= 3 and not source._assembler.idle,
                           "open one spilling")
            (partial,) = [h.path for h in spool._open.values()]
            assert partial.exists()
            if how == "rewind":
                source.rewind(source.confirmed_lsn)
            else:
                proxy.cut()
                await wait_for(lambda: source.state == "reconnecting", "the source to notice the cut")
                proxy.restore()
            await wait_for(lambda: not partial.exists(), "the partial file to go")
            await wait_for(lambda: spool.files_written == 2 and source.stats.spills >= 6, "the new spills")
            await writer.execute(f"INSERT INTO big SELECT i, 'row number ' || i FROM"
                                 f" generate_series({half + 1}, {ROWS}) AS i")
            await writer.commit()
        txn = await asyncio.wait_for(reader, 120)
    finally:
        reader.cancel()
        await items.aclose()
        await source.close()
    assert txn.streamed and txn.row_count == ROWS
    assert isinstance(txn.spill, SpillFile) and txn.spill.path != partial and spool.files == 1
    assert ids_in_order(txn, 50_000) == list(range(1, ROWS + 1))
    assert (source.stats.reconnects >= 1) if how == "reconnect" else True
    spool.close()
