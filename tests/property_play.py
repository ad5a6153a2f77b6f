"""Playing the property test's schedules on a real mesh with a running router, and its long mode.

Owns: one schedule's run (`play`: its DDL on one node, waited for everywhere; the hot rows; then every
node's sessions at once; then every table equal on every node, every link healthy, and each node's own
rows as it left them), the counts of what ran (`Tally`), and the long mode:
`python -m tests.property_play --minutes 30` starts its own nodes (`--nodes 2` or 3), runs schedules
from random seeds until the time is up on one router, and prints the counts every ten schedules and
any failure with its seed and schedule (it stops at the first; PGMESH_PROPERTY_KEEP=1 leaves the nodes
running to look at). `--seed N` (repeatable, `--repeat K` times each) plays given schedules again;
`--known SHAPE` adds a shape known to fail today (`tests.property_schedules.KNOWN`).
Must not: generate anything (`tests.property_schedules` does, from the seed), or sleep for a fixed time.

Why seeds and not hypothesis's own examples: a schedule runs its sessions concurrently against a live
router, so the same example does not replay the same interleaving; hypothesis would call a failure
that does not repeat "flaky", and each shrinking attempt costs seconds of real cluster time. A schedule
is drawn from `random.Random(seed)` instead: the seed names the tables, types and transactions exactly
(`make_schedule(seed, nodes)`), a failure prints the seed and the schedule, and `--seed` replays it
(`--repeat` until the interleaving that fails comes again); the minimal reproductions are then written
by hand from the conflict history the kept nodes hold (tests/integration/test_property.py).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import errors as pgerrors
from psycopg import sql

from router.apply.state import LinkState
from router.service.supervisor import Router
from router.testing.compare import same_everywhere
from router.testing.mesh import NODE_SETTINGS, prepare_mesh, running_router
from tests.property_schedules import KNOWN, Op, Schedule, Transaction, make_schedule

logger = logging.getLogger(__name__)

# 64kB: a transaction of more changes than that is streamed; prepared transactions are allowed.
PROPERTY_SETTINGS = {**NODE_SETTINGS, "logical_decoding_work_mem": "64kB", "max_prepared_transactions": "16"}
ANCHOR = "CREATE TABLE anchor (id int PRIMARY KEY)"  # init wants a table
CONVERGE_LIMIT = 180.0
# What a user's transaction may meet on purpose here: a duplicate key, the failing statement, a lock
# cycle with another session or the router's apply.
EXPECTED = (pgerrors.UniqueViolation, pgerrors.DivisionByZero, pgerrors.DeadlockDetected,
            pgerrors.SerializationFailure)


def describe(schedule: Schedule) -> str:
    """The schedule as text (tables, then each session's transactions), for a failure report."""
    lines = [f"seed {schedule.seed}: nodes {', '.join(schedule.nodes)}; DDL on {schedule.ddl_node}"]
    for table in schedule.tables:
        cols = ", ".join(f"{c.name!r} {c.type}" for c in table.columns)
        lines.append(f"  table {table.name!r} ({cols}) key {table.key} partition {table.partition}"
                     f" replica_full {table.replica_full}")
    for (node, session), txs in sorted(schedule.sessions.items()):
        lines.append(f"  {node}/{session}:")
        for tx in txs:
            steps = " ".join(op.kind if op.kind != "sql" else f"sql({op.rows})" for op in tx.ops)
            lines.append(f"    [{steps}] {tx.end}")
    return "\n".join(lines)


class ScheduleFailed(AssertionError):
    """A schedule whose nodes did not converge or whose link stopped: the seed and the schedule say it."""


@dataclass
class Tally:
    schedules: int = 0
    transactions: int = 0
    committed: int = 0
    aborted: int = 0
    prepared: int = 0
    rows: int = 0
    statement_errors: int = 0
    streamed: int = 0  # transactions the walsenders streamed before their commit (pg_stat_replication_slots)
    failures: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"{self.schedules} schedules, {self.transactions} transactions ({self.committed} committed,"
                f" {self.aborted} rolled back or aborted, {self.prepared} prepared), about {self.rows} row"
                f" changes, {self.statement_errors} statements failed on purpose or on a duplicate key,"
                f" {self.streamed} streamed by the walsenders (each once per receiving node);"
                f" {len(self.failures)} failures")

    async def count_streamed(self, dsns: Sequence[str]) -> None:
        """Read how many transactions the nodes' slots streamed in progress (the statistics lag a little)."""
        self.streamed = 0
        for dsn in dsns:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                cur = await conn.execute(
                    "SELECT coalesce(sum(stream_txns), 0) FROM pg_stat_replication_slots")
                row = await cur.fetchone()
                self.streamed += int(row[0]) if row else 0


