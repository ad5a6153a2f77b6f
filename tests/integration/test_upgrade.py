"""A major-version upgrade with no downtime, 15 to 18 (issue 19; docs/upgrade.md runs the same recipe).

Owns: the recipe end to end on real nodes, with the `pgmesh` command line where docs/upgrade.md uses it:
a cluster of two 15 nodes takes writes on both; two 18 nodes join it under those writes (`pgmesh join`
against the running router: the schema from the donor, a 15 node then an 18 one, with 18's pg_dump; the
rows by Spark); the clients move to the 18 nodes (for a while all four take writes); the old nodes part
(`pgmesh part`, router stopped); the 18 nodes replicate on their own and hold every row, none lost,
none twice. Must not: sleep to wait (every wait
polls a condition) or assert on timings. Skipped, with the reason, where 18 is not installed.
"""

from __future__ import annotations

import asyncio
import functools
import random
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from router.config.model import load_config
from router.ops.control import fetch_status
from router.testing.mesh import fetch, free_port, running_router, wait_converged, wait_for
from tests.fix_cluster import require_versions
from tests.fix_mesh import MeshFactory

pytestmark = [pytest.mark.slow, pytest.mark.versions]  # the join copies with Spark (a JVM); pins versions

OLD, NEW = 15, 18
SEED_ROWS = 20_000
SCHEMA = f"""
CREATE TABLE "seed" ("id" bigint PRIMARY KEY, "a" int NOT NULL, "b" text, "c" numeric, "d" timestamptz);
CREATE TABLE "acct" ("id" bigint PRIMARY KEY, "v" int NOT NULL, "who" text NOT NULL);
CREATE INDEX "acct_who_idx" ON "acct" ("who");
INSERT INTO "seed" SELECT g, g % 1000, md5(g::text), g / 7.0, '2026-01-01'::timestamptz + g * interval '1 s'
  FROM generate_series(1, {SEED_ROWS}) g;
"""
TABLES = ["seed", "acct"]


class Writer:
    """A client of one node: inserts its own keys, updates and deletes some of them, until stopped; what
    it left (`alive`) is what every node must hold of its keys in the end."""

    __slots__ = ("alive", "base", "node", "stop", "written")

    def __init__(self, node: Any, base: int) -> None:
        self.node = node
        self.base = base
        self.stop = asyncio.Event()
        self.alive: set[int] = set()
        self.written = 0

    async def run(self) -> None:
        rng = random.Random(self.base)
        async with await psycopg.AsyncConnection.connect(self.node.dsn(), autocommit=True) as conn:
            while not self.stop.is_set():
                key = self.base + self.written
                await conn.execute('INSERT INTO "acct" ("id", "v", "who") VALUES (%s, 0, %s)',
                                   [key, self.node.name])
                self.alive.add(key)
                if self.written % 4 == 1:
                    some = self.base + rng.randrange(self.written)
                    await conn.execute('UPDATE "acct" SET "v" = "v" + 1 WHERE "id" = %s', [some])
                if self.written % 25 == 7 and key - 5 in self.alive:
                    await conn.execute('DELETE FROM "acct" WHERE "id" = %s', [key - 5])
                    self.alive.discard(key - 5)
                self.written += 1
                await asyncio.sleep(0.005)  # a client's pace, not a wait

    async def run_for(self, count: int) -> None:
        """`count` rounds of writes, then stop."""
        self.stop.clear()
        task = asyncio.create_task(self.run())
        await wait_for(lambda: self.written >= count, f"{count} writes on {self.node.name}")
        self.stop.set()
        await task


