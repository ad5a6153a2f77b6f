"""The randomized fault run's workloads and its end checks (bench/nemesis.py runs them): the rows on every
node against what the writers were told, `pgmesh compare`, the active router's continuous verification.

Two workloads on every node, each one writer with a connection of its own that connects again after a
fault (every attempt and statement bounded by a timeout) and counts only what was acknowledged:

- **ledger**: a transfer is one transaction of two `entries` (a debit and a credit of one amount between
  two of ACCOUNTS accounts) and an `acks` row; the transfer's id is kept once its commit returned.
- **set**: one id inserted into `items` (a primary key) and into `events` (no key: REPLICA IDENTITY FULL,
  so a change applied twice is a second row there, where a key would have turned it into an update).

A commit sent without an answer (the node stopped under it) is neither acknowledged nor lost: its id is
kept as "maybe", and may be present (at most once) or absent. Ids are `writer index * 10**12 + serial`,
so no two writers ever write one key: the run tests that nothing is lost, duplicated or left apart
under faults, not conflict resolution (the property and hot-key tests do that).

Must not: inject faults, or start or stop nodes and routers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import psycopg

from router.config.model import Config
from router.testing.mesh import config_text, fetch

SCHEMA = """
CREATE TABLE entries (id bigint PRIMARY KEY, transfer bigint NOT NULL, acct int NOT NULL,
                      amount bigint NOT NULL);