async def _run_op(conn: psycopg.AsyncConnection[Any], op: Op, stack: list[str]) -> None:
    if op.kind == "savepoint":
        await conn.execute(sql.SQL("SAVEPOINT {}").format(sql.Identifier(op.name)))
        stack.append(op.name)
    elif op.kind == "release":
        await conn.execute(sql.SQL("RELEASE SAVEPOINT {}").format(sql.Identifier(op.name)))
        del stack[stack.index(op.name):]
    elif op.kind == "rollback_to":
        await conn.execute(sql.SQL("ROLLBACK TO SAVEPOINT {}").format(sql.Identifier(op.name)))
        del stack[stack.index(op.name) + 1:]
    else:
        assert op.statement is not None
        await conn.execute(op.statement, op.params)


async def run_transaction(
    conn: psycopg.AsyncConnection[Any], tx: Transaction, gid: str, tally: Tally
) -> None:
    """BEGIN, the ops (a failed one is undone to the innermost savepoint, or aborts the transaction and
    ends it), then its end."""
    tally.transactions += 1
    await conn.execute("BEGIN")
    stack: list[str] = []
    for op in tx.ops:
        if op.kind in ("release", "rollback_to") and op.name not in stack:
            continue  # its savepoint was undone by an earlier rollback to an outer one
        try:
            await _run_op(conn, op, stack)
        except EXPECTED:
            tally.statement_errors += 1
            if not stack:
                await conn.execute("ROLLBACK")
                tally.aborted += 1
                return
            await conn.execute(sql.SQL("ROLLBACK TO SAVEPOINT {}").format(sql.Identifier(stack[-1])))
        else:
            tally.rows += op.rows
    if tx.end == "rollback":
        await conn.execute("ROLLBACK")
        tally.aborted += 1
        return
    if tx.end == "commit":
        await conn.execute("COMMIT")
        tally.committed += 1
        return
    await conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
    tally.prepared += 1
    finish = "COMMIT PREPARED {}" if tx.end == "prepare_commit" else "ROLLBACK PREPARED {}"
    await conn.execute(sql.SQL(finish).format(sql.Literal(gid)))
    tally.committed += tx.end == "prepare_commit"
    tally.aborted += tx.end != "prepare_commit"


async def run_session(dsn: str, name: str, txs: Sequence[Transaction], tally: Tally) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for i, tx in enumerate(txs):
            await run_transaction(conn, tx, f"{name} {i}", tally)


def link_trouble(router: Router) -> list[str]:
    """Links or sources that stopped on an error, or links held paused."""
    bad = [f"link {name}: {a.state.value}: {a.last_error}" for name, a in router.appliers.items()
           if a.state in (LinkState.ERROR, LinkState.PAUSED) or a.stats.errors]
    bad += [f"source {p.node}: {p.source.last_error}" for p in router.pumps.values()
            if p.source.state.name == "ERROR"]
    return bad


def _short(row: str) -> str:
    """A row (jsonb text) with long values cut to their start, length and md5."""
    values = json.loads(row)
    for name, value in values.items():
        if isinstance(value, str) and len(value) > 40:
            digest = hashlib.md5(value.encode()).hexdigest()
            values[name] = f"{value[:16]}... ({len(value)} chars, md5 {digest})"
    return json.dumps(values, ensure_ascii=False)


