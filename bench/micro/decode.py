"""Receive-and-decode throughput: pgmesh's source + decoder beside PostgreSQL's own `pg_recvlogical`.

What it measures, on one throw-away local PostgreSQL 15 node and the same WAL for every consumer:

  (a) `pg_recvlogical` (the native C receiver) reading the workload from a fresh pgoutput slot into
      /dev/null; wall time of the whole process, from spawn to its exit at `--endpos`.
  (b) pgmesh end to end: `ReplicationSource.stream()` on a second fresh slot, from the call (connect +
      START_REPLICATION) until the last workload transaction (or the end marker) has been handed out,
      confirming each transaction's `end_lsn` like a real caller and counting row changes.
  (c) the decoder alone: `Decoder.decode` + `TransactionAssembler.feed` over the captured XLogData
      payloads in memory (best of several passes).
  (d) `Decoder.decode` alone over the same payloads.

Both (a) and (b) use the same plugin options: proto_version 1, binary true, messages true, no streaming.
The workload (`--rows` row changes: 60 % inserts, 25 % updates, 15 % deletes, committed 100 rows per
transaction by one DO block) is generated after the slots are created and before anything is timed;
then the end LSN is noted (`pg_current_wal_lsn()`) and a non-transactional logical message is emitted
as an end marker, so both receivers stop at the same place. The order of (a) and (b) alternates
between runs so neither always reads the WAL first. The headline is (b)/(a): rows/s of pgmesh's source
+ decoder relative to `pg_recvlogical` (target >= 0.9x); min and median are over the runs.

Reproduce (the node is created and destroyed by the script; nothing else is touched):

    .venv/bin/python -m bench.micro.decode                      # 200000 row changes, 3 runs
    .venv/bin/python -m bench.micro.decode --rows 20000 --runs 1 --json /tmp/decode.json
    .venv/bin/python -m pyinstrument -m bench.micro.decode --rows 50000 --runs 1   # where the time goes

It needs PostgreSQL 15+ binaries (see `router.testing.localnodes.find_pg_bindir`) including `pg_recvlogical`.

Owns: this workload, the four receivers' timings and the report. Must not: confirm past what it received,
keep a slot it created (each run drops its slots), or touch a node it did not create.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.harness.nodes import client_env, run_async
from protocol.lsn import format_lsn, parse_lsn
from protocol.messages import Message
from protocol.pgoutput import Decoder
from protocol.transactions import Transaction, TransactionAssembler
from router.stream.items import SourceOptions
from router.stream.source import ReplicationSource
from router.testing.localnodes import LocalNode, create_nodes, find_pg_bindir

TABLE = "bench_t"
PUBLICATION = "bench_pub"
MARKER_PREFIX = "pgmesh_bench_end"
ROWS_PER_TXN = 100
DECODE_PASSES = 5
PLUGIN_OPTIONS = {
    "proto_version": "1",
    "publication_names": PUBLICATION,
    "binary": "true",
    "messages": "true",
}
SOURCE_OPTIONS = SourceOptions(proto_version=1, binary=True, messages=True, streaming=False)
NODE_SETTINGS = {"max_wal_size": "4GB", "checkpoint_timeout": "30min"}
RECVLOGICAL_TIMEOUT_S = 600.0


# ---------------------------------------------------------------------------------------------------------
# Workload


@dataclass(frozen=True, slots=True)
class Workload:
    """How many row changes of each kind one run generates, committed ROWS_PER_TXN at a time."""

    inserts: int
    updates: int
    deletes: int

    @classmethod
    def for_rows(cls, rows: int) -> Workload:
        updates = rows * 25 // 100
        deletes = rows * 15 // 100
        return cls(rows - updates - deletes, updates, deletes)

    @property
    def rows(self) -> int:
        return self.inserts + self.updates + self.deletes

    @property
    def transactions(self) -> int:
        return sum(-(-n // ROWS_PER_TXN) for n in (self.inserts, self.updates, self.deletes))

    def sql(self) -> str:
        """One DO block: inserts, then updates of the first rows, then deletes of the last ones."""
        return f"""
DO $bench$
DECLARE
    lo int;
