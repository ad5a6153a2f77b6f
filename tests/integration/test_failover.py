"""A node fails over to its physical standby (docs/failover.md): on 17+ pgmesh goes on from the promoted
standby with nothing lost or repeated; on 15/16 the slot is missing there and the router says what to do.

Owns: building a physical standby of a mesh node (pg_basebackup into a spare node's data directory, its own
physical slot, the 17+ slot-sync settings), promoting it, and the failover scenarios:
- 18, a crash: writes on both nodes under a running router; the standby's copy of pgmesh's failover slot
  is synced; b is crash-stopped with the router running, its standby promoted, the router started again
  over it (b's address changed in the config), while a keeps writing throughout. Every acknowledged
  write is on both nodes exactly once (no conflict, one arrival per key, counted by an ALWAYS trigger);
  the one write in flight at the crash is there once or nowhere. b's own writes are on the standby when
  acknowledged (synchronous_standby_names): physical replication's part, not pgmesh's.
- 18, the standby behind: it is stopped while the router goes on applying a's rows into b, then b
  crashes. The standby lacks rows b had flushed; a's slot was not confirmed past what the standby had
  (router.service.monitor.StandbyGate), so they come again. Without the gate this test fails.
- init's report on the standby (warned until synchronized_standby_slots names it).
- 15: the promoted standby has no pgmesh slot; the source fails with 42704 naming the node and saying to
  re-join it.
Must not: sleep to let something happen (every wait polls a condition, bounded in time), or assert on
timings.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest

from router.cluster.checks import check_cluster
from router.config.model import parse_config
from router.testing.mesh import Mesh, execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

logger = logging.getLogger(__name__)
pytestmark = pytest.mark.versions  # pins its nodes' versions: runs once, not again under PGMESH_TEST_PG

STANDBY_SLOT = "b_standby"
STANDBY_APP = "b_standby"  # the standby's application_name (synchronous_standby_names names it)
LIMIT_S = 120.0

# `writes` replicates; `arrivals` stays on each node: an ALWAYS trigger adds one row per row that reached
# `writes` here, written locally or applied by the router, so a transaction applied twice shows up.
SCHEMA = """
CREATE TABLE "writes" ("key" text PRIMARY KEY, "node" text NOT NULL);
CREATE TABLE "arrivals" ("key" text NOT NULL);
CREATE FUNCTION "count_arrival"() RETURNS trigger LANGUAGE plpgsql AS
$$BEGIN INSERT INTO "arrivals" VALUES (NEW."key"); RETURN NULL; END$$;
CREATE TRIGGER "count_arrival" AFTER INSERT ON "writes" FOR EACH ROW EXECUTE FUNCTION "count_arrival"();
ALTER TABLE "writes" ENABLE ALWAYS TRIGGER "count_arrival";
"""
REPLICATION = 'exclude = ["public.arrivals"]'


# ---------------------------------------------------------------------------------------------------------
# The standby


def _as_server_user(argv: Sequence[str]) -> list[str]:
    if os.geteuid() != 0:
        return list(argv)
    return [shutil.which("runuser") or "/usr/sbin/runuser", "-u", "postgres", "--", *argv]


def _server_tool(node: Any, tool: str, *args: str) -> None:
    """Run one of the node's own binaries (its version's) as the server's OS user."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    argv = _as_server_user([str(node.bindir / tool), *args])
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=LIMIT_S, cwd=node.base_dir)
    assert done.returncode == 0, f"{tool} on node {node.name}: {done.stderr.strip()[-2000:]}"


