"""The decoder compiled (mypyc, `protocol/_native/`) against pure Python, on the same captured bytes.

One throw-away PostgreSQL node runs two workloads, each captured from its own pgoutput slot
(proto_version 1, binary, as `bench.micro.decode`): TPC-B-like transactions (three keyed updates and
one insert into a table without a key, as pgbench's) and `bench.micro.decode`'s mixed workload (100-row
transactions of inserts, updates, deletes). Then child processes time, over the captured XLogData
payloads in memory, (1) `Decoder.decode`, (2) decode + `TransactionAssembler.feed`, and (3)
`ReplicationSource.feed` (the router's real entry: frames in batches of 64, raw inserts, assembly),
alternating pure (`PGMESH_PURE_PYTHON=1`) and compiled children `--rounds` times in the same sitting.
Each child reports the median of its passes in process CPU time; the table gives, per measure, the
median over the rounds, in µs per message and per transaction.

    .venv/bin/python -m bench.micro.compiled                  # 5,000 TPC-B txns, 20,000 rows, 5 rounds
    .venv/bin/python -m bench.micro.compiled --tpcb 2000 --rows 10000 --rounds 3   # about 30 s

It needs a current compiled build (`./dev setup`) and writes `bench/results/issue39/compiled.md` (and
`.json`). Must not: keep the node or a slot, or time anything but the decoding itself.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.harness.nodes import run_async
from bench.micro.decode import (
    MARKER_PREFIX,
    NODE_SETTINGS,
    PUBLICATION,
    TABLE,
    Workload,
    capture_payloads,
    create_slot,
    drop_slot,
    generate,
)
from protocol import native
from protocol.lsn import parse_lsn
from router.testing.localnodes import LocalNode, create_nodes

RESULTS = Path(__file__).resolve().parents[1] / "results" / "issue39"
PASSES = 7
BATCH = 64
_XLOG_HEAD = struct.Struct(">cQQq")  # 'w', WAL start, WAL end, send time
Payloads = list[tuple[int, bytes]]

TPCB_SCHEMA = f"""
CREATE TABLE accounts (aid int PRIMARY KEY, bid int, abalance int, filler char(84));
CREATE TABLE tellers (tid int PRIMARY KEY, bid int, tbalance int, filler char(84));
CREATE TABLE branches (bid int PRIMARY KEY, bbalance int, filler char(88));
CREATE TABLE history (tid int, bid int, aid int, delta int, mtime timestamp, filler char(22));
INSERT INTO accounts SELECT g, 1, 0, '' FROM generate_series(1, 100000) AS g;
INSERT INTO tellers SELECT g, 1, 0, '' FROM generate_series(1, 10) AS g;
INSERT INTO branches VALUES (1, 0, '');
CREATE TABLE {TABLE} (id int PRIMARY KEY, a int, b text, c timestamptz);
CREATE PUBLICATION {PUBLICATION} FOR TABLE accounts, tellers, branches, history, {TABLE};
"""


def tpcb_sql(transactions: int) -> str:
    return f"""
DO $bench$ DECLARE a int; t int; d int; BEGIN
FOR i IN 1..{transactions} LOOP
    a := 1 + (random() * 99999)::int; t := 1 + (random() * 9)::int; d := (random() * 10000)::int - 5000;
    UPDATE accounts SET abalance = abalance + d WHERE aid = a;
    UPDATE tellers SET tbalance = tbalance + d WHERE tid = t;
    UPDATE branches SET bbalance = bbalance + d WHERE bid = 1;
    INSERT INTO history VALUES (t, 1, a, d, now(), '');
    COMMIT;
