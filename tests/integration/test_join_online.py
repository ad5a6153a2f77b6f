"""A join while the router keeps replicating among the existing nodes (router.ops.join,
router.cluster.joining; issue 22, item 5): the router holds only while the join takes its snapshot and while
it makes the new node a member; during the copy the existing links stream, the router may be killed and
started again, and the new node still gets every transaction exactly once (docs/join.md).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from router.ops.join import join_node
from router.testing.mesh import execute, fetch, free_port, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

pytestmark = pytest.mark.slow  # a copy with Spark (a JVM) long enough to kill the router during it

BIG_ROWS = 200_000
# `gated` rows pass a check that waits for an advisory lock the test holds on the new node while it kills
# the router: the copy is under way (its COPY into `gated` waits) for as long as the test needs
SCHEMA = """
CREATE FUNCTION gate(v int) RETURNS boolean LANGUAGE plpgsql SET lock_timeout = 0 AS $$
BEGIN PERFORM pg_advisory_lock_shared(4242); PERFORM pg_advisory_unlock_shared(4242); RETURN v >= 0; END $$;
CREATE DOMAIN gated_int AS int CHECK (gate(VALUE));
CREATE TABLE big (id bigint PRIMARY KEY, a int NOT NULL, b text);
CREATE TABLE gated (id int PRIMARY KEY, v gated_int);
CREATE TABLE acct (id bigint PRIMARY KEY, v int NOT NULL, who text);
CREATE TABLE probe (id text PRIMARY KEY);
"""
SEED = (
    "INSERT INTO big SELECT g, g % 1000, md5(g::text) || repeat('x', 40)"
    f" FROM generate_series(1, {BIG_ROWS}) g;"
    " INSERT INTO gated SELECT g, g FROM generate_series(1, 1000) g;"
)
TABLES = ["big", "gated", "acct", "probe"]
COPYING = "SELECT count(*) > 0 FROM pg_stat_activity WHERE query ILIKE 'COPY %FROM STDIN%'"


async def writer(node: Any, base: int, stop: asyncio.Event) -> int:
    """Inserts on keys only this node writes, an update of an earlier one every third, and an update of a
    `big` row only this node touches every tenth, until `stop`: returns how many rows it inserted."""
    written = 0
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        while not stop.is_set():
            await conn.execute(
                "INSERT INTO acct (id, v, who) VALUES (%s, 0, %s)", [base + written, node.name]
            )
            if written % 3 == 2:
                await conn.execute("UPDATE acct SET v = v + 1 WHERE id = %s", [base + written // 2])
            if written % 10 == 9:
                await conn.execute("UPDATE big SET a = a + 1 WHERE id = %s", [base // 1_000_000 * 1000 + 7])
            written += 1
            await asyncio.sleep(0.005)
    return written


def start_router(config_path: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "router", "--log-level", "INFO", "run", "--config", str(config_path)],
        stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
    )


async def arrives(source: Any, target: Any, key: str, join: asyncio.Task[Any], new: Any) -> None:
    """A row written on `source` reaches `target` while the join is still copying into `new`."""
    await execute(source.dsn(), f"INSERT INTO probe VALUES ('{key}')")  # (keys are the test's own)
    await wait_for(
        lambda: join.done() or _has(target.dsn(), "SELECT count(*) FROM probe WHERE id = %s", [key]),
        f"{key} from {source.name} on {target.name}", 60,
    )
    assert not join.done(), f"the join ended before {key} arrived: make the copy longer"
    assert await _has(new.dsn(), COPYING), "the copy was not running any more"


async def _has(dsn: str, query: str, params: list[Any] | None = None) -> bool:
    rows = await fetch(dsn, query, params=params) if params else await fetch(dsn, query)
    return bool(rows and rows[0][0])


async def test_a_join_keeps_the_others_replicating_through_a_router_kill(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    m = await mesh(nodes=3, schema=SCHEMA + SEED, spares=["d"], admin_port=free_port())
    nodes = m.all_nodes
    a, b, c, d = nodes
    four = m.config_for(nodes)  # config.toml with d added: the router leaves d out until it joined
    config_path = m.write_config(tmp_path / "config.toml", nodes)
    log = tmp_path / "router.log"
    router = start_router(config_path, log)
    stop = asyncio.Event()
    writers = [asyncio.create_task(writer(n, (i + 1) * 1_000_000, stop)) for i, n in enumerate(nodes[:3])]
    try:
        await execute(a.dsn(), "INSERT INTO probe VALUES ('before')")
        await wait_converged(nodes[:3], ["probe"], 120)
        gate = await psycopg.AsyncConnection.connect(d.dsn(), autocommit=True)
        await gate.execute("SELECT pg_advisory_lock(4242)")  # the copy into `gated` waits for it
        join = asyncio.create_task(join_node(four, "d", donor="a"))
        await wait_for(lambda: join.done() or _has(d.dsn(), COPYING), "the copy to run", 180)
        assert not join.done(), join.result()
        # while d is copied, the existing links stream (the router does not hold for the copy)...
        await arrives(b, c, "b-during-copy", join, d)
        # ...and go on after the router is killed and started again mid-copy
        os.killpg(router.pid, signal.SIGKILL)
        await asyncio.to_thread(router.wait)
        router = start_router(config_path, log)
        await arrives(c, a, "c-after-restart", join, d)
        await gate.close()  # the copy goes on
        report = await join
        assert report.rows >= BIG_ROWS and report.positions.keys() == {"a", "b", "c"}
        # d is a member now: it receives, and what it writes reaches the others
        await execute(a.dsn(), "INSERT INTO probe VALUES ('after-join')")
        after = "SELECT count(*) FROM probe WHERE id = 'after-join'"
        await wait_for(lambda: _has(d.dsn(), after), "d in", 120)
        writers.append(asyncio.create_task(writer(d, 4_000_000, stop)))
        await wait_for(lambda: _has(a.dsn(), "SELECT count(*) > 20 FROM acct WHERE who = 'd'"), "d out", 120)
        stop.set()
        written = await asyncio.gather(*writers)
        await wait_converged(nodes, TABLES, 240)
    finally:
        stop.set()
        await asyncio.gather(*writers, return_exceptions=True)
        if router.poll() is None:
            os.killpg(router.pid, signal.SIGTERM)
            await asyncio.to_thread(router.wait, 60)
    # every transaction exactly once on every node: each writer's rows, each update applied once
    for node in nodes:
        rows = await fetch(node.dsn(), "SELECT who, count(*), count(DISTINCT id), sum(v) FROM acct"
                           " GROUP BY who ORDER BY who")
        assert [(w, n) for w, n, _, _ in rows] == list(zip("abcd", written, strict=True)), (node.name, rows)
        assert all(n == distinct for _, n, distinct, _ in rows)
        assert await fetch(node.dsn(), "SELECT count(*) FROM big") == [(BIG_ROWS,)]
    for i, n in enumerate(written):
        expected = sum(1 for w in range(n) if w % 3 == 2)  # each update adds 1 to one of its rows
        got = await fetch(a.dsn(), "SELECT sum(v) FROM acct WHERE who = %s", params=["abcd"[i]])
        assert got == [(expected,)], ("abcd"[i], got, expected)
        bumps = sum(1 for w in range(n) if w % 10 == 9)
        big = await fetch(d.dsn(), "SELECT a - (%s %% 1000) FROM big WHERE id = %s",
                          params=[(i + 1) * 1000 + 7, (i + 1) * 1000 + 7])
        assert big == [(bumps,)], ("abcd"[i], big, bumps)
    # nothing pins a slot any more
    for node in nodes[:3]:
        assert await fetch(node.dsn(), "SELECT count(*) FROM pgmesh.joining") == [(0,)]