async def pgmesh(*args: str) -> str:
    """`pgmesh ARGS` as an operator runs it; its output, or a failure with it."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await process.communicate()
    text = out.decode(errors="replace")
    assert process.returncode == 0, f"pgmesh {' '.join(args)} exited {process.returncode}:\n{text[-3000:]}"
    return text


async def ids(node: Any) -> set[int]:
    return {row[0] for row in await fetch(node.dsn(), 'SELECT "id" FROM "acct"')}


async def server_major(node: Any) -> int:
    rows = await fetch(node.dsn(), "SELECT current_setting('server_version_num')::int / 10000")
    return int(rows[0][0])


async def origins(node: Any) -> list[str]:
    return [row[0] for row in await fetch(node.dsn(), "SELECT roname FROM pg_replication_origin ORDER BY 1")]


async def links_streaming(path: Path, count: int) -> bool:
    """What `pgmesh status` shows between the steps: `count` links, all streaming, none with an error."""
    report = await fetch_status(load_config(path))
    states = {(link.source, link.target): (link.state, link.last_error) for link in report.links}
    return len(states) == count and set(states.values()) == {("streaming", None)}


async def test_upgrade_15_to_18_join_under_writes_move_clients_part_the_old_nodes(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    require_versions([OLD, NEW])
    m = await mesh(nodes=2, schema=SCHEMA, spares=["c", "d"], versions=[OLD, OLD, NEW, NEW],
                   admin_port=free_port())
    a, b, c, d = m.all_nodes
    path = m.write_config(tmp_path / "config.toml", [a, b])
    old = [Writer(a, 1_000_000), Writer(b, 2_000_000)]
    new = [Writer(c, 3_000_000), Writer(d, 4_000_000)]
    tasks = [asyncio.create_task(w.run()) for w in old]
    try:
        async with running_router(m.config, reload=lambda: load_config(path)) as router:
            await wait_for(lambda: all(w.written > 30 for w in old), "writes on both 15 nodes")
            # steps 1-3, once per new node: add it to config.toml, `pgmesh join` it against the running
            # router (which holds; the 15 nodes' clients go on writing), check `pgmesh status`. c's
            # donor is a 15 node, d's the 18 node c: both dumps are made by 18's pg_dump
            for joiner, donor, members in ((c, a, [a, b, c]), (d, c, [a, b, c, d])):
                m.write_config(path, members)
                before = [w.written for w in old]
                out = await pgmesh("--log-level", "INFO", "join", joiner.name, "--config", str(path),
                                   "--from", donor.name)
                assert f"node {joiner.name} joined from {donor.name}" in out, out
                assert f"pg_dump and pg_restore {NEW} from" in out, out  # the newer of the two servers'
                assert all(w.written > n for w, n in zip(old, before, strict=True)), "writes stopped"
                count = len(members) * (len(members) - 1)
                await wait_for(functools.partial(links_streaming, path, count), f"{count} links", 120)
            # step 4: clients move to c and d; for a while all four take writes, then the 15 nodes' stop
            tasks += [asyncio.create_task(w.run()) for w in new]
            await wait_for(lambda: all(w.written > 30 for w in new), "writes on c and d")
            await wait_for(lambda: router.appliers[("c", "a")].stats.applied_transactions > 20,
                           "c's writes on a")
            for w in old:
                w.stop.set()
            await wait_for(lambda: all(w.written > 60 for w in new), "c and d alone take the writes")
            # step 5: the old nodes hold everything the new ones took (the way back stays open)
            for w in new:
                w.stop.set()
            await asyncio.gather(*tasks)
            await wait_converged([a, b, c, d], TABLES, 120)
            assert all(applier.last_error is None for applier in router.appliers.values())
    finally:
        for w in [*old, *new]:
            w.stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)

    # step 6: router stopped; the old nodes part, one at a time, each from the config it is still in
    for gone, members in ((a, [a, b, c, d]), (b, [b, c, d])):
        m.write_config(path, members)
        parted = await pgmesh("part", gone.name, "--config", str(path))
        assert f"dropped replication origin pgmesh_t_{gone.name}" in parted, parted
        assert await fetch(gone.dsn(), "SELECT count(*) FROM pg_replication_slots") == [(0,)]
    m.write_config(path, [c, d])
    for node in (c, d):
        assert not {"pgmesh_t_a", "pgmesh_t_b"} & set(await origins(node)), node.name
        assert await server_major(node) == NEW

    # step 7: the router over c and d only: they replicate, and hold every row, none lost, none twice
    after = [Writer(c, 5_000_000), Writer(d, 6_000_000)]
    async with running_router(load_config(path)):
        await asyncio.gather(*(w.run_for(20) for w in after))
        await wait_converged([c, d], TABLES, 120)
    expected = set().union(*(w.alive for w in [*old, *new, *after]))
    for node in (c, d):
        assert await ids(node) == expected, node.name
        assert await fetch(node.dsn(), 'SELECT count(*) = count(DISTINCT "id") FROM "acct"') == [(True,)]
        seed = await fetch(node.dsn(), 'SELECT count(*), count(DISTINCT "id") FROM "seed"')
        assert seed == [(SEED_ROWS, SEED_ROWS)], node.name