async def differences(dsns: list[str], tables: list[str], show: int = 6) -> str:
    """The rows that are not the same on every node (each as text, with the nodes that hold it)."""
    lines = []
    for table in tables:
        held: dict[str, list[int]] = {}
        for i, dsn in enumerate(dsns):
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                name = sql.Identifier(*table.split(".", 1))
                query = sql.SQL("SELECT pg_catalog.to_jsonb(r.*)::text FROM {} AS r").format(name)
                for (row,) in await (await conn.execute(query)).fetchall():
                    held.setdefault(row, []).append(i)
        odd = [(row, nodes) for row, nodes in held.items() if len(nodes) != len(dsns)]
        for row, nodes in sorted(odd)[:show]:
            lines.append(f"  {table} on nodes {nodes} only: {_short(row)}")
        if len(odd) > show:
            lines.append(f"  {table}: {len(odd) - show} more rows differ")
    return "\n".join(lines)


async def wait_healthy_and_converged(
    router: Router, dsns: list[str], tables: list[str], limit: float
) -> None:
    """Every table equal on every node, every link running: a stopped link fails at once."""
    deadline = time.monotonic() + limit
    while True:
        trouble = link_trouble(router)
        if trouble:
            raise ScheduleFailed("; ".join(trouble))
        if await same_everywhere(dsns, tables):
            return
        if time.monotonic() > deadline:
            report = "\n".join(f"  link {name}: {a.state.value}, {a.pending} pending,"
                                f" {a.stats.conflicts} conflicts, {a.stats.retries} retries"
                                for name, a in sorted(router.appliers.items()))
            diff = await differences(dsns, tables)
            raise ScheduleFailed(f"nodes still differ after {limit:.0f} s\n{report}\n{diff}")
        await asyncio.sleep(0.1)


_SHAPE = (  # a schedule's tables and partitions, their kinds and replica identities; how many are published
    "SELECT string_agg(c.relname || c.relkind::text || c.relreplident::text, ',' ORDER BY c.relname)"
    " FROM pg_class c WHERE c.relname LIKE %s AND c.relkind IN ('r', 'p')"
    " UNION ALL SELECT count(*)::text FROM pg_publication_tables WHERE tablename LIKE %s"
)


async def create_tables(schedule: Schedule, dsns: dict[str, str], limit: float = 60.0) -> None:
    """The schedule's DDL on its node (replicated by pgmesh), then wait for every table, partition and
    replica identity on every node, and the tables in pgmesh's publication."""
    async with await psycopg.AsyncConnection.connect(dsns[schedule.ddl_node], autocommit=True) as conn:
        for statement, params in schedule.ddl():
            await conn.execute(statement, params)
        cur = await conn.execute(_SHAPE, [f"% {schedule.tag}#%"] * 2)
        want = await cur.fetchall()
    deadline = time.monotonic() + limit
    for node, dsn in dsns.items():
        while True:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                cur = await conn.execute(_SHAPE, [f"% {schedule.tag}#%"] * 2)
                if await cur.fetchall() == want:
                    break
            if time.monotonic() > deadline:
                raise ScheduleFailed(f"the tables of seed {schedule.seed} did not reach node {node}")
            await asyncio.sleep(0.1)


async def play(router: Router, dsns: dict[str, str], schedule: Schedule, tally: Tally) -> None:
    """One schedule on a running router; raises ScheduleFailed naming the seed."""
    try:
        await create_tables(schedule, dsns)
        tables = schedule.table_names()
        async with await psycopg.AsyncConnection.connect(dsns[schedule.ddl_node], autocommit=True) as conn:
            await run_transaction(conn, Transaction(tuple(schedule.seed_rows), "commit"), "seed", tally)
        await wait_healthy_and_converged(router, list(dsns.values()), tables, CONVERGE_LIMIT)
        await asyncio.gather(*(
            run_session(dsns[node], f"pgmesh property {schedule.tag} {node} {session}", txs, tally)
            for (node, session), txs in schedule.sessions.items()
        ))
        own = await own_rows(schedule, dsns)
        await wait_healthy_and_converged(router, list(dsns.values()), tables, CONVERGE_LIMIT)
        if "key_conflicts" not in schedule.known:  # (then a hot row may move into a node's own keys)
            nodes = schedule.nodes
            elsewhere = {node: dsns[nodes[i - 1]] for i, node in enumerate(nodes)}  # read on another node
            if (now := await own_rows(schedule, elsewhere)) != own:
                raise ScheduleFailed(f"a node's own rows (no other node writes them) changed: {own} -> {now}")
    except ScheduleFailed as exc:
        raise ScheduleFailed(f"seed {schedule.seed}: {exc}\n{describe(schedule)}") from None
    tally.schedules += 1