def make_standby(primary: Any, standby: Any, *, sync_slots: bool) -> None:
    """Turn the spare node `standby` into a streaming physical standby of `primary` (a fresh base backup
    over the physical slot STANDBY_SLOT); with `sync_slots` (17+), one that keeps failover slots synced."""
    standby.stop("fast")
    shutil.rmtree(standby.datadir)
    conninfo = f"host=127.0.0.1 port={primary.port} user=postgres dbname={primary.dbname}"
    _server_tool(primary, "pg_basebackup", "-D", str(standby.datadir), "-d", conninfo,
                 "-X", "stream", "-C", "-S", STANDBY_SLOT, "--no-sync", "--checkpoint=fast")
    standby.settings.update({
        "primary_conninfo": f"{conninfo} application_name={STANDBY_APP}",  # dbname: slot sync needs it
        "primary_slot_name": STANDBY_SLOT,
        "hot_standby": "on",
        "hot_standby_feedback": "on",
    })
    if sync_slots:
        standby.settings["sync_replication_slots"] = "on"
    standby.write_config()  # its own port, socket directory and settings over the primary's copy
    signal = standby.datadir / "standby.signal"
    signal.touch()
    if os.geteuid() == 0:
        shutil.chown(signal, user="postgres", group="postgres")
    standby.start()


async def streaming(primary: Any) -> bool:
    rows = await fetch(primary.dsn(), "SELECT state FROM pg_stat_replication WHERE application_name = %s",
                       [STANDBY_APP])
    return rows == [("streaming",)]


async def synced(standby: Any, slot: str) -> bool:
    """The standby holds a usable (synced, persisted) copy of the failover slot `slot`."""
    rows = await fetch(standby.dsn(), "SELECT synced AND NOT temporary FROM pg_replication_slots"
                       " WHERE slot_name = %s", [slot])
    return rows == [(True,)]


async def replayed(standby: Any, lsn: str) -> bool:
    rows = await fetch(standby.dsn(), "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", [lsn])
    return rows == [(True,)]


async def promote(standby: Any) -> None:
    _server_tool(standby, "pg_ctl", "-D", str(standby.datadir), "-w", "-t", str(int(LIMIT_S)), "promote")
    rows = await fetch(standby.dsn(), "SELECT pg_is_in_recovery()")
    assert rows == [(False,)], f"node {standby.name} is still in recovery after pg_ctl promote"


class Renamed:
    """Node `name` of the config at another server's address: the promoted standby."""

    def __init__(self, name: str, server: Any) -> None:
        self.name = name
        self.server = server

    def dsn(self) -> str:
        return str(self.server.dsn())


# ---------------------------------------------------------------------------------------------------------
# Writers


