"""Quarantine (issue 38 item 1): what a refused change costs A -> B, and how much a row quarantine sets aside
beside what a whole-transaction quarantine would have.

Two throw-away nodes a and b, `on_refused = "quarantine"`, a TPC-B-like table pair: `accounts` (10,000
rows) and `branches` (10 rows). With the router stopped, a commits N transfer transactions (seeded random:
an account and a branch updated in each; account 1 in one transaction of 200), the first of which sets
account 1 past a CHECK that b alone has. The timed window runs from router start until b's origin for a
has reached a's last commit. Variants:

  none       no CHECK on b: every transaction on the fast path (the reference)
  elsewhere  b refuses a row of another table (`notes`) first: pending entries that this workload never
             touches; its transactions stay on the fast path
  row        b refuses a's first transaction's account 1 (the CHECK): that change goes to quarantine, the
             later changes of account 1 follow it (the careful way); the others stay on the fast path

For `row`, the bench also counts, from the same transactions, what a whole-transaction quarantine would
have set aside: the refused transaction whole, then every later transaction touching a key that one
holds (a key's order must be kept), which adds its own keys, and so on.

    .venv/bin/python -m bench.micro.quarantine                        # N = 5000, 1 run (~1 minute)
    .venv/bin/python -m bench.micro.quarantine --transactions 1000    # quick (~30 s)

Owns: this workload and its table, written to bench/results/issue38/quarantine.md with --out. Must not:
touch a node it did not create.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psycopg

from bench.micro import emit
from protocol.lsn import parse_lsn
from router.service.supervisor import Router
from router.testing.localnodes import LocalNode, create_nodes
from router.testing.mesh import setup_mesh

ACCOUNTS = 10_000
BRANCHES = 10
SCHEMA = f"""
CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL);
CREATE TABLE branches (id int PRIMARY KEY, balance int NOT NULL);
CREATE TABLE notes (id int PRIMARY KEY, v int NOT NULL);
INSERT INTO accounts SELECT i, 0 FROM generate_series(1, {ACCOUNTS}) i;
INSERT INTO branches SELECT i, 0 FROM generate_series(1, {BRANCHES}) i;
"""
LOCAL = "SET pgmesh.ddl_local = on; "
REFUSE = {
    "none": None,
    "elsewhere": (LOCAL + "ALTER TABLE notes ADD CONSTRAINT small CHECK (v < 100)",
                  "INSERT INTO notes VALUES (1, 1000)"),
    "row": (LOCAL + "ALTER TABLE accounts ADD CONSTRAINT small CHECK (id <> 1 OR balance < 100)", None),
}

PENDING = "SELECT count(*) FROM pgmesh.quarantine WHERE state = 'pending'"

Transfer = tuple[int, int, int]  # account, branch, amount


def transfers(count: int, seed: int = 38) -> list[Transfer]:
    """The first sets account 1 to 1,000 (refused where the CHECK is); then random transfers, account 1
    in one of 200."""
    rng = random.Random(seed)
    out = [(1, 1, 1000)]
    for _ in range(count - 1):
        account = 1 if rng.random() < 0.005 else rng.randint(2, ACCOUNTS)
        out.append((account, rng.randint(1, BRANCHES), rng.randint(1, 50)))
    return out


def whole_transaction_quarantine(plan: Sequence[Transfer]) -> tuple[int, int]:
    """Transactions and row changes a whole-transaction quarantine would set aside: the first (refused),
    then every later one touching a pending key, whose keys become pending too."""
    pending = {("accounts", plan[0][0]), ("branches", plan[0][1])}
    held = 1
    for account, branch, _ in plan[1:]:
        keys = {("accounts", account), ("branches", branch)}
        if keys & pending:
            pending |= keys
            held += 1
    return held, held * 2


async def _execute(dsn: str, *statements: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            await conn.execute(statement)  # type: ignore[arg-type]


async def _scalar(dsn: str, query: str) -> str:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        row = await (await conn.execute(query)).fetchone()  # type: ignore[arg-type]
        assert row is not None
        return str(row[0])


async def _write(dsn: str, plan: Sequence[Transfer]) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn, conn.pipeline():
        for account, branch, amount in plan:
            await conn.execute("BEGIN")
            await conn.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", [amount, account])
            await conn.execute("UPDATE branches SET balance = balance + %s WHERE id = %s", [amount, branch])
            await conn.execute("COMMIT")


async def one_run(variant: str, plan: Sequence[Transfer]) -> tuple[float, int]:
    """Transactions/s applied a -> b, and changes pending in b's quarantine after."""
    nodes: list[LocalNode] = await asyncio.to_thread(create_nodes, ["a", "b"])
    try:
        a, b = nodes
        config = await setup_mesh(nodes, SCHEMA, replication='on_refused = "quarantine"')
        refuse = REFUSE[variant]
        if refuse is not None:
            await _execute(b.dsn(), refuse[0])
            if refuse[1] is not None:
                await _execute(a.dsn(), refuse[1])
        await _write(a.dsn(), plan)
        end = parse_lsn(await _scalar(a.dsn(), "SELECT pg_current_wal_lsn()::text"))
        origin = config.origin_name("a")
        stop = asyncio.Event()
        router = Router(config, admin=False)
        started = time.perf_counter()
        task = asyncio.create_task(router.run(stop))
        query = f"SELECT coalesce(pg_replication_origin_progress('{origin}', false), '0/0')::text"
        async with await psycopg.AsyncConnection.connect(b.dsn(), autocommit=True) as conn:
            while True:
                row = await (await conn.execute(query)).fetchone()  # type: ignore[arg-type]
                if row is not None and parse_lsn(row[0]) >= end - 200:  # the last commit ends just before
                    break
                await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - started
        stop.set()
        await task
        pending = int(await _scalar(b.dsn(), PENDING))
        return len(plan) / elapsed, pending
    finally:
        for node in nodes:
            await asyncio.to_thread(node.destroy)


def main(argv: Sequence[str] | None = None) -> int:
    about = (__doc__ or "").splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m bench.micro.quarantine", description=about)
    parser.add_argument("--transactions", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="append the report here too")
    args = parser.parse_args(argv)
    plan = transfers(args.transactions)
    rates: dict[str, list[float]] = {v: [] for v in REFUSE}
    pending: dict[str, int] = {}
    for _ in range(args.runs):
        for variant in REFUSE:
            rate, count = asyncio.run(one_run(variant, plan))
            rates[variant].append(rate)
            pending[variant] = count
    base = max(rates["none"])
    held, rows = whole_transaction_quarantine(plan)
    lines = [
        f"quarantine bench a -> b: {len(plan)} transfer transactions (2 row changes each),"
        f" {args.runs} run(s)",
        "| variant | best tx/s | vs none | changes pending in b's quarantine |",
        "| --- | --- | --- | --- |",
    ]
    for variant, found in rates.items():
        lines.append(f"| {variant} | {max(found):,.0f} | {max(found) / base:.2f}x | {pending[variant]} |")
    lines.append(f"whole-transaction quarantine of the same transactions: {held} of {len(plan)} transactions"
                 f" ({held / len(plan):.0%}), {rows} row changes set aside")
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