CREATE TABLE acks (id bigint PRIMARY KEY, node text NOT NULL);
CREATE TABLE items (id bigint PRIMARY KEY, node text NOT NULL);
CREATE TABLE events (id bigint NOT NULL, node text NOT NULL);
"""
TABLES = ["entries", "acks", "items", "events"]
WORKLOADS = ("ledger", "set")
ACCOUNTS = 50
STATEMENT_S = 10.0  # every connect, statement and commit of a writer
VERIFY_S = 20.0  # the routers' [verify] interval, when the router has continuous verification
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Tally:
    """What one writer knows: ids acknowledged, ids whose commit went unanswered, connections lost."""

    workload: str
    node: str
    acked: set[int] = field(default_factory=set)
    maybe: set[int] = field(default_factory=set)
    failures: int = 0


async def _ledger(conn: psycopg.AsyncConnection[Any], ident: int, rng: random.Random, node: str) -> None:
    amount = rng.randrange(1, 1000)
    debit, credit = rng.sample(range(ACCOUNTS), 2)
    await conn.execute("INSERT INTO entries VALUES (%s, %s, %s, %s), (%s, %s, %s, %s)",
                       [ident * 2, ident, debit, -amount, ident * 2 + 1, ident, credit, amount])
    await conn.execute("INSERT INTO acks VALUES (%s, %s)", [ident, node])


async def _set(conn: psycopg.AsyncConnection[Any], ident: int, _rng: random.Random, node: str) -> None:
    await conn.execute("INSERT INTO items VALUES (%s, %s)", [ident, node])
    await conn.execute("INSERT INTO events VALUES (%s, %s)", [ident, node])


Transaction = Callable[[psycopg.AsyncConnection[Any], int, random.Random, str], Awaitable[None]]
TRANSACTIONS: dict[str, Transaction] = {
    "ledger": _ledger,
    "set": _set,
}


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def write(tally: Tally, dsn: str, index: int, stop: asyncio.Event, pace_s: float) -> None:
    """Transactions of `tally.workload` on `dsn` until `stop`, one every `pace_s` at most."""
    rng = random.Random(index)
    serial = 0
    run = TRANSACTIONS[tally.workload]
    while not stop.is_set():
        try:
            async with asyncio.timeout(STATEMENT_S):
                conn = await psycopg.AsyncConnection.connect(dsn, connect_timeout=5)
        except (psycopg.Error, OSError, TimeoutError):
            tally.failures += 1
            await _pause(stop, 0.5)
            continue
        try:
            while not stop.is_set():
                serial += 1
                ident = index * 10**12 + serial
                async with asyncio.timeout(STATEMENT_S):
                    await run(conn, ident, rng, tally.node)
                tally.maybe.add(ident)
                async with asyncio.timeout(STATEMENT_S):
                    await conn.commit()
                tally.maybe.discard(ident)
                tally.acked.add(ident)
                await _pause(stop, pace_s)
        except (psycopg.Error, OSError, TimeoutError):
            tally.failures += 1
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await conn.close()


# ------------------------------------------------------------ the end


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class NodeRows:
    """What one node holds, read after convergence."""

    acks: set[int]
    items: set[int]
    events: dict[int, int]  # id -> rows
    ledger_sum: int
    entries: int
    partial: int  # transfers without exactly two entries summing to 0
    accounts: dict[int, int]  # account -> total


async def read_node(dsn: str) -> NodeRows:
    acks = {int(r[0]) for r in await fetch(dsn, "SELECT id FROM acks")}
    items = {int(r[0]) for r in await fetch(dsn, "SELECT id FROM items")}
    events = {int(r[0]): int(r[1]) for r in await fetch(dsn, "SELECT id, count(*) FROM events GROUP BY id")}
    ((total, entries),) = await fetch(dsn, "SELECT coalesce(sum(amount), 0), count(*) FROM entries")
    ((partial,),) = await fetch(dsn, "SELECT count(*) FROM (SELECT transfer FROM entries GROUP BY transfer"
                                     " HAVING count(*) <> 2 OR sum(amount) <> 0) x")
    totals = await fetch(dsn, "SELECT acct, sum(amount) FROM entries GROUP BY acct")
    accounts = {int(a): int(s) for a, s in totals}
    return NodeRows(acks, items, events, int(total), int(entries), int(partial), accounts)


def _ids(tallies: Sequence[Tally], workload: str) -> tuple[set[int], set[int]]:
    acked: set[int] = set()
    maybe: set[int] = set()
    for tally in tallies:
        if tally.workload == workload:
            acked |= tally.acked
            maybe |= tally.maybe
    return acked, maybe


def _sample(ids: set[int], most: int = 5) -> str:
    return ", ".join(str(i) for i in sorted(ids)[:most]) + (" ..." if len(ids) > most else "")


def check_rows(rows: dict[str, NodeRows], tallies: Sequence[Tally]) -> list[Check]:
    """Every acknowledged insert on every node exactly once, nothing that was never sent, every ledger
    whole and balanced, and the same account totals everywhere."""
    checks = []
    for workload, present in (("ledger", lambda r: r.acks), ("set (items)", lambda r: r.items),
                              ("set (events, no key)", lambda r: set(r.events))):
        acked, maybe = _ids(tallies, workload.split()[0])
        problems = []
        for node, r in rows.items():
            have: set[int] = present(r)
            lost, phantom = acked - have, have - acked - maybe
            if lost:
                problems.append(f"{node}: {len(lost)} acknowledged missing ({_sample(lost)})")
            if phantom:
                problems.append(f"{node}: {len(phantom)} never written ({_sample(phantom)})")
        checks.append(Check(f"{workload}: every acknowledged insert on every node", not problems,
                            "; ".join(problems) or f"{len(acked):,} acknowledged, {len(maybe)} unanswered"))
    twice = {node: {i for i, n in r.events.items() if n > 1} for node, r in rows.items()}
    checks.append(Check("set: each insert exactly once (keyless table)", not any(twice.values()),
                        "; ".join(f"{n}: {len(d)} ids more than once ({_sample(d)})" for n, d in twice.items()
                                  if d) or "no id twice"))
    apart = [f"{n}: items and events differ by {len(r.items ^ set(r.events))}" for n, r in rows.items()
             if r.items != set(r.events)]
    checks.append(Check("set: items and events hold the same ids", not apart, "; ".join(apart) or "yes"))
    broken = [f"{n}: sum {r.ledger_sum}, {r.partial} partial transfers, {r.entries} entries for"
              f" {len(r.acks)} acks" for n, r in rows.items()
              if r.ledger_sum != 0 or r.partial != 0 or r.entries != 2 * len(r.acks)]
    checks.append(Check("ledger: every transfer whole, every ledger balanced", not broken,
                        "; ".join(broken) or "sum 0, two entries per transfer, on every node"))
    totals = {n: r.accounts for n, r in rows.items()}
    first = next(iter(totals.values()), {})
    differ = [n for n, t in totals.items() if t != first]
    checks.append(Check("ledger: account totals equal on every node", not differ,
                        f"differ on {', '.join(differ)}" if differ else f"{len(first)} accounts equal"))
    return checks


def counts_table(rows: dict[str, NodeRows], tallies: Sequence[Tally]) -> list[str]:
    """Markdown: per writer, acknowledged and unanswered; per node, rows applied from that writer's node."""
    nodes = sorted(rows)
    lines = ["| workload | written on | acknowledged | unanswered | failures | "
             + " | ".join(f"rows on {n}" for n in nodes) + " |",
             "|---|---|--:|--:|--:|" + "--:|" * len(nodes)]
    for tally in tallies:
        mine = tally.acked | tally.maybe
        held = [len(mine & (r.acks if tally.workload == "ledger" else r.items)) for r in
                (rows[n] for n in nodes)]
        lines.append(f"| {tally.workload} | {tally.node} | {len(tally.acked):,} | {len(tally.maybe)} |"
                     f" {tally.failures} | " + " | ".join(f"{h:,}" for h in held) + " |")
    return lines


