"""The router over three real nodes: convergence, origins and commit times, order, atomicity, delay."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import psycopg

from protocol.lsn import datetime_to_pg_us
from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = """
CREATE TABLE accounts (id int PRIMARY KEY, owner text NOT NULL, balance numeric NOT NULL, note text);
CREATE TABLE orders (id bigint PRIMARY KEY, account int, amount numeric, payload text);
CREATE TABLE events (node text, seq int, at timestamptz);
ALTER TABLE events REPLICA IDENTITY FULL;
CREATE TABLE scratch (id int PRIMARY KEY, v text);
"""
TABLES = ["accounts", "orders", "events", "scratch"]


async def workload(node: Any, base: int, rounds: int, seed: int) -> None:
    """Writes on one node, on keys no other node touches: every kind of change the router must carry."""
    rng = random.Random(seed)
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        for i in range(rounds):
            key = base + i
            await conn.execute("INSERT INTO accounts VALUES (%s, %s, 100, NULL)", [key, f"{node.name}-{i}"])
            change = rng.randint(1, 50)
            await conn.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", [change, key])
            async with conn.transaction():  # a multi-table transaction
                await conn.execute(
                    "INSERT INTO orders VALUES (%s, %s, %s, %s)",
                    [key, key, rng.randint(1, 99), "".join(rng.choices("abcdef0123456789", k=6000))],
                )
                await conn.execute("UPDATE accounts SET note = 'ordered' WHERE id = %s", [key])
                await conn.execute("INSERT INTO events VALUES (%s, %s, now())", [node.name, i])
            # the TOASTed payload is left untouched by this update
            await conn.execute("UPDATE orders SET amount = amount * 2 WHERE id = %s", [key])
            if i % 4 == 1:
                await conn.execute("UPDATE accounts SET id = id + 500000 WHERE id = %s", [key])  # key change
            if i % 5 == 2:
                await conn.execute("DELETE FROM orders WHERE id = %s", [key])
            if i % 7 == 3:
                await conn.execute("DELETE FROM events WHERE node = %s AND seq = %s", [node.name, i])


async def scratch_with_truncate(node: Any) -> None:
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        await conn.execute("INSERT INTO scratch SELECT i, 'first' FROM generate_series(1, 50) i")
        await conn.execute("TRUNCATE scratch")
        await conn.execute("INSERT INTO scratch SELECT i, 'second' FROM generate_series(1, 20) i")


NEWEST_APPLIED = """
SELECT max(x.timestamp) FROM (SELECT xmin FROM accounts UNION ALL SELECT xmin FROM orders
  UNION ALL SELECT xmin FROM events UNION ALL SELECT xmin FROM scratch) AS r,
  pg_xact_commit_timestamp_origin(r.xmin) AS x JOIN pg_replication_origin AS o ON o.roident = x.roident