BEGIN
    lo := 1;
    WHILE lo <= {self.inserts} LOOP
        INSERT INTO {TABLE} (id, a, b, c)
            SELECT g, g % 1000, md5(g::text), now()
            FROM generate_series(lo, least(lo + {ROWS_PER_TXN - 1}, {self.inserts})) AS g;
        COMMIT;
        lo := lo + {ROWS_PER_TXN};
    END LOOP;
    lo := 1;
    WHILE lo <= {self.updates} LOOP
        UPDATE {TABLE} SET a = a + 1, b = b || 'u', c = now()
            WHERE id BETWEEN lo AND least(lo + {ROWS_PER_TXN - 1}, {self.updates});
        COMMIT;
        lo := lo + {ROWS_PER_TXN};
    END LOOP;
    lo := {self.inserts - self.deletes + 1};
    WHILE lo <= {self.inserts} LOOP
        DELETE FROM {TABLE} WHERE id BETWEEN lo AND least(lo + {ROWS_PER_TXN - 1}, {self.inserts});
        COMMIT;
        lo := lo + {ROWS_PER_TXN};
    END LOOP;
END
$bench$;
"""


def prepare_node(node: LocalNode) -> None:
    node.sql(f"CREATE TABLE {TABLE} (id int PRIMARY KEY, a int, b text, c timestamptz)")
    node.sql(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {TABLE}")


def create_slot(node: LocalNode, name: str) -> None:
    node.sql(f"SELECT pg_create_logical_replication_slot('{name}', 'pgoutput')")


def drop_slot(node: LocalNode, name: str) -> None:
    """Drop a slot, ending the walsender that may still hold it; no error when it is gone."""
    for _ in range(100):
        pid = node.sql(
            f"SELECT coalesce(active_pid::text, '-') FROM pg_replication_slots WHERE slot_name = '{name}'"
        )
        if not pid:
            return
        if pid == "-":
            with contextlib.suppress(Exception):
                node.sql(f"SELECT pg_drop_replication_slot('{name}')")
                return
        else:
            node.sql(f"SELECT pg_terminate_backend({pid})")
        time.sleep(0.1)
    raise RuntimeError(f"node {node.name}: slot {name} is still active after 10 s; drop it by hand")


def generate(node: LocalNode, workload: Workload) -> int:
    """Run the workload, then return the end LSN and emit the end marker just after it."""
    node.sql(workload.sql())
    end_lsn = parse_lsn(node.sql("SELECT pg_current_wal_lsn()"))
    node.sql(f"SELECT pg_logical_emit_message(false, '{MARKER_PREFIX}', 'end')")
    return end_lsn


# ---------------------------------------------------------------------------------------------------------
# The receivers


@dataclass(frozen=True, slots=True)
class Timing:
    seconds: float
    cpu_seconds: float
    rows: int


def run_pg_recvlogical(bindir: Path, dsn: str, slot: str, end_lsn: int, rows: int) -> Timing:
    """(a): pg_recvlogical from `slot` into /dev/null until `end_lsn`; wall time of the whole process."""
    argv = [str(bindir / "pg_recvlogical"), "-d", dsn, "--slot", slot, "--start", "--no-loop"]
    for name, value in PLUGIN_OPTIONS.items():
        argv += ["-o", f"{name}={value}"]
    argv += [f"--endpos={format_lsn(end_lsn)}", "-f", "/dev/null"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        argv, capture_output=True, text=True, env=client_env(), timeout=RECVLOGICAL_TIMEOUT_S
    )
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"pg_recvlogical exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Timing(seconds, cpu, rows)


def _is_marker(item: object) -> bool:
    return isinstance(item, Message) and item.prefix == MARKER_PREFIX


async def run_source(dsn: str, slot: str, end_lsn: int) -> Timing:
    """(b): ReplicationSource.stream() until the transaction ending at or after `end_lsn` (or the marker)."""
    source = ReplicationSource("bench", dsn, slot, (PUBLICATION,), options=SOURCE_OPTIONS)
    rows = 0
    cpu_start = time.process_time()
    start = time.perf_counter()
    try:
        async with contextlib.aclosing(source.stream()) as items:
            async for item in items:
                if isinstance(item, Transaction):
                    rows += item.row_count
                    source.confirm(item.end_lsn)
                    if item.end_lsn >= end_lsn:
                        break
                elif _is_marker(item):
                    break
        seconds = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
    finally:
        await source.close()
    return Timing(seconds, cpu, rows)


async def capture_payloads(dsn: str, slot: str, end_lsn: int) -> list[tuple[int, bytes]]:
    """(wal_start, payload) of every XLogData frame up to the end marker, via `raw_frames`."""
    source = ReplicationSource("bench-capture", dsn, slot, (PUBLICATION,), options=SOURCE_OPTIONS)
    captured: list[tuple[int, bytes]] = []
    try:
        async with contextlib.aclosing(source.raw_frames()) as frames:
            async for frame in frames:
                captured.append((frame.wal_start, frame.payload))
                tag = frame.payload[:1]
                if frame.wal_start >= end_lsn and tag in (b"C", b"M"):
                    break
    finally:
        await source.close()
    return captured


def time_decoder(payloads: Sequence[tuple[int, bytes]], *, assemble: bool, passes: int) -> Timing:
    """(c) / (d): best of `passes` in-memory passes over the captured payloads."""
    best = float("inf")
    best_cpu = 0.0
    rows = 0
    for _ in range(passes):
        decode = Decoder().decode
        feed = TransactionAssembler().feed
        counted = 0
        cpu_start = time.process_time()
        start = time.perf_counter()
        if assemble:
            for lsn, payload in payloads:
                out = feed(decode(payload, lsn), lsn, len(payload))
                if isinstance(out, Transaction):
                    counted += out.row_count
        else:
            for lsn, payload in payloads:
                decode(payload, lsn)
            counted = sum(1 for _, payload in payloads if payload[:1] in (b"I", b"U", b"D"))
        seconds = time.perf_counter() - start
        if seconds < best:
            best, best_cpu, rows = seconds, time.process_time() - cpu_start, counted
    return Timing(best, best_cpu, rows)


# ---------------------------------------------------------------------------------------------------------
# Runs


MEASURES = {
    "pg_recvlogical": "(a) pg_recvlogical -> /dev/null",
    "source": "(b) ReplicationSource.stream()",
    "decode_assemble": "(c) decode + assemble, in memory",
    "decode": "(d) decode only, in memory",
}


@dataclass(slots=True)
class RunResult:
    index: int
    end_lsn: str
    payloads: int
    timings: dict[str, Timing] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return rate(self.timings["source"]) / rate(self.timings["pg_recvlogical"])


def rate(timing: Timing) -> float:
    return timing.rows / timing.seconds if timing.seconds > 0 else float("inf")


def run_once(
    node: LocalNode,
    bindir: Path,
    workload: Workload,
    index: int,
    payloads: list[tuple[int, bytes]],
    loop: str,
) -> RunResult:
    """One run: fresh slots, the workload, then (a) and (b) in alternating order, then (c) and (d)."""
    native, ours, capture = f"bench_native_{index}", f"bench_ours_{index}", f"bench_capture_{index}"
    slots = [native, ours] + ([] if payloads else [capture])
    dsn = node.dsn()
    try:
        node.sql(f"TRUNCATE {TABLE}")
        for slot in slots:
            create_slot(node, slot)
        end_lsn = generate(node, workload)
        if not payloads:
            payloads.extend(run_async(lambda: capture_payloads(dsn, capture, end_lsn), loop))
        result = RunResult(index, format_lsn(end_lsn), len(payloads))

        def measure_native() -> None:
            result.timings["pg_recvlogical"] = run_pg_recvlogical(bindir, dsn, native, end_lsn, workload.rows)

        def measure_ours() -> None:
            result.timings["source"] = run_async(lambda: run_source(dsn, ours, end_lsn), loop)

        order = (measure_native, measure_ours) if index % 2 == 0 else (measure_ours, measure_native)
        for step in order:
            step()
        got = result.timings["source"].rows
        if got != workload.rows:
            raise RuntimeError(
                f"run {index}: the source handed out {got} row changes, expected {workload.rows}"
            )
        result.timings["decode_assemble"] = time_decoder(payloads, assemble=True, passes=DECODE_PASSES)
        result.timings["decode"] = time_decoder(payloads, assemble=False, passes=DECODE_PASSES)
        return result
    finally:
        for slot in slots:
            drop_slot(node, slot)


# ---------------------------------------------------------------------------------------------------------
# Report


def summary(results: Sequence[RunResult]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for key in MEASURES:
        rates = [rate(r.timings[key]) for r in results]
        seconds = [r.timings[key].seconds for r in results]
        cpu = [r.timings[key].cpu_seconds for r in results]
        out[key] = {
            "rows_per_s_min": min(rates),
            "rows_per_s_median": statistics.median(rates),
            "seconds_median": statistics.median(seconds),
            "client_cpu_s_median": statistics.median(cpu),
        }
    ratios = [r.ratio for r in results]
    out["ratio_source_vs_pg_recvlogical"] = {"min": min(ratios), "median": statistics.median(ratios)}
    return out


def format_table(workload: Workload, runs: int, loop: str, results: Sequence[RunResult]) -> str:
    s = summary(results)
    lines = [
        f"pgmesh decode bench: {workload.rows} row changes ({workload.inserts} I / {workload.updates} U / "
        f"{workload.deletes} D in {workload.transactions} txns), {runs} run(s), "
        f"{results[0].payloads} pgoutput messages, loop {loop}",
        f"{'measure':<36}{'min rows/s':>13}{'median rows/s':>15}{'median s':>10}{'client CPU s':>14}",
    ]
    for key, label in MEASURES.items():
        row = s[key]
        lines.append(
            f"{label:<36}{row['rows_per_s_min']:>13,.0f}{row['rows_per_s_median']:>15,.0f}"
            f"{row['seconds_median']:>10.3f}{row['client_cpu_s_median']:>14.3f}"
        )
    ratio = s["ratio_source_vs_pg_recvlogical"]
    verdict = "meets" if ratio["min"] >= 0.9 else "BELOW"
    lines.append(
        f"source + decoder vs pg_recvlogical (b)/(a): min {ratio['min']:.2f}x, median {ratio['median']:.2f}x"
        f"  ({verdict} the 0.90x target)"
    )
    return "\n".join(lines)


def write_json(path: Path, workload: Workload, loop: str, results: Sequence[RunResult]) -> None:
    doc = {
        "bench": "decode",
        "workload": {**asdict(workload), "rows": workload.rows, "transactions": workload.transactions},
        "options": PLUGIN_OPTIONS,
        "loop": loop,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "runs": [
            {
                "index": r.index,
                "end_lsn": r.end_lsn,
                "payloads": r.payloads,
                "ratio": r.ratio,
                "timings": {k: {**asdict(t), "rows_per_s": rate(t)} for k, t in r.timings.items()},
            }
            for r in results
        ],
        "summary": summary(results),
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.decode", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000, help="row changes per run (default 200000)")
    parser.add_argument("--runs", type=int, default=3, help="runs; min and median are reported (default 3)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results here")
    parser.add_argument(
        "--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop for (b) (default uvloop)"
    )
    args = parser.parse_args(argv)
    if args.rows < 1 or args.runs < 1:
        parser.error("--rows and --runs must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workload = Workload.for_rows(args.rows)
    bindir = find_pg_bindir()
    if not os.access(bindir / "pg_recvlogical", os.X_OK):
        print(f"pg_recvlogical not found in {bindir}", file=sys.stderr)
        return 2
    node = create_nodes(["bench"], settings=NODE_SETTINGS)[0]
    results: list[RunResult] = []
    payloads: list[tuple[int, bytes]] = []
    try:
        prepare_node(node)
        for index in range(args.runs):
            result = run_once(node, bindir, workload, index, payloads, args.loop)
            results.append(result)
            native, ours = rate(result.timings["pg_recvlogical"]), rate(result.timings["source"])
            print(
                f"run {index}: end {result.end_lsn}, (a) {native:,.0f} rows/s,"
                f" (b) {ours:,.0f} rows/s, ratio {result.ratio:.2f}x",
                file=sys.stderr,
            )
    finally:
        node.destroy()
    print(format_table(workload, args.runs, args.loop, results))
    if args.json is not None:
        write_json(args.json, workload, args.loop, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