def verify_section() -> str:
    """`[verify]` for the routers when the router has continuous verification (issue 38 item 2)."""
    if "verify" not in getattr(Config, "__struct_fields__", ()) or not find_spec("router.service.verify"):
        return ""
    return f'[verify]\ninterval = "{VERIFY_S:g}s"\n'


async def compare(nodes: Sequence[Any], cluster: str, extra: str, workdir: Path, admin_port: int) -> Check:
    """`pgmesh compare` over the nodes themselves, asking the active router (its admin port) as a user's
    config would, so that differences are rechecked behind its barrier."""
    path = workdir / "compare.toml"
    path.write_text(config_text(nodes, cluster=cluster, admin_port=admin_port, extra=extra))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "compare", "--config", str(path), "--timeout", "300",
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 400)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return Check("pgmesh compare: every table identical (keyless included)", False, "timed out")
    text = out.decode(errors="replace").strip().splitlines()
    return Check("pgmesh compare: every table identical (keyless included)", proc.returncode == 0,
                 f"exit {proc.returncode}: " + " / ".join(text[-3:]))


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
        text: str = reply.read().decode()
        return text


async def router_status(port: int) -> dict[str, Any]:
    """A router's /status ({}: no answer)."""
    with contextlib.suppress(OSError, ValueError):
        found: dict[str, Any] = json.loads(await asyncio.to_thread(_get, port, "/status"))
        return found
    return {}


async def verification(port: int | None) -> Check:
    """A full pass of the active router's continuous verification that began after convergence: it found
    no row apart (/status `verify`), and /metrics' pgmesh_divergent_rows are all 0."""
    name = "continuous verification: a pass after convergence, pgmesh_divergent_rows 0"
    if not verify_section():
        return Check(name, True, "not checked: the router has no [verify] yet (pgmesh compare only)")
    if port is None:
        return Check(name, False, "no active router")

    async def verify() -> dict[str, Any]:
        found: dict[str, Any] = (await router_status(port)).get("verify") or {}
        return found

    first = await verify()
    began = time.monotonic()
    now = first
    limit = 2 * VERIFY_S + 120.0
    while time.monotonic() - began < limit:  # one pass started after the first reading, and done
        now = await verify()
        if now.get("passes", 0) >= first.get("passes", 0) + 2:
            break
        limit = 2 * max(VERIFY_S, now.get("last_pass_seconds") or 0.0) + 120
        await asyncio.sleep(2)
    else:
        return Check(name, False, f"no full pass within {limit:.0f} s: {now}")
    lines = [x for x in (await asyncio.to_thread(_get, port, "/metrics")).splitlines()
             if x.startswith("pgmesh_divergent_rows")]
    bad = [x for x in lines if float(x.split()[-1]) != 0]
    ok = not bad and not now.get("divergent") and not now.get("skipped") and not now.get("last_error")
    return Check(name, ok, f"passes {now.get('passes')}, divergent {now.get('divergent')}, skipped"
                 f" {now.get('skipped')}, error {now.get('last_error')}; metric: {'; '.join(bad) or 'all 0'}"
                 f" ({len(lines)} series)")


def code() -> str:
    """Which code ran: the commit, and whether the router's files differed from it."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""
    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    changed = git("status", "--porcelain", "--", "router", "protocol").splitlines()
    return f"code: commit {head}" + (f", with {len(changed)} uncommitted file(s) under router/ and protocol/"
                                     if changed else "")
