"""The replication stream read past libpq (`router.stream.wire`) against libpq's reads, end to end.

One throw-away PostgreSQL 15 node. Each round writes two workloads once, TPC-B-like transactions (three
keyed updates and one insert, as `bench.micro.compiled`) and `bench.micro.decode`'s mixed 100-row
transactions, each followed by an end marker, and reads each from two fresh slots through the real
`ReplicationSource.stream()` (confirming every transaction like a caller), once with pgmesh's own reads
(`wire`) and once with libpq's (`libpq`, what TLS connections use; `ReplicationConnection.own_reads`
off), in alternating order. What is timed is the reading process's CPU from the call to the end marker,
per pgoutput message and per transaction; the table gives the medians over the rounds, and the median of
each round's ratio (the two readers of a round ran back to back: the steadier figure on a busy machine).

    .venv/bin/python -m bench.micro.wire                         # 20,000 TPC-B txns, 100,000 rows, 5 rounds
    .venv/bin/python -m bench.micro.wire --tpcb 5000 --rows 50000 --rounds 3   # about 40 s

Writes `bench/results/issue39/wire.md` (and `.json`). Must not: keep the node or a slot, or confirm past
what it received.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import protocol
from bench.harness.nodes import run_async
from bench.micro.compiled import TPCB_SCHEMA, tpcb_sql
from bench.micro.decode import (
    MARKER_PREFIX,
    NODE_SETTINGS,
    PUBLICATION,
    SOURCE_OPTIONS,
    TABLE,
    Workload,
    create_slot,
    drop_slot,
    generate,
)
from protocol.lsn import parse_lsn
from protocol.messages import Message
from protocol.transactions import Transaction
from router.stream.connection import ReplicationConnection
from router.stream.source import ReplicationSource
from router.testing.localnodes import LocalNode, create_nodes

RESULTS = Path(__file__).resolve().parents[1] / "results" / "issue39"
READERS = {"wire": True, "libpq": False}


async def read(dsn: str, slot: str, own_reads: bool) -> dict[str, float]:
    """The source over `slot` until the end marker: process CPU, messages and transactions."""
    ReplicationConnection.own_reads = own_reads
    source = ReplicationSource("bench", dsn, slot, (PUBLICATION,), options=SOURCE_OPTIONS)
    messages = 0
    feed = source.feed

    def counting(batch: Any) -> Any:
        nonlocal messages
        messages += len(batch)
        return feed(batch)

    source.feed = counting  # type: ignore[method-assign]
    txns = 0
    wire = False
    cpu = time.process_time()
    try:
        async with contextlib.aclosing(source.stream()) as items:
            async for item in items:
                if isinstance(item, Transaction):
                    txns += 1
                    source.confirm(item.end_lsn)
                    wire = wire or source.connection.reads_past_libpq
                elif isinstance(item, Message) and item.prefix == MARKER_PREFIX:
                    break
        cpu = time.process_time() - cpu
    finally:
        await source.close()
        ReplicationConnection.own_reads = True
    if wire is not own_reads:
        raise RuntimeError(f"asked for own_reads={own_reads}, the stream was read past libpq: {wire}")
    return {"cpu_s": cpu, "messages": messages, "transactions": txns}


def one_round(node: LocalNode, index: int, workloads: dict[str, Callable[[], object]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, write in workloads.items():
        slots = {reader: f"bench_wire_{name}_{reader}_{index}" for reader in READERS}
        try:
            for slot in slots.values():
                create_slot(node, slot)
            write()
            order = list(READERS) if index % 2 == 0 else list(reversed(READERS))
            for reader in order:
                run = partial(read, node.dsn(), slots[reader], READERS[reader])
                out.setdefault(name, {})[reader] = run_async(run, "uvloop")
        finally:
            for slot in slots.values():
                drop_slot(node, slot)
    return out


def report(rounds: list[dict[str, Any]], started: str, args: argparse.Namespace) -> str:
    lines = [
        f"# Replication stream: pgmesh's own reads (`wire`) against libpq's, {started}",
        "",
        f"`python -m bench.micro.wire --tpcb {args.tpcb} --rows {args.rows} --rounds {args.rounds}`; decoder"
        f" {'compiled' if protocol.compiled else 'pure Python'}; process CPU of the reading source,"
        " medians over the rounds.",
        "",
        "| workload | messages | transactions | libpq µs/message | wire µs/message | libpq µs/txn"
        " | wire µs/txn | wire / libpq, median of rounds' ratios (min-max) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for name in rounds[0]:
        per: dict[str, tuple[float, float]] = {}
        for reader in READERS:
            runs = [r[name][reader] for r in rounds]
            per[reader] = (
                statistics.median(1e6 * x["cpu_s"] / x["messages"] for x in runs),
                statistics.median(1e6 * x["cpu_s"] / x["transactions"] for x in runs),
            )
        first = rounds[0][name]["wire"]
        ratios = [r[name]["wire"]["cpu_s"] / r[name]["libpq"]["cpu_s"] for r in rounds]
        lines.append(
            f"| {name} | {first['messages']:,} | {first['transactions']:,} | {per['libpq'][0]:.2f}"
            f" | {per['wire'][0]:.2f} | {per['libpq'][1]:.1f} | {per['wire'][1]:.1f}"
            f" | {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.wire", description=__doc__.splitlines()[0])
    parser.add_argument("--tpcb", type=int, default=20_000, help="TPC-B-like transactions per round")
    parser.add_argument("--rows", type=int, default=100_000, help="mixed workload's row changes per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (readers alternate first)")
    parser.add_argument("--out", type=Path, default=RESULTS / "wire.md", help="where the table goes")
    args = parser.parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    node = create_nodes(["wire"], settings=NODE_SETTINGS)[0]
    rounds: list[dict[str, Any]] = []
    try:
        node.sql(TPCB_SCHEMA)  # the mixed workload's table and the publication too

        def tpcb() -> int:
            node.sql(tpcb_sql(args.tpcb))
            end = parse_lsn(node.sql("SELECT pg_current_wal_lsn()"))
            node.sql(f"SELECT pg_logical_emit_message(false, '{MARKER_PREFIX}', 'end')")
            return end

        def mixed() -> int:
            node.sql(f"TRUNCATE {TABLE}")
            return generate(node, Workload.for_rows(args.rows))

        for index in range(args.rounds):
            rounds.append(one_round(node, index, {"tpcb": tpcb, "mixed": mixed}))
            print(f"round {index}: {json.dumps(rounds[-1])}", file=sys.stderr)
    finally:
        node.destroy()
    text = report(rounds, started, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                         "rounds": rounds}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
