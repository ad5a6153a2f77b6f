"""One huge transaction through the source: memory bound off, at the default 64 MB, and at 256 kB.

What it measures, on one throw-away local PostgreSQL 15 node (logical_decoding_work_mem = 64kB, so
pgoutput with streaming on sends the transaction in many stream blocks while it is decoded):

  (a) end to end, in a fresh process per bound: `ReplicationSource.stream()` (proto_version 2,
      streaming, binary) until the transaction is handed out; wall time, the process's CPU time, and
      the peak RSS growth (VmHWM, reset just before streaming);
  (b) the router side alone: the captured XLogData payloads fed through Decoder + TransactionAssembler
      (+ Spool.write for each Spill) in memory, best of a few passes: rows/s of decode + assemble +
      spill, with the spill files on the local temporary directory.

Reproduce (the node is created and destroyed by the script):

    .venv/bin/python -m bench.micro.spill                 # 1,000,000 rows
    .venv/bin/python -m bench.micro.spill --rows 200000

Owns: the big transaction, the per-bound child processes and the table. Must not: keep the node or its
spill files (both are removed), or compare against anything but its own bounds (no native anchor: the
server's own spilling is what logical_decoding_work_mem sets).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

from protocol.pgoutput import Decoder
from protocol.transactions import Spill, SpillDropped, Transaction, TransactionAssembler
from router.stream.items import SourceOptions
from router.stream.source import ReplicationSource
from router.stream.spool import Spool
from router.testing.localnodes import create_nodes

PUBLICATION = "spill_pub"
SETTINGS = {"logical_decoding_work_mem": "64kB", "max_wal_size": "4GB", "checkpoint_timeout": "30min"}
BOUNDS = {"off": 0, "64 MB": 64 << 20, "256 kB": 256 << 10}
XLOG_PAYLOAD = 25
PASSES = 3


def options(bound: int) -> SourceOptions:
    return SourceOptions(proto_version=2, streaming=True, binary=True, spill_bytes=bound)


def peak_rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def reset_peak_rss() -> int:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return peak_rss_kb()


async def stream_one(dsn: str, slot: str, bound: int) -> dict[str, Any]:
    """(a), in this process: stream until the big transaction is handed out."""
    with tempfile.TemporaryDirectory() as tmp:
        spool = Spool(tmp, cluster="bench")
        source = ReplicationSource("bench", dsn, slot, [PUBLICATION], options=options(bound), spool=spool)
        base = reset_peak_rss()
        cpu = time.process_time()
        start = time.perf_counter()
        try:
            async with contextlib.aclosing(source.stream()) as items:
                async for item in items:
                    if isinstance(item, Transaction):
                        rows = item.row_count
                        break
        finally:
            await source.close()
        seconds = time.perf_counter() - start
        cpu = time.process_time() - cpu
        growth = peak_rss_kb() - base
        result = {"rows": rows, "seconds": seconds, "cpu": cpu, "rss_growth_kb": growth,
                  "spills": source.stats.spills, "spilled_bytes": spool.bytes_written,
                  "held_max": source.stats.spill_peak_bytes}
        spool.close()
    return result


async def capture(dsn: str, slot: str) -> list[tuple[int, bytes]]:
    source = ReplicationSource("bench", dsn, slot, [PUBLICATION], options=options(0))
    out: list[tuple[int, bytes]] = []
    try:
        async with contextlib.aclosing(source.raw_frames()) as frames:
            async for frame in frames:
                out.append((frame.wal_start, b"w" + bytes(24) + frame.payload))
                if frame.payload[:1] in (b"C", b"c"):
                    break
    finally:
        await source.close()
    return out


def feed_all(frames: list[tuple[int, bytes]], bound: int, spool: Spool) -> int:
    """(b): decode + assemble (+ spill) every frame; returns the rows of the transaction."""
    decode = Decoder().decode
    feed = TransactionAssembler(bound or None).feed
    rows = 0
    for lsn, body in frames:
        out = feed(decode(body, lsn, XLOG_PAYLOAD), lsn, len(body) - XLOG_PAYLOAD)
        if out is None:
            continue
        if isinstance(out, Spill):
            spool.write("bench", out)
        elif isinstance(out, Transaction):
            rows += out.row_count
            handle = spool.finish("bench", out.xid)
            if handle is not None:
                handle.discard()
        elif isinstance(out, SpillDropped):
            spool.drop("bench", out.xid)
    return rows


def in_memory(dsn: str, slot: str) -> dict[str, Any]:
    frames = asyncio.run(capture(dsn, slot))
    results: dict[str, Any] = {}
    for name, bound in BOUNDS.items():
        best = best_cpu = float("inf")
        rows = 0
        for _ in range(PASSES):
            with tempfile.TemporaryDirectory() as tmp:
                spool = Spool(tmp, cluster="bench")
                start, cpu = time.perf_counter(), time.process_time()
                rows = feed_all(frames, bound, spool)
                best = min(best, time.perf_counter() - start)
                best_cpu = min(best_cpu, time.process_time() - cpu)
                spool.close()
        results[name] = {"rows": rows, "seconds": best, "cpu": best_cpu}
    return results


def child(argv: Sequence[str]) -> int:
    kind, dsn, slot, bound = argv
    result = asyncio.run(stream_one(dsn, slot, int(bound))) if kind == "stream" else in_memory(dsn, slot)
    print(json.dumps(result))
    return 0


def run_child(*args: str) -> Any:
    done = subprocess.run([sys.executable, "-m", "bench.micro.spill", "--child", *args], check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.spill", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child)
    node = create_nodes(["spillbench"], settings=SETTINGS)[0]
    try:
        dsn = node.dsn()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE big (id int PRIMARY KEY, v text)")
            conn.execute(f"CREATE PUBLICATION {PUBLICATION} FOR ALL TABLES")
            slots = [f"s{i}" for i in range(len(BOUNDS) + 1)]
            for slot in slots:
                conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", [slot])
            conn.execute(f"INSERT INTO big SELECT i, 'row number ' || i FROM generate_series(1, {args.rows})"
                         " AS i")
        print(f"{args.rows:,} rows in one transaction; logical_decoding_work_mem 64kB (streamed)\n")
        print("(a) end to end, a fresh process per bound")
        print(f"{'bound':>8} {'wall s':>7} {'rows/s':>10} {'cpu s':>6} {'rows/cpu-s':>11} {'peak RSS +':>11}"
              f" {'spills':>7} {'on disk':>9}")
        for (name, bound), slot in zip(BOUNDS.items(), slots, strict=False):
            r = run_child("stream", dsn, slot, str(bound))
            assert r["rows"] == args.rows, r
            print(f"{name:>8} {r['seconds']:7.2f} {r['rows'] / r['seconds']:10,.0f} {r['cpu']:6.2f}"
                  f" {r['rows'] / r['cpu']:11,.0f} {r['rss_growth_kb'] / 1024:9.1f}MB {r['spills']:7d}"
                  f" {r['spilled_bytes'] / 2**20:7.1f}MB")
        r = run_child("memory", dsn, slots[-1], "0")
        print(f"\n(b) router side alone (decode + assemble + spill), best of {PASSES}")
        print(f"{'bound':>8} {'wall s':>7} {'rows/s':>10} {'cpu s':>6} {'rows/cpu-s':>11}")
        for name, m in r.items():
            print(f"{name:>8} {m['seconds']:7.2f} {m['rows'] / m['seconds']:10,.0f} {m['cpu']:6.2f}"
                  f" {m['rows'] / m['cpu']:11,.0f}")
    finally:
        node.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
