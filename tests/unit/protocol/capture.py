"""Capture pgoutput bytes from a real PostgreSQL server into tests/unit/protocol/data/.

Run: `.venv/bin/python -m tests.unit.protocol.capture` (starts a throw-away node, runs the scenario, writes
one JSON file per slot configuration). The decoder tests read those files; they never need a server.
`... capture v4` captures the proto_version 4 files instead, from a PostgreSQL 18 node (see V4_SLOTS).

Four slots see the same scenario: proto_version 1 in text and in binary, proto_version 2 with
streaming in text and in binary. The scenario covers every pgoutput message PostgreSQL 15 sends:
Relation, Type, Insert (NULLs, a TOASTed value), Update (unchanged TOAST, old key 'K', old row 'O'),
Delete ('K' and 'O'), Truncate (plain; CASCADE with RESTART IDENTITY), logical messages
(transactional, non-transactional, binary content), a Relation sent again after ALTER TABLE, an Origin
message from a session with a replication origin, and (in the v2 files) streamed transactions: one
committed, one aborted, one with an aborted subtransaction, and a small one interleaved with a stream.
"""

from __future__ import annotations

import asyncio
import json
import struct
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg

from protocol.lsn import format_lsn
from router.stream.items import SourceOptions
from router.stream.source import ReplicationSource
from router.testing.localnodes import create_nodes

DATA = Path(__file__).parent / "data"
END_MARKER = b"pgmesh.capture.end"

SLOTS: dict[str, SourceOptions] = {
    "text_v1": SourceOptions(proto_version=1, binary=False, streaming=False),
    "binary_v1": SourceOptions(proto_version=1, binary=True, streaming=False),
    "text_v2_stream": SourceOptions(proto_version=2, binary=False, streaming=True),
    "binary_v2_stream": SourceOptions(proto_version=2, binary=True, streaming=True),
}

# proto_version 4 (PostgreSQL 16+), from an 18 node, text, the streamed part of the scenario only: once
# with streaming 'parallel' (Stream Abort carries the abort's LSN and time) and once with 'on' (it does
# not), so that a test can check that nothing else differs between the two.
V4_VERSION = 18
V4_SLOTS: dict[str, SourceOptions] = {
    "text_v4_parallel": SourceOptions(proto_version=4, binary=False, streaming=True, parallel_streaming=True),
    "text_v4_on": SourceOptions(proto_version=4, binary=False, streaming=True, parallel_streaming=False),
}

SCHEMA = """
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE items (id int PRIMARY KEY, name text, qty int, price numeric(10,2), tags text[],
                    m mood, big text, note varchar(20));
CREATE TABLE full_ident (a int, b text);
ALTER TABLE full_ident REPLICA IDENTITY FULL;
CREATE TABLE parent (id int PRIMARY KEY);
CREATE TABLE child (id serial PRIMARY KEY, pid int REFERENCES parent (id));
CREATE TABLE bulk (id int PRIMARY KEY, payload text);
CREATE PUBLICATION cap FOR ALL TABLES;
SELECT pg_replication_origin_create('pgmesh_capture_origin');
"""

# Each entry is one transaction (autocommit statements, or a list run inside BEGIN/COMMIT).
DML: list[str | list[str]] = [
    "INSERT INTO items VALUES (1, 'one', 10, 1.50, '{a,b}', 'ok', NULL, 'n1')",
    "INSERT INTO items (id, name, qty, big) SELECT 2, 'two', 20, string_agg(md5(i::text), '')"
    " FROM generate_series(1, 250) AS i",
    "UPDATE items SET qty = qty + 1 WHERE id = 2",
    "UPDATE items SET id = 3 WHERE id = 1",
    "DELETE FROM items WHERE id = 3",
    "INSERT INTO full_ident VALUES (1, 'x'), (2, NULL)",
    "UPDATE full_ident SET b = 'y' WHERE a = 1",
    "DELETE FROM full_ident WHERE a = 2",
    ["INSERT INTO parent SELECT generate_series(1, 3)", "INSERT INTO child (pid) VALUES (1), (2)"],
    "SELECT pg_logical_emit_message(true, 'pgmesh.test', 'transactional hello')",
    "SELECT pg_logical_emit_message(false, 'pgmesh.test', 'non-transactional hello')",
    "SELECT pg_logical_emit_message(true, 'pgmesh.bin', '\\x00ff00'::bytea)",
    "TRUNCATE parent, child RESTART IDENTITY CASCADE",
    "TRUNCATE full_ident",
    "ALTER TABLE items ADD COLUMN extra int DEFAULT 7",
    "INSERT INTO items (id, name) VALUES (4, 'four')",
]

STREAMED: list[str | list[str]] = [
    "INSERT INTO bulk SELECT i, repeat('x', 40) FROM generate_series(1, 1500) AS i",
    ["INSERT INTO bulk SELECT i, 'gone' FROM generate_series(10001, 11500) AS i", "ROLLBACK"],
    [
        "INSERT INTO bulk SELECT i, 'kept-a' FROM generate_series(20001, 21000) AS i",
        "SAVEPOINT s1",
        "INSERT INTO bulk SELECT i, 'rolled-back' FROM generate_series(21001, 22000) AS i",
        "ROLLBACK TO SAVEPOINT s1",
        "INSERT INTO bulk SELECT i, 'kept-b' FROM generate_series(22001, 22010) AS i",
        "SELECT pg_logical_emit_message(true, 'pgmesh.test', 'inside a stream')",
    ],
]