class Writer:
    """One session inserting a row per transaction until stopped; every key it was told committed
    (`acked`) and the one whose commit it never heard of (`unsure`, at a crash)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.acked: list[str] = []
        self.unsure: list[str] = []
        self.stop = asyncio.Event()

    async def run(self, dsn: str) -> None:
        """Write on `dsn` until stopped or the server goes away (then the write in flight is unsure)."""
        key = ""
        try:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                while not self.stop.is_set():
                    key = f"{self.prefix}-{len(self.acked) + len(self.unsure)}"
                    await conn.execute('INSERT INTO "writes" VALUES (%s, %s)', [key, self.prefix])
                    self.acked.append(key)
                    key = ""
                    await asyncio.sleep(0.005)  # a rate, not a wait: about 200 rows/s at most
        except psycopg.OperationalError:
            if key:
                self.unsure.append(key)

    def count_on(self, rows: Sequence[tuple[Any, ...]]) -> int:
        return sum(1 for (key,) in rows if key.startswith(f"{self.prefix}-"))


async def keys(node: Any) -> list[tuple[Any, ...]]:
    return await fetch(node.dsn(), 'SELECT "key" FROM "writes"')


async def has_rows(node: Any, writer: Writer, at_least: int) -> bool:
    return writer.count_on(await keys(node)) >= at_least


# ---------------------------------------------------------------------------------------------------------
# 18: the failover slot carries pgmesh over to the promoted standby


async def standby_mesh(mesh: MeshFactory) -> tuple[Mesh, Any, Any, Any]:
    """a (default version) and b (18), b's standby (18) streaming and syncing pgmesh's failover slot,
    listed in b's synchronized_standby_slots and synchronous_standby_names; init's report along the way."""
    m: Mesh = await mesh(nodes=2, schema=SCHEMA, versions=[None, 18, 18], spares=["b_std"],
                         replication=REPLICATION)
    a, b = m.nodes
    standby = m.spares[0]
    assert await fetch(b.dsn(), "SELECT failover FROM pg_replication_slots WHERE slot_name = %s",
                       [m.config.slot_name]) == [(True,)], "init creates the 18 node's slot with failover"
    make_standby(b, standby, sync_slots=True)
    await wait_for(lambda: streaming(b), "the standby to stream from b", LIMIT_S)
    # init's report: the standby is seen, and warned about until its slot is synchronized
    failover = [c for c in (await check_cluster(m.config)).checks if c.check == "failover"]
    assert [(c.node, c.ok, c.warn) for c in failover] == [("b", True, True)], failover
    assert f"synchronized_standby_slots does not name {STANDBY_SLOT}" in failover[0].detail
    await execute(b.dsn(), f"ALTER SYSTEM SET synchronized_standby_slots = '{STANDBY_SLOT}'",
                  f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_APP}'", "SELECT pg_reload_conf()")
    await wait_for(lambda: _setting_is(b, "synchronized_standby_slots", STANDBY_SLOT), "the reload", 30)
    failover = [c for c in (await check_cluster(m.config)).checks if c.check == "failover"]
    assert [(c.node, c.ok, c.warn) for c in failover] == [("b", True, False)], failover
    return m, a, b, standby


async def fail_over(m: Mesh, a: Any, b: Any, standby: Any, *, standby_behind: bool) -> tuple[Writer, Writer]:
    """Writes on a and b under a running router; b crashes (the router still running) and its standby is
    promoted; the router is started again over it (b's address changed in the config) and writes go on.
    `standby_behind`: b's standby is stopped a while before the crash (b's own writes stopped first: with
    synchronous_standby_names they would wait for it) while the router goes on applying a's rows into b,
    so the standby lacks some of a's rows that b had flushed."""
    slot = m.config.slot_name
    on_a, on_b = Writer("a"), Writer("b")
    a_task = asyncio.create_task(on_a.run(a.dsn()))
    b_task = asyncio.create_task(on_b.run(b.dsn()))
    try:
        async with running_router(m.config):
            await wait_for(lambda: synced(standby, slot), "the standby's copy of the slot synced", LIMIT_S)
            await wait_for(lambda: has_rows(b, on_a, 50), "a's rows on b", LIMIT_S)
            await wait_for(lambda: has_rows(a, on_b, 50), "b's rows on a", LIMIT_S)
            if standby_behind:
                on_b.stop.set()
                await asyncio.wait_for(b_task, LIMIT_S)
                flushed = (await fetch(b.dsn(), "SELECT pg_current_wal_flush_lsn()::text"))[0][0]
                await wait_for(lambda: replayed(standby, flushed), f"the standby to replay b to {flushed}",
                               LIMIT_S)
                standby.stop("fast")
                written = len(on_a.acked)
                await wait_for(lambda: has_rows(b, on_a, written + 50), "a's rows on b, not on its standby",
                               LIMIT_S)
            else:
                before = len(on_b.acked)
                await wait_for(lambda: len(on_b.acked) > before + 20, "b's writer to go on", LIMIT_S)
            b.stop("immediate")  # the crash, with the router running
            await asyncio.wait_for(b_task, LIMIT_S)
        if standby_behind:
            standby.start()
        await promote(standby)
        config = parse_config(m.config_text([a, Renamed("b", standby)]))
        on_b.stop.clear()
        b_task = asyncio.create_task(on_b.run(standby.dsn()))
        async with running_router(config) as router:
            written_a, written_b = len(on_a.acked), len(on_b.acked)
            await wait_for(lambda: has_rows(standby, on_a, written_a + 50), "a's new rows on the standby",
                           LIMIT_S)
            await wait_for(lambda: has_rows(a, on_b, written_b + 50), "the promoted standby's rows on a",
                           LIMIT_S)
            on_a.stop.set()
            on_b.stop.set()
            await asyncio.wait_for(asyncio.gather(a_task, b_task), LIMIT_S)
            await wait_converged([a, standby], ["writes"], limit=LIMIT_S)
            source = router.pumps["b"].source
            assert source.last_error is None, source.last_error
    finally:
        on_a.stop.set()
        on_b.stop.set()
        await asyncio.gather(a_task, b_task, return_exceptions=True)
    return on_a, on_b