WHERE o.roname = %s
"""


async def newest_applied_is_seen(router: Any, target: Any, source: Any, origin: str) -> None:
    """Wait until `target`'s seen vector holds exactly the commit time of the newest transaction of
    `source` applied on `target` (its rows carry `source`'s origin and commit time)."""
    ((when,),) = await fetch(target.dsn(), NEWEST_APPLIED, [origin])
    pump = router.pumps[target.name]
    await wait_for(lambda: dict(pump.seen.snapshot).get(source.name) == datetime_to_pg_us(when),
                   f"{target.name}'s seen vector to hold {source.name}'s newest commit {when}")


async def test_three_nodes_converge_with_original_origin_and_commit_time(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA)
    nodes, config = m.nodes, m.config
    async with running_router(config) as router:
        await asyncio.gather(
            *(workload(node, (i + 1) * 1_000_000, 40, i) for i, node in enumerate(nodes)),
            scratch_with_truncate(nodes[0]),
        )
        await wait_converged(nodes, TABLES)
        status = router.status()
        ((version,),) = await fetch(nodes[0].dsn(), "SELECT current_setting('server_version_num')::int")
        if version < 160000:
            # What pgmesh applied on a node comes back in that node's stream as an echo: not decoded.
            assert all(pump.source.stats.echo_rows_skipped > 0 for pump in router.pumps.values())
            assert all(s.echoes > 0 for s in status.sources)
        else:
            # 16+ (origin 'none'): no echo at all; the appliers' pgmesh.applied notes tell each node's
            # seen vector the newest commit of every other node applied there
            assert all(pump.source.stats.echo_rows_skipped == 0 for pump in router.pumps.values())
            assert all(s.echoes == 0 for s in status.sources)
            for target in nodes:
                for source in nodes:
                    if source is not target:
                        await newest_applied_is_seen(router, target, source, config.origin_name(source.name))
    rows = await fetch(nodes[1].dsn(), "SELECT count(*) FROM accounts")
    assert rows[0][0] == 120
    assert (await fetch(nodes[2].dsn(), "SELECT count(*), min(v) FROM scratch"))[0] == (20, "second")
    assert all(link.state == "streaming" and link.last_error is None for link in status.links)
    assert {(link.source, link.target) for link in status.links} == {
        (s, t) for s in "abc" for t in "abc" if s != t
    }
    # Every replicated row carries its source's origin and the source's own commit time.
    for source in nodes:
        origin_rows = await fetch(
            source.dsn(),
            "SELECT id, pg_xact_commit_timestamp(xmin) FROM orders WHERE id / 1000000 = %s"
            " ORDER BY id LIMIT 5",
            [nodes.index(source) + 1],
        )
        assert origin_rows
        for target in nodes:
            if target is source:
                continue
            for key, committed in origin_rows:
                (row,) = await fetch(
                    target.dsn(),
                    "SELECT o.roname, (pg_xact_commit_timestamp_origin(t.xmin)).timestamp"
                    " FROM orders t JOIN pg_replication_origin o"
                    " ON o.roident = (pg_xact_commit_timestamp_origin(t.xmin)).roident WHERE t.id = %s",
                    [key],
                )
                assert row == (config.origin_name(source.name), committed)


async def test_reader_never_sees_half_a_transaction_or_out_of_order(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA)
    nodes, config = m.nodes, m.config
    a, b = nodes[0], nodes[1]
    async with await psycopg.AsyncConnection.connect(a.dsn(), autocommit=True) as conn:
        for i in range(300):  # a backlog: each transaction writes two tables
            async with conn.transaction():
                await conn.execute("INSERT INTO accounts VALUES (%s, 'pair', %s, NULL)", [i, i])
                await conn.execute("INSERT INTO events VALUES ('pair', %s, now())", [i])
    violations: list[str] = []
    done = asyncio.Event()

    async def reader() -> None:
        async with await psycopg.AsyncConnection.connect(b.dsn(), autocommit=True) as conn:
            while not done.is_set():
                async with conn.transaction():
                    await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    cur = await conn.execute("SELECT id FROM accounts ORDER BY id")
                    accts = [r[0] for r in await cur.fetchall()]
                    cur = await conn.execute("SELECT seq FROM events ORDER BY seq")
                    evs = [r[0] for r in await cur.fetchall()]
                if accts != evs:
                    violations.append(f"half a transaction: {len(accts)} accounts, {len(evs)} events")
                if accts != list(range(len(accts))):
                    violations.append("out of commit order")
                await asyncio.sleep(0)

    task = asyncio.create_task(reader())
    async with running_router(config):
        await wait_converged(nodes, ["accounts", "events"])
    done.set()
    await task
    assert not violations, violations[:3]


async def test_apply_delay_holds_each_transaction(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, replication="apply_delay_ms = 2000")
    nodes, config = m.nodes, m.config
    a, b = nodes
    async with running_router(config):
        commits = []
        for i in range(3):
            await execute(a.dsn(), f"INSERT INTO scratch VALUES ({i}, 'delayed')")
            query = "SELECT extract(epoch FROM pg_xact_commit_timestamp(xmin)) FROM scratch WHERE id = %s"
            (row,) = await fetch(a.dsn(), query, [i])
            commits.append(float(row[0]))
        seen: dict[int, float] = {}

        async def all_seen() -> bool:
            for (key,) in await fetch(b.dsn(), "SELECT id FROM scratch"):
                seen.setdefault(key, time.time())
            return len(seen) == 3

        await wait_for(all_seen, "the delayed rows on b", 30)
    for key, commit in enumerate(commits):
        assert seen[key] - commit >= 2.0, f"row {key} visible {seen[key] - commit:.3f} s after its commit"


async def test_missing_column_pauses_only_that_link_until_resume(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA)
    nodes, config = m.nodes, m.config
    a, b, c = nodes
    behind = "SET pgmesh.ddl_inner = on; "  # DDL pgmesh neither replicates nor records (docs/ddl.md)
    await execute(b.dsn(), behind + "ALTER TABLE scratch DROP COLUMN v")  # b drifts from the others
    async with running_router(config) as router:
        link = router.appliers[("a", "b")]
        link.schema_wait = 0.5  # (default 60 s: DDL from a third node may still be on its way)
        await execute(a.dsn(), "INSERT INTO scratch VALUES (1, 'needs v')")
        await wait_for(lambda: link.state.value == "error", "the a -> b link to pause")
        assert link.last_error is not None
        assert "table public.scratch" in link.last_error and "column v" in link.last_error
        assert "node b" in link.last_error and "LSN" in link.last_error
        await execute(a.dsn(), "INSERT INTO accounts VALUES (1, 'still flowing', 0, NULL)")
        await wait_converged([a, c], ["accounts", "scratch"])  # other links keep flowing
        assert not await fetch(b.dsn(), "SELECT 1 FROM accounts")  # a -> b holds, in order
        await execute(b.dsn(), behind + "ALTER TABLE scratch ADD COLUMN v text")
        await router.resume("b")
        await wait_converged(nodes, ["accounts", "scratch"])
        assert router.health() == (True, "ok")
