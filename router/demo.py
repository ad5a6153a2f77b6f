"""`pgmesh demo`: throw-away local nodes, writes on one, its decoded changes printed live.

For now (until the router core lands) the demo shows the foundation end to end: it starts local
PostgreSQL 15 nodes with `router.localnodes`, creates a table and a publication, streams one node's
changes through a real `ReplicationSource` (decoded once by `protocol/`), prints each committed
transaction as it arrives, confirms it, and ends by checking that every transaction written arrived
exactly once and that the slot's confirmed position reached the last one. It owns its nodes and removes
them at the end (unless asked to keep them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import psycopg

from protocol.lsn import format_lsn, pg_us_to_datetime
from protocol.messages import Delete, Insert, Message, Relation, Truncate, TupleData, Update
from protocol.transactions import Transaction
from router.localnodes import LocalNode, create_nodes
from router.source import ReplicationSource, SourceOptions

__all__ = ["format_transaction", "run_demo"]

logger = logging.getLogger(__name__)

DEMO_SCHEMA = """
CREATE TABLE IF NOT EXISTS accounts (id int PRIMARY KEY, owner text NOT NULL, balance numeric NOT NULL);
CREATE PUBLICATION pgmesh_demo FOR TABLE accounts;
"""


def _row_text(relation: Relation, row: TupleData, *, keys_only: bool = False) -> str:
    cells = []
    for column, kind, value in zip(relation.columns, row.kinds, row.values, strict=False):
        if keys_only and not column.key:
            continue
        if kind == 0x6E:  # n
            shown = "NULL"
        elif kind == 0x75:  # u
            shown = "<unchanged>"
        elif isinstance(value, bytes):
            shown = repr(value.decode(errors="replace")) if kind == 0x74 else f"<{len(value)} bytes>"
        else:
            shown = "?"
        cells.append(f"{column.name}={shown}")
    return ", ".join(cells)


def format_transaction(node: str, txn: Transaction) -> list[str]:
    """Human-readable lines for one decoded transaction."""
    when = pg_us_to_datetime(txn.commit_time).strftime("%H:%M:%S.%f")[:-3]
    origin = f" origin {txn.origin}" if txn.origin else ""
    lines = [f"[{node}] COMMIT {format_lsn(txn.commit_lsn)} xid {txn.xid} at {when}{origin}"]
    relations = dict(txn.relations)
    for change in txn.changes:
        if isinstance(change, Relation):
            relations[change.relid] = change
            continue
        if isinstance(change, Insert):
            rel = relations[change.relid]
            lines.append(f"    INSERT {rel.schema}.{rel.name} ({_row_text(rel, change.new)})")
        elif isinstance(change, Update):
            rel = relations[change.relid]
            lines.append(f"    UPDATE {rel.schema}.{rel.name} ({_row_text(rel, change.new)})")
        elif isinstance(change, Delete):
            rel = relations[change.relid]
            old = _row_text(rel, change.old, keys_only=change.old_kind == "K")
            lines.append(f"    DELETE {rel.schema}.{rel.name} ({old})")
        elif isinstance(change, Truncate):
            names = ", ".join(relations[r].name for r in change.relids)
            lines.append(f"    TRUNCATE {names}")
        elif isinstance(change, Message):
            lines.append(f"    MESSAGE {change.prefix}: {change.content[:60]!r}")
    return lines


async def _write_workload(dsn: str, transactions: int, stop: asyncio.Event) -> int:
    """Small banking workload, one statement per transaction; returns how many committed."""
    done = 0
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for i in range(transactions):
            if stop.is_set():
                break
            account = i % 5 + 1
            if i < 5:
                await conn.execute(
                    "INSERT INTO accounts VALUES (%s, %s, 100)", [account, f"owner-{account}"]
                )
            elif i % 7 == 0:
                await conn.execute("DELETE FROM accounts WHERE id = %s", [account])
                await conn.execute("INSERT INTO accounts VALUES (%s, 'reopened', 0)", [account])
                done += 1
            else:
                await conn.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", [i, account])
            done += 1
            await asyncio.sleep(0.2)
    return done


async def run_demo(
    *, seconds: float = 8.0, keep: bool = False, out: TextIO = sys.stdout
) -> int:
    """Run the demo; returns a process exit code (0 when every transaction arrived exactly once)."""
    print("pgmesh demo: starting two throw-away PostgreSQL nodes ...", file=out, flush=True)
    nodes: list[LocalNode] = await asyncio.to_thread(create_nodes, ["a", "b"])
    stop = asyncio.Event()
    _install_stop_handlers(stop.set)
    try:
        source_node = nodes[0]
        dsn = source_node.dsn()
        for node in nodes:
            print(f"  node {node.name}: 127.0.0.1:{node.port} ({node.datadir})", file=out)
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(DEMO_SCHEMA)
        options = SourceOptions(binary=False, status_interval=1.0)
        source = ReplicationSource(source_node.name, dsn, "pgmesh_demo", ["pgmesh_demo"], options=options)
        await source.create_slot()
        transactions = max(1, int(seconds / 0.2))
        writer = asyncio.create_task(_write_workload(dsn, transactions, stop))
        print(f"streaming node {source_node.name}'s changes (Ctrl-C stops):", file=out, flush=True)
        received = await _print_stream(source, writer, out)
        written = await writer
        await source.send_status()
        info = await source.slot_info()
        await source.close()
        confirmed = info.confirmed_flush_lsn if info else None
        ok = received == written and confirmed is not None and confirmed >= source.delivered_lsn
        print(
            f"\nwritten {written} transactions, received {received}; slot confirmed at "
            f"{format_lsn(confirmed or 0)}: {'OK' if ok else 'MISMATCH'}",
            file=out,
        )
        return 0 if ok else 1
    finally:
        if keep:
            print("keeping the nodes (--keep); remove their directories when done", file=out)
        else:
            for node in nodes:
                await asyncio.to_thread(node.destroy)


async def _print_stream(source: ReplicationSource, writer: asyncio.Task[int], out: TextIO) -> int:
    """Print transactions until the writer is done and all it wrote arrived (or 15 s passed after it)."""
    received = 0
    deadline: float | None = None
    items = source.stream()
    try:
        while True:
            if writer.done():
                if received >= writer.result():
                    break
                deadline = deadline or time.monotonic() + 15.0
                if time.monotonic() > deadline:
                    break
            try:
                item = await asyncio.wait_for(anext(items), 0.5)
            except TimeoutError:
                continue
            if isinstance(item, Transaction):
                received += 1
                for line in format_transaction(source.node, item):
                    print(line, file=out, flush=True)
                source.confirm(item.end_lsn)
    finally:
        await items.aclose()
    return received


def _install_stop_handlers(stop: Callable[[], Any]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop)