async def assert_each_write_once(nodes: Sequence[Any], on_a: Writer, on_b: Writer) -> None:
    """Every acknowledged write on every node, nothing else but b's one write in flight at the crash,
    each arrived once (no transaction applied twice, no conflict from one sent again)."""
    logger.info("failover: a wrote %d rows, b and its promoted standby %d (%d unsure at the crash)",
                len(on_a.acked), len(on_b.acked), len(on_b.unsure))
    assert on_a.unsure == [], "a never went away"
    assert len(on_b.unsure) <= 1, on_b.unsure
    wrote = set(on_a.acked) | set(on_b.acked)
    for node in nodes:
        found = {key for (key,) in await keys(node)}
        assert wrote <= found, f"lost on {node.name}: {sorted(wrote - found)[:10]}"
        assert found - wrote <= set(on_b.unsure), f"not written, on {node.name}: {sorted(found - wrote)[:10]}"
        twice = await fetch(node.dsn(), 'SELECT "key" FROM "arrivals" GROUP BY 1 HAVING count(*) > 1')
        assert twice == [], f"applied twice on {node.name}: {twice[:10]}"
        arrived = await fetch(node.dsn(), 'SELECT count(*) FROM "arrivals"')
        assert arrived == [(len(found),)], node.name
        conflicts = await fetch(node.dsn(), "SELECT count(*) FROM pgmesh.conflict_history")
        assert conflicts == [(0,)], f"a transaction sent again met its own rows on {node.name}"


async def test_failover_of_an_18_node_to_its_standby_under_writes(mesh: MeshFactory) -> None:
    """An unplanned crash of b with the router running and writes on both nodes; the standby streaming."""
    m, a, b, standby = await standby_mesh(mesh)
    on_a, on_b = await fail_over(m, a, b, standby, standby_behind=False)
    await assert_each_write_once([a, standby], on_a, on_b)


async def test_failover_to_a_standby_that_was_behind_loses_none_of_the_other_nodes_rows(
    mesh: MeshFactory,
) -> None:
    """b's standby misses a's rows b had applied and flushed: a's slot was never confirmed past what the
    standby had (router.service.monitor.StandbyGate), so the router sends them again to the promoted
    standby."""
    m, a, b, standby = await standby_mesh(mesh)
    on_a, on_b = await fail_over(m, a, b, standby, standby_behind=True)
    assert on_b.unsure == []  # b's writer had stopped before the crash
    await assert_each_write_once([a, standby], on_a, on_b)


async def _setting_is(node: Any, name: str, value: str) -> bool:
    return await fetch(node.dsn(), "SELECT current_setting(%s)", [name]) == [(value,)]


# ---------------------------------------------------------------------------------------------------------
# 15: no slot on the promoted standby; the router says so, and what to do


async def test_a_promoted_15_standby_has_no_slot_and_the_router_says_to_rejoin(mesh: MeshFactory) -> None:
    m: Mesh = await mesh(nodes=2, schema=SCHEMA, versions=[15, 15, 15], spares=["b_std"],
                         replication=REPLICATION)
    a, b = m.nodes
    standby = m.spares[0]
    make_standby(b, standby, sync_slots=False)
    await wait_for(lambda: streaming(b), "the standby to stream from b", LIMIT_S)
    failover = [c for c in (await check_cluster(m.config)).checks if c.check == "failover"]
    assert [(c.node, c.ok, c.warn) for c in failover] == [("b", True, True)], failover
    assert "pgmesh join" in (failover[0].hint or "")

    b.stop("immediate")
    await promote(standby)
    config = parse_config(m.config_text([a, Renamed("b", standby)]))
    async with running_router(config) as router:
        source = router.pumps["b"].source
        await wait_for(lambda: source.last_error is not None, "the source of b to fail", LIMIT_S)
    error = str(source.last_error)
    assert "node b" in error and "SQLSTATE 42704" in error and m.config.slot_name in error, error
    assert "pgmesh join" in error and "docs/join.md" in error, error
