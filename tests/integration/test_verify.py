"""Continuous verification (`[verify]`, router.service.verify) on a real 3-node mesh with the router
running, at an interval of 2 s on small tables.

A difference is made the way replication cannot see it: a change committed on one node in a session under a
replication origin of its own (the router forwards only a node's own changes: on 16+ pgoutput leaves
changes with an origin out, on 15 the router drops them as echoes). Verification must report it in status
and /metrics (the node outside the majority, per table; a keyless table's extra copy too) and read 0 again
once the table is identical; writes in flight on every node while passes run are never reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from router.service.supervisor import Router
from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = """CREATE TABLE t (id bigint PRIMARY KEY, v text NOT NULL);
CREATE TABLE k (name text NOT NULL, n int NOT NULL);
CREATE TABLE live (id bigint PRIMARY KEY, v int NOT NULL);"""
TABLES = ["t", "k", "live"]
pytestmark = pytest.mark.slow  # about 15 s: several passes, under writes and after

VERIFY = '[verify]\ninterval = "2s"\n'


async def unreplicated(node: Any, *statements: str) -> None:
    """Run `statements` on `node` in one transaction under a foreign replication origin: not carried."""
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        await conn.execute("SELECT pg_replication_origin_create('someother') WHERE NOT EXISTS"
                           " (SELECT 1 FROM pg_replication_origin WHERE roname = 'someother')")
        await conn.execute("SELECT pg_replication_origin_session_setup('someother')")
        async with conn.transaction():
            for statement in statements:
                await conn.execute(statement.encode())


def divergent(router: Router) -> dict[tuple[str, str], float]:
    """pgmesh_divergent_rows as /metrics renders it: (node, table) -> rows."""
    found = {}
    for line in router.metrics.render().splitlines():
        match = re.fullmatch(r'pgmesh_divergent_rows\{node="(\w+)",table="([\w.]+)"\} (\S+)', line)
        if match:
            found[(match[1], match[2])] = float(match[3])
    return found


async def passes_after(router: Router, more: int) -> None:
    """Wait until `more` full passes have ended after now."""
    assert router.verify is not None
    target = router.verify.passes + more
    await wait_for(lambda: router.verify is not None and router.verify.passes >= target,
                   f"{more} verification pass(es)", 60)


@contextlib.asynccontextmanager
async def writing(nodes: list[Any]) -> AsyncIterator[list[int]]:
    """Upserts on `live` on every node (keys shared by all of them) until the block ends."""
    done = asyncio.Event()
    count = [0]

    async def write(node: Any) -> None:
        async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
            i = 0
            while not done.is_set():
                i += 1
                await conn.execute("INSERT INTO live VALUES (%s, 0) ON CONFLICT (id) DO UPDATE SET"
                                   " v = live.v + 1", [i % 300])
                count[0] += 1

    tasks = [asyncio.create_task(write(node)) for node in nodes]
    try:
        yield count
    finally:
        done.set()
        await asyncio.gather(*tasks)


async def test_verification_reports_a_hidden_difference_and_never_writes_in_flight(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, extra=VERIFY)
    a, b, c = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO t SELECT g, 'row ' || g FROM generate_series(1, 5000) g",
                      "INSERT INTO k SELECT 'name ' || g, g FROM generate_series(1, 500) g")
        await wait_converged(m.nodes, TABLES)

        async with writing(m.nodes) as written:  # passes while every node writes the same keys
            await passes_after(router, 3)
        assert written[0] > 0
        found = divergent(router)
        assert {table for _, table in found} == {"public.t", "public.k", "public.live"}
        assert not any(found.values()), found
        status = router.status().verify
        assert status is not None and status.divergent == {} and status.tables == 3

        await unreplicated(b, "UPDATE t SET v = 'hidden' WHERE id = 4321")
        await unreplicated(c, "INSERT INTO k VALUES ('name 7', 7)")  # a second copy of a row
        await wait_for(lambda: divergent(router).get(("b", "public.t")) == 1
                       and divergent(router).get(("c", "public.k")) == 1, "the differences reported", 60)
        found = divergent(router)
        assert found[("a", "public.t")] == found[("c", "public.t")] == found[("a", "public.k")] == 0
        status = router.status().verify
        assert status is not None
        assert status.divergent == {"public.t": {"b": 1}, "public.k": {"c": 1}}
        assert status.first_keys["public.t"] == ["(4321)"]
        assert "DIVERGENT ROWS: public.k 1 key(s), rows apart: c 1" in status.describe()

        await unreplicated(b, "UPDATE t SET v = 'row 4321' WHERE id = 4321")  # made identical again
        await unreplicated(c, "DELETE FROM k WHERE ctid = (SELECT max(ctid) FROM k WHERE name = 'name 7')")
        await wait_for(lambda: not any(divergent(router).values()), "the differences gone", 60)
        status = router.status().verify
        assert status is not None and status.divergent == {}


async def test_auto_repair_fixes_the_tables_it_names_only(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, extra=VERIFY + 'auto_repair = ["t"]\n')
    a, b, c = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO t SELECT g, 'row ' || g FROM generate_series(1, 2000) g",
                      "INSERT INTO live SELECT g, 0 FROM generate_series(1, 100) g")
        await wait_converged(m.nodes, TABLES)
        await passes_after(router, 1)

        await unreplicated(b, "UPDATE t SET v = 'hidden' WHERE id = 42", "DELETE FROM t WHERE id = 43")
        await unreplicated(c, "INSERT INTO t VALUES (5000, 'only on c')",
                           "UPDATE live SET v = 9 WHERE id = 7")
        await wait_for(lambda: router.verify is not None and router.verify.repaired.get("public.t") == 3,
                       "t's three keys repaired", 60)
        await wait_converged(m.nodes, ["t"])  # one winner per key, written on every node
        await wait_for(lambda: divergent(router).get(("c", "public.live")) == 1
                       and not any(n for (_, table), n in divergent(router).items() if table == "public.t"),
                       "t identical again, live (not named) still reported", 60)
        assert await fetch(c.dsn(), "SELECT v FROM live WHERE id = 7") == [(9,)]  # left as it is