async def own_rows(schedule: Schedule, dsns: dict[str, str]) -> dict[tuple[str, str], tuple[Any, ...]]:
    """(node, table) -> count and md5 of the node's own rows, read at `dsns[node]`."""
    out = {}
    for index, node in enumerate(schedule.nodes):
        async with await psycopg.AsyncConnection.connect(dsns[node], autocommit=True) as conn:
            for table in schedule.tables:
                query, params = table.own_rows(index)
                row = await (await conn.execute(query, params)).fetchone()
                assert row is not None
                out[(node, table.name)] = tuple(row)
    return out


async def drop_tables(dsn: str, schedule: Schedule) -> None:
    """The schedule's tables and type, dropped on one node (replicated): the catalogue stays small."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for table in schedule.tables:
            await conn.execute(sql.SQL("DROP TABLE {}").format(table.ident))
        types = schedule.user_types()
        await conn.execute(sql.SQL("DROP TYPE {}, {}").format(types["enum"], types["pair"]))
        await conn.execute(sql.SQL("DROP DOMAIN {}").format(types["word"]))


# --------------------------------------------------------------------------------------------- long mode


async def long_run(
    minutes: float, seeds: list[int], names: Sequence[str], known: frozenset[str] = frozenset(),
    repeat: int = 1,
) -> Tally:
    from router.testing.localnodes import create_nodes

    tally = Tally()
    nodes = await asyncio.to_thread(create_nodes, list(names), settings=PROPERTY_SETTINGS)
    try:
        mesh = await prepare_mesh(nodes, ANCHOR)
        dsns = {n.name: n.dsn() for n in nodes}
        deadline = time.monotonic() + minutes * 60
        given = bool(seeds)
        seeds = list(reversed([seed for seed in seeds for _ in range(repeat)]))
        played: dict[int, int] = {}
        async with running_router(mesh.config) as router:
            while (not given and time.monotonic() < deadline) or seeds:
                this = seeds.pop() if seeds else random.randrange(10**9)
                played[this] = played.get(this, 0) + 1
                again = f"r{played[this]}" if played[this] > 1 else ""
                schedule = make_schedule(this, list(names), known=known, again=again)
                try:
                    await play(router, dsns, schedule, tally)
                except ScheduleFailed as exc:
                    tally.failures.append(str(exc))
                    print(f"FAILED: {exc}", flush=True)
                    break  # the mesh may be stuck: a failure is the end of this run
                await drop_tables(dsns[schedule.ddl_node], schedule)
                if tally.schedules % 10 == 0:
                    await tally.count_streamed(list(dsns.values()))
                    print(tally.line(), flush=True)
        await tally.count_streamed(list(dsns.values()))
    finally:
        if tally.failures and os.environ.get("PGMESH_PROPERTY_KEEP"):
            print("nodes kept for a look:", ", ".join(f"{n.name}: {n.dsn()}" for n in nodes), flush=True)
        else:
            for node in nodes:
                node.destroy()
    return tally


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.property_play", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=float(os.environ.get("PGMESH_PROPERTY_MINUTES", 30)))
    parser.add_argument("--seed", type=int, action="append", default=[],
                        help="run this schedule (repeat for several, in order) instead of random ones")
    parser.add_argument("--repeat", type=int, default=1, help="play each --seed this many times")
    parser.add_argument("--nodes", type=int, default=3, choices=(2, 3))
    parser.add_argument("--known", action="append", default=[], choices=KNOWN,
                        help="also shapes known to end apart today (tests.property_schedules.make_schedule)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    started = time.monotonic()
    names = "abc"[: args.nodes]
    tally = asyncio.run(long_run(args.minutes, args.seed, names, frozenset(args.known), args.repeat))
    print(f"{tally.line()} in {time.monotonic() - started:.0f} s", flush=True)
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