async def run_transaction(conn: psycopg.AsyncConnection[Any], step: str | list[str]) -> None:
    if isinstance(step, str):
        await conn.execute(step)
        return
    await conn.execute("BEGIN")
    for statement in step:
        await conn.execute(statement)
    if step[-1] != "ROLLBACK":
        await conn.execute("COMMIT")


async def scenario_v4(dsn: str, streamed: Callable[[int], Awaitable[None]]) -> None:
    """The streamed transactions, read live: PostgreSQL 18 does not stream a transaction it already knows
    aborted, so the one that aborts whole rolls back only once `streamed(xid)` (every slot has sent a
    Stream Start for it)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await run_transaction(conn, STREAMED[0])
        await conn.execute("BEGIN")
        cur = await conn.execute("SELECT txid_current() % 4294967296")
        row = await cur.fetchone()
        assert row is not None
        await conn.execute("INSERT INTO bulk SELECT i, 'gone' FROM generate_series(10001, 11500) AS i")
        await streamed(int(row[0]))
        await conn.execute("ROLLBACK")
        await run_transaction(conn, STREAMED[2])
        await conn.execute(f"SELECT pg_logical_emit_message(false, '{END_MARKER.decode()}', 'end')")


class StreamStarts:
    """The xids each live capture has seen a Stream Start for, to wait on."""

    def __init__(self, slots: list[str]) -> None:
        self.seen: dict[str, set[int]] = {slot: set() for slot in slots}
        self.changed = asyncio.Condition()

    async def saw(self, slot: str, payload: bytes) -> None:
        if payload[:1] == b"S":
            async with self.changed:
                self.seen[slot].add(struct.unpack_from(">I", payload, 1)[0])
                self.changed.notify_all()

    async def wait(self, xid: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: all(xid in xids for xids in self.seen.values()))


async def scenario(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for step in DML:
            await run_transaction(conn, step)
        # A transaction that carries a replication origin, as pgmesh's applier will write them.
        await conn.execute("SELECT pg_replication_origin_session_setup('pgmesh_capture_origin')")
        await conn.execute("BEGIN")
        await conn.execute("SELECT pg_replication_origin_xact_setup('0/ABCDEF', '2024-01-02 03:04:05+00')")
        await conn.execute("INSERT INTO items (id, name) VALUES (5, 'from elsewhere')")
        await conn.execute("COMMIT")
        await conn.execute("SELECT pg_replication_origin_session_reset()")
        for step in STREAMED:
            await run_transaction(conn, step)
        # A small transaction that commits while a large one is being streamed.
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as other:
            await conn.execute("BEGIN")
            await conn.execute("INSERT INTO bulk SELECT i, 'big' FROM generate_series(30001, 31500) AS i")
            await other.execute("INSERT INTO items (id, name) VALUES (6, 'interleaved')")
            await conn.execute("INSERT INTO bulk SELECT i, 'big' FROM generate_series(31501, 32000) AS i")
            await conn.execute("COMMIT")
        await conn.execute(f"SELECT pg_logical_emit_message(false, '{END_MARKER.decode()}', 'end')")


async def capture_slot(
    dsn: str, slot: str, options: SourceOptions, starts: StreamStarts | None = None
) -> list[dict[str, Any]]:
    # logical_decoding_work_mem is read by the walsender: 64kB makes the bulk transactions stream.
    stream_dsn = f"{dsn} options='-c logical_decoding_work_mem=64kB'"
    source = ReplicationSource("capture", stream_dsn, slot, ["cap"], options=options)
    frames: list[dict[str, Any]] = []
    try:
        async for frame in source.raw_frames():
            if END_MARKER in frame.payload:
                break
            frames.append({"wal_start": format_lsn(frame.wal_start), "payload": frame.payload.hex()})
            if starts is not None:
                await starts.saw(slot, frame.payload)
    finally:
        await source.close()
    return frames


async def main(v4: bool = False) -> None:
    slots = V4_SLOTS if v4 else SLOTS
    (node,) = create_nodes(["capture"], versions=[V4_VERSION if v4 else None])
    try:
        dsn = node.dsn()
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(SCHEMA)
            cur = await conn.execute("SHOW server_version")
            row = await cur.fetchone()
            version = str(row[0]) if row else "?"
        for slot, options in slots.items():
            await ReplicationSource("capture", dsn, slot, ["cap"], options=options).create_slot()
        if v4:
            starts = StreamStarts(list(slots))
            async with asyncio.TaskGroup() as group:
                live = {s: group.create_task(capture_slot(dsn, s, o, starts)) for s, o in slots.items()}
                await scenario_v4(dsn, starts.wait)
            captured = {slot: task.result() for slot, task in live.items()}
        else:
            await scenario(dsn)
            captured = {slot: await capture_slot(dsn, slot, options) for slot, options in slots.items()}
        DATA.mkdir(parents=True, exist_ok=True)
        for slot, options in slots.items():
            frames = captured[slot]
            opts: dict[str, object] = {"proto_version": options.proto_version, "binary": options.binary,
                                       "streaming": options.streaming, "messages": True}
            if v4:
                opts["streaming_mode"] = "parallel" if options.parallel_streaming else "on"
            document = {"server_version": version, "options": opts, "frames": frames}
            path = DATA / f"{slot}.json"
            path.write_text(json.dumps(document, indent=0) + "\n")
            print(f"{path}: {len(frames)} frames", file=sys.stderr)
    finally:
        node.destroy()


if __name__ == "__main__":
    asyncio.run(main(v4=sys.argv[1:] == ["v4"]))