END LOOP; END $bench$;
"""


def capture(node: LocalNode, slot: str, run: Callable[[], int]) -> Payloads:
    create_slot(node, slot)
    try:
        end = run()
        return run_async(lambda: capture_payloads(node.dsn(), slot, end))
    finally:
        drop_slot(node, slot)


def capture_all(tpcb: int, rows: int) -> dict[str, Payloads]:
    node = create_nodes(["compiled"], settings=NODE_SETTINGS)[0]
    try:
        node.sql(TPCB_SCHEMA)

        def run_tpcb() -> int:
            node.sql(tpcb_sql(tpcb))
            end = parse_lsn(node.sql("SELECT pg_current_wal_lsn()"))
            node.sql(f"SELECT pg_logical_emit_message(false, '{MARKER_PREFIX}', 'end')")
            return end

        return {
            "tpcb": capture(node, "bench_compiled_tpcb", run_tpcb),
            "mixed": capture(node, "bench_compiled_mixed", lambda: generate(node, Workload.for_rows(rows))),
        }
    finally:
        node.destroy()


# ---------------------------------------------------------------------------------------------------------
# The child: one interpreter, pure or compiled as its environment says


def _timed(passes: int, work: Callable[[], object]) -> float:
    spent = []
    for _ in range(passes):
        start = time.process_time()
        work()
        spent.append(time.process_time() - start)
    return statistics.median(spent)


def child(path: Path) -> dict[str, Any]:
    import protocol
    from protocol.pgoutput import Decoder
    from protocol.transactions import TransactionAssembler
    from router.stream.items import SourceOptions
    from router.stream.source import ReplicationSource

    options = SourceOptions(proto_version=1, binary=True, messages=True, streaming=False)
    captured: dict[str, Payloads] = pickle.loads(path.read_bytes())
    out: dict[str, Any] = {"compiled": protocol.compiled, "workloads": {}}
    for name, payloads in captured.items():
        frames = [memoryview(_XLOG_HEAD.pack(b"w", lsn, lsn, 0) + p) for lsn, p in payloads]
        batches = [frames[i : i + BATCH] for i in range(0, len(frames), BATCH)]

        def decode(payloads: Payloads = payloads) -> None:
            read = Decoder().decode
            for lsn, payload in payloads:
                read(payload, lsn)

        def assemble(payloads: Payloads = payloads) -> None:
            read, feed = Decoder().decode, TransactionAssembler().feed
            for lsn, payload in payloads:
                feed(read(payload, lsn), lsn, len(payload))

        def source(batches: list[list[memoryview]] = batches) -> None:
            feed = ReplicationSource("bench", "host=/nonexistent", "unused", (PUBLICATION,),
                                     options=options).feed  # never connects: feed() only decodes
            for batch in batches:
                feed(batch)

        out["workloads"][name] = {
            "messages": len(payloads),
            "transactions": sum(1 for _, p in payloads if p[:1] == b"C"),
            "seconds": {k: _timed(PASSES, f) for k, f in (("decode", decode), ("assemble", assemble),
                                                          ("source", source))},
        }
    return out


# ---------------------------------------------------------------------------------------------------------
# The parent


def run_child(path: Path, pure: bool) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != native.PURE_ENV}
    if pure:
        env[native.PURE_ENV] = "1"
    done = subprocess.run([sys.executable, "-m", "bench.micro.compiled", "--child", str(path)], env=env,
                          capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout)
    if result["compiled"] == pure:
        raise RuntimeError(f"asked for {'pure' if pure else 'compiled'}, got compiled={result['compiled']}")
    return result


LABELS = {"decode": "Decoder.decode", "assemble": "decode + TransactionAssembler.feed",
          "source": "ReplicationSource.feed (batches of 64)"}


def report(rounds: dict[str, list[dict[str, Any]]], started: str) -> str:
    first = rounds["pure"][0]["workloads"]
    lines = [
        f"# Compiled decoder (mypyc) against pure Python, {started}",
        "",
        f"{len(rounds['pure'])} rounds, pure and compiled children alternating; each the median of "
        f"{PASSES} passes in process CPU time; the table: median over the rounds.",
        "",
        "| workload | measure | pure µs/msg | compiled µs/msg | pure µs/txn | compiled µs/txn "
        "| compiled/pure |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    for name, shape in first.items():
        for key, label in LABELS.items():
            med = {mode: statistics.median(r["workloads"][name]["seconds"][key] for r in rs)
                   for mode, rs in rounds.items()}
            per_msg = {m: v / shape["messages"] * 1e6 for m, v in med.items()}
            per_txn = {m: v / shape["transactions"] * 1e6 for m, v in med.items()}
            lines.append(
                f"| {name} ({shape['transactions']} txns, {shape['messages']} msgs) | {label} "
                f"| {per_msg['pure']:.3f} | {per_msg['compiled']:.3f} | {per_txn['pure']:.2f} "
                f"| {per_txn['compiled']:.2f} | {med['compiled'] / med['pure']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    doc = (__doc__ or "").splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m bench.micro.compiled", description=doc)
    parser.add_argument("--tpcb", type=int, default=5000, help="TPC-B transactions (default 5000)")
    parser.add_argument("--rows", type=int, default=20_000, help="rows of the mixed workload (default 20000)")
    parser.add_argument("--rounds", type=int, default=5, help="pure/compiled pairs (default 5)")
    parser.add_argument("--out", type=Path, default=RESULTS / "compiled.md", help="the report (and .json)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child)))
        return 0
    import protocol

    if native.native_dir(Path(protocol.__file__).parent, {}) is None:
        print("no current compiled build of protocol/: run ./dev setup (deploy/compile.py) first",
              file=sys.stderr)
        return 2
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    captured = capture_all(args.tpcb, args.rows)
    rounds: dict[str, list[dict[str, Any]]] = {"pure": [], "compiled": []}
    with tempfile.TemporaryDirectory(prefix="pgmesh-compiled-") as tmp:
        path = Path(tmp) / "payloads.pickle"
        path.write_bytes(pickle.dumps(captured))
        for i in range(args.rounds):
            for pure in (i % 2 == 0, i % 2 == 1):  # who goes first alternates
                rounds["pure" if pure else "compiled"].append(run_child(path, pure))
    text = report(rounds, started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(rounds, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
