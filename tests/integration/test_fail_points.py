"""Races found by luck, made deterministic through the router's fail points (router.failpoints).

Each test arms a named point inside the router's code, drives the exact interleaving the old test waited
to happen by chance, and asserts what that test asserted:
- `apply.before_commit`: the origin's set-up sent and the COMMIT not yet, when the session is ended (on
  PostgreSQL 16+ the rollback moves the origin: router.progress.applied) or the commit fails;
- `apply.batch_sent`: the router killed with a batch in the target's hands (a router run as a
  subprocess, armed by PGMESH_FAILPOINTS);
- `log.segment_switch`: the router killed inside the router log's segment switch while a down node's
  links rely on the log;
- `join.after_snapshot`: writes and DDL between a join's snapshot and the copy (the new node's stream
  starts from the snapshot's positions).
- `source.spilling`: the source stopped in the middle of a large transaction it handed out early, until
  b's link has begun applying it: then a's walsender is terminated (the transaction lost before its
  commit), or the rest arrives, DDL among it, while the link applies.
No fixed sleeps: every wait is a bounded poll or a bounded wait for the point.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from protocol.lsn import parse_lsn
from router import failpoints
from router.apply import parts
from router.ops.join import join_node
from router.testing.mesh import (
    NODE_SETTINGS,
    config_text,
    converged,
    execute,
    fetch,
    free_port,
    running_router,
    wait_converged,
    wait_for,
)
from tests.fix_mesh import MeshFactory

PROGRESS = "SELECT pg_catalog.pg_replication_origin_progress(%s, false)::text"
HAS_NOTE = "SELECT count(*) FROM information_schema.columns WHERE table_name = 'kv' AND column_name = 'note'"


@pytest.fixture(autouse=True)
async def disarmed() -> AsyncIterator[None]:
    """Every point unarmed before and after each test (a stalled point let go: nothing waits for ever)."""
    failpoints.disarm()
    yield
    for armed in failpoints.ARMED.values():
        if armed.go is not None:
            armed.go.set()
    failpoints.disarm()


def start_router(config_path: Path, log: Path, armed: str = "") -> subprocess.Popen[bytes]:
    """`pgmesh run` as a subprocess; `armed`: its fail points (router.failpoints, PGMESH_FAILPOINTS)."""
    env = {k: v for k, v in os.environ.items() if k != failpoints.ENV}
    if armed:
        env[failpoints.ENV] = armed
        env[failpoints.TESTING_ENV] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "router", "--log-level", "INFO", "run", "--config", str(config_path)],
        stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True, env=env,
    )


async def killed_by_its_fail_point(router: subprocess.Popen[bytes], log: Path, point: str) -> None:
    """The router ended itself at `point` (as SIGKILL would), within two minutes."""
    code = await asyncio.to_thread(router.wait, 120)
    text = read(log)
    assert code == 137, f"the router ended with {code}, not at its fail point:\n{text[-3000:]}"
    assert f"fail point {point} fired" in text


def read(path: Path) -> str:
    return path.read_text()


def segment_sizes(directory: str) -> dict[Path, int]:
    """Every router log segment under `directory` (each source's), and its size."""
    return {path: path.stat().st_size for path in Path(directory).rglob("*.seg")}


def stop_router(router: subprocess.Popen[bytes]) -> None:
    if router.poll() is None:
        os.killpg(router.pid, signal.SIGTERM)
        router.wait(60)


# ------------------------------------------------------------------ apply.before_commit

KV = "CREATE TABLE kv (id bigint PRIMARY KEY, v text NOT NULL);"


async def gone(dsn: str, pid: int) -> bool:
    return not await fetch(dsn, f"SELECT 1 FROM pg_catalog.pg_stat_activity WHERE pid = {pid}")


async def test_a_session_ended_between_the_routers_setup_and_commit_leaves_the_transaction_to_apply(
    mesh: MeshFactory,
) -> None:
    """Replaces the luck by which CI caught the PostgreSQL 16+ rollback-after-origin-set-up race (1 run in
    5-10 of test_resilience's SIGKILL test, now test_a_router_killed_with_a_batch_in_the_targets_hands):
    the router's own careful path (a replicated DDL command) stops after its set-up statement, the test
    ends the session there (as a fast shutdown or `pg_terminate_backend` would), and the transaction is
    still applied. The same assertions as test_applied_mark's hand-built session, which is kept: it
    runs the batch path's set-up statement, where no fail point can sit between set-up and COMMIT."""
    m = await mesh(nodes=2, schema=KV)
    a, b = m.nodes
    origin = m.config.origin_name("a")
    go = asyncio.Event()
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO kv VALUES (1, 'from a')")
        await wait_converged(m.nodes, ["kv"], 60)
        (row,) = await fetch(a.dsn(), "SELECT pg_catalog.pg_current_wal_lsn()::text")
        before = parse_lsn(str(row[0]))  # past the insert: where b's origin is now, at most
        armed = failpoints.arm("apply.before_commit", stall=go)
        await execute(a.dsn(), "ALTER TABLE kv ADD COLUMN note text")  # applied the careful way
        await armed.wait_reached(60)
        conn = router.appliers[("a", "b")].link.conn
        assert conn is not None
        pid = conn.get_server_pid()
        major = conn.get_server_version().major
        await execute(b.dsn(), f"SELECT pg_catalog.pg_terminate_backend({pid})")  # before COMMIT
        await wait_for(lambda: gone(b.dsn(), pid), "the terminated session to end", 30)
        (progress,) = await fetch(b.dsn(), PROGRESS, [origin])
        if major >= 16:  # what the mark is for: the rollback moved the origin past a's transaction
            assert progress[0] is not None and parse_lsn(progress[0]) > before
        assert await fetch(b.dsn(), HAS_NOTE) == [(0,)]  # not applied
        go.set()
        await wait_converged(m.nodes, ["kv"], 60)
        await wait_for(lambda: _one(fetch(b.dsn(), HAS_NOTE)), "the DDL on b", 60)
        assert await fetch(b.dsn(), "SELECT id, v FROM kv") == [(1, "from a")]
        await execute(a.dsn(), "INSERT INTO kv VALUES (2, 'later', 'n')")  # past where the rollback left it
        await wait_converged(m.nodes, ["kv"], 60)
    assert armed.hits >= 2  # stalled once, then passed when the link applied it again


async def test_a_commit_that_fails_after_the_setup_is_retried_and_applied_once(mesh: MeshFactory) -> None:
    """The third way a 16+ session rolls back after its set-up (router.progress.applied): an error at
    COMMIT. The fail point raises there (a lost connection); the link rolls back, retries, and applies the
    transaction once; the origin never names it before it committed."""
    m = await mesh(nodes=2, schema=KV)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO kv VALUES (1, 'from a')")
        await wait_converged(m.nodes, ["kv"], 60)
        applier = router.appliers[("a", "b")]
        retries = applier.stats.retries
        armed = failpoints.arm("apply.before_commit", error=failpoints.FAILED)
        await execute(a.dsn(), "ALTER TABLE kv ADD COLUMN note text")
        await wait_for(lambda: armed.hits >= 2, "the link to apply the DDL again after the failure", 60)
        await wait_for(lambda: _one(fetch(b.dsn(), HAS_NOTE)), "the DDL on b", 60)
        assert applier.stats.retries > retries
        await execute(a.dsn(), "INSERT INTO kv VALUES (2, 'later', 'n')")
        await wait_converged(m.nodes, ["kv"], 60)
    rows = await fetch(b.dsn(), "SELECT id, v, note FROM kv ORDER BY id")
    assert rows == [(1, "from a", None), (2, "later", "n")]


async def _one(rows: Any) -> bool:
    found = await rows
    return bool(found and found[0][0])


# ------------------------------------------------------------------ apply.batch_sent

MIXED = """
CREATE TABLE kv (id bigint PRIMARY KEY, v int NOT NULL, note text);
CREATE TABLE log (src text, seq int, payload text);
ALTER TABLE log REPLICA IDENTITY FULL;
"""


async def writes(node: Any, base: int, count: int) -> None:
    """`count` source transactions, one per statement pair, into both tables."""
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        for i in range(count):
            if i % 2:
                await conn.execute("INSERT INTO log VALUES (%s, %s, 'x')", [node.name, i])
            else:
                await conn.execute("INSERT INTO kv VALUES (%s, %s, NULL)", [base + i, i])


async def test_a_router_killed_with_a_batch_in_the_targets_hands_loses_and_repeats_nothing(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    """Replaces test_resilience's test_sigkill_mid_stream_then_restart, which killed the router when b
    happened to hold 600 of a's rows, wherever its appliers were then (the 16+ rollback-after-set-up race
    showed there 1 run in 5-10): here the router kills itself right after sending its 21st batch, before
    reading the result, while both nodes write. Restarted, every row is there exactly once (the keyless
    `log` table would show a batch applied twice)."""
    m = await mesh(nodes=2, schema=MIXED)
    nodes = m.nodes
    config_path = tmp_path / "config.toml"
    config_path.write_text(config_text(nodes))
    log = tmp_path / "router.log"
    a, b = nodes
    router = start_router(config_path, log, armed="apply.batch_sent=kill@20")
    try:
        writers = asyncio.gather(writes(a, 1_000_000, 5000), writes(b, 2_000_000, 5000))
        await killed_by_its_fail_point(router, log, "apply.batch_sent")
        await writers
        router = start_router(config_path, log)
        await wait_converged(nodes, ["kv", "log"], 180)
    finally:
        stop_router(router)
    for node in nodes:
        query = "SELECT src, count(*), count(DISTINCT seq) FROM log GROUP BY src ORDER BY src"
        rows = await fetch(node.dsn(), query)
        assert rows == [("a", 2500, 2500), ("b", 2500, 2500)], f"node {node.name}: {rows}"
        (kv,) = await fetch(node.dsn(), "SELECT count(*) FROM kv")
        assert kv[0] == 5000


# ------------------------------------------------------------------ log.segment_switch

DOC = """CREATE TABLE doc (id bigint PRIMARY KEY, src text NOT NULL, body text NOT NULL);
ALTER TABLE doc ALTER body SET STORAGE EXTERNAL;"""  # never compressed: the WAL is as big as the rows
FILLER = "x" * 2000
INSERT = "INSERT INTO doc SELECT g, %s, %s || g FROM generate_series(%s::bigint, %s::bigint) g"
COUNTS = "SELECT src, count(*), count(DISTINCT id) FROM doc GROUP BY src ORDER BY 1"


async def write(node: Any, first: int, transactions: int, rows: int = 20) -> None:
    """`transactions` transactions of `rows` rows of about 2 kB each (ids from `first`)."""
    for t in range(transactions):
        base = first + t * rows
        await execute(node.dsn(), INSERT, params=[node.name, FILLER, base, base + rows - 1])


async def wal_lsn(node: Any) -> int:
    (row,) = await fetch(node.dsn(), "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
    return int(row[0])


async def check_rows(nodes: list[Any], expected: dict[str, int]) -> None:
    for node in nodes:
        rows = await fetch(node.dsn(), COUNTS)
        assert rows == [(src, n, n) for src, n in sorted(expected.items())], f"node {node.name}: {rows}"


async def test_a_router_killed_in_a_segment_switch_while_links_read_the_log_goes_on_from_it(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    """Replaces test_router_log's test_a_router_killed_while_links_read_the_log_goes_on_from_it, which
    sent SIGKILL at whatever the router was doing once a's slot was confirmed past what c has. Here the
    router is stopped there, started again armed, and kills itself inside the log's next segment switch
    (the new segment created, its header not written) while c is down and its links rely on the log:
    restarted, the router finds the log (the empty segment dropped), starts the sources after it, and c
    gets every row once it is back."""
    m = await mesh(nodes=3, schema=DOC, replication="queue_max_transactions = 50",
                   extra="[log]\nsegment_mb = 1\n")
    a, b, c = m.nodes
    config_path = m.write_config(tmp_path / "config.toml")
    router_log = tmp_path / "router.log"
    router = start_router(config_path, router_log)
    try:
        await write(a, 1, 3)
        await wait_converged(m.nodes, ["doc"], 120)
        c.stop("fast")
        await asyncio.gather(write(a, 1_000_000, 200), write(b, 2_000_000, 200))

        async def confirmed_past_c() -> bool:  # c's links rely on the log: the slots went past them
            rows = await fetch(a.dsn(), "SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots"
                               " WHERE slot_name = %s", params=[m.config.slot_name])
            return int(rows[0][0]) >= await wal_lsn(a) - (2 << 20)

        await wait_for(confirmed_past_c, "a's slot to be confirmed past what c has", 90)
        stop_router(router)
        segments = segment_sizes(m.log_dir)
        router = start_router(config_path, router_log, armed="log.segment_switch=kill")
        await write(a, 3_000_000, 60)  # 2.4 MB: past the segment a's log writes to
        await killed_by_its_fail_point(router, router_log, "log.segment_switch")
        new = {p: size for p, size in segment_sizes(m.log_dir).items() if p not in segments}
        assert list(new.values()) == [0], new  # killed inside the switch: created, nothing written in it
        await write(a, 4_000_000, 20)
        router = start_router(config_path, router_log)
        c.start()
        await wait_converged(m.nodes, ["doc"], 240)
    finally:
        stop_router(router)
    await check_rows(m.nodes, {"a": 3 * 20 + 200 * 20 + 60 * 20 + 20 * 20, "b": 200 * 20})


# ------------------------------------------------------------------ join.after_snapshot

JOIN_ROWS = 20_000
JOIN_SCHEMA = """
CREATE TABLE big (id bigint PRIMARY KEY, a int NOT NULL, b text);
CREATE TABLE acct (id int PRIMARY KEY, v int NOT NULL, who text);
""" + f"INSERT INTO big SELECT g, g % 1000, md5(g::text) FROM generate_series(1, {JOIN_ROWS}) g;"


@pytest.mark.slow  # the copy starts Spark (a JVM)
async def test_writes_between_the_joins_snapshot_and_its_copy_reach_the_new_node_once(
    mesh: MeshFactory,
) -> None:
    """Added beside test_join's test_join_a_fourth_node_under_writes_then_part_it (kept: the join and the
    part under steady writes), where b's ALTER TABLE and the writers' rows land anywhere around the join's
    snapshot by chance: here the join stops right after its snapshot and positions are taken (the router
    released), the donor and another node write and b changes the table, the existing nodes converge,
    then the join copies. d gets the snapshot's rows from the copy and everything after it from the
    stream, each once, with the column b added."""
    m = await mesh(nodes=3, schema=JOIN_SCHEMA, spares=["d"], admin_port=free_port())
    nodes = m.all_nodes
    a, b, _, d = nodes
    four = m.config_for(nodes)
    go = asyncio.Event()
    armed = failpoints.arm("join.after_snapshot", stall=go)
    async with running_router(m.config, reload=lambda: four) as router:
        await execute(a.dsn(), "INSERT INTO acct SELECT g, 0, 'a' FROM generate_series(1, 100) g")
        join = asyncio.create_task(join_node(four, "d", donor="a"))
        try:
            reached = asyncio.create_task(armed.wait_reached(180))
            await asyncio.wait({join, reached}, return_when=asyncio.FIRST_COMPLETED)
            assert not join.done(), join.result()  # (raises the join's error, if it failed first)
            await reached
            await execute(a.dsn(), "INSERT INTO acct SELECT g, 0, 'a' FROM generate_series(101, 200) g")
            await execute(b.dsn(), "INSERT INTO acct SELECT g, 0, 'b' FROM generate_series(1001, 1100) g")
            await execute(a.dsn(), "UPDATE acct SET v = v + 1 WHERE id <= 150")
            await execute(b.dsn(), "ALTER TABLE acct ADD COLUMN note text DEFAULT 'n'")
            await execute(a.dsn(), "UPDATE big SET a = a + 1 WHERE id <= 10")
            await wait_converged(m.nodes, ["big", "acct"], 120)  # the others stream while the join waits
            go.set()
            report = await asyncio.wait_for(join, 600)
        finally:
            go.set()
            if not join.done():
                join.cancel()
        assert report.rows >= JOIN_ROWS and report.positions.keys() == {"a", "b", "c"}
        await wait_for(lambda: router.running and ("d", "a") in router.appliers, "the router with d", 120)
        await execute(d.dsn(), "INSERT INTO acct (id, v, who) VALUES (5000, 1, 'd')")
        await wait_converged(nodes, ["big", "acct"], 240)
        links = {(link.source, link.target): link.state for link in router.status().links}
        assert len(links) == 12 and set(links.values()) == {"streaming"}, links
    for node in nodes:
        assert await fetch(node.dsn(), "SELECT count(*) FROM big") == [(JOIN_ROWS,)]
        counts = await fetch(node.dsn(), "SELECT count(*), count(DISTINCT id), count(note), sum(v) FROM acct")
        assert counts == [(301, 301, 301, 151)], (node.name, counts)
        bumped = await fetch(node.dsn(), "SELECT sum(a - id % 1000) FROM big WHERE id <= 10")
        assert bumped == [(10,)], (node.name, bumped)


# ------------------------------------------------------------------ source.spilling

BIG = "CREATE TABLE big (id int PRIMARY KEY, v text);"
# The server must not stream these transactions in progress: decoded after their commit, whole.
WHOLE = {**NODE_SETTINGS, "logical_decoding_work_mem": "1GB"}
WALSENDERS = "SELECT pid FROM pg_catalog.pg_stat_replication WHERE application_name LIKE 'pgmesh%'"


async def test_a_transaction_lost_by_the_source_after_its_early_hand_out_is_applied_once(
    mesh: MeshFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replaces test_early_apply's test_transaction_lost_before_its_commit_is_applied_once, which
    terminated a's walsender once a -> b had started on a 600,000-row transaction and skipped itself when
    the commit had already arrived by then (nothing lost, nothing tested). Here the source stops reading in
    the middle of the transaction, after handing it out at its first spill; b's link applies a first part
    of it (parts of 5,000 changes, so that one is in the file by then), a's walsender is terminated, and
    the source reads on: it loses the transaction before its commit, the link rolls back what it had
    applied of it, and applies the resent one once."""
    monkeypatch.setattr(parts, "LARGE_PART_CHANGES", 5000)
    m = await mesh(nodes=2, schema=BIG, settings=WHOLE, replication="spill_mb = 1")
    nodes, config = m.nodes, m.config
    a, b = nodes
    go = asyncio.Event()
    async with running_router(config) as router:
        applier = router.appliers[("a", "b")]
        armed = failpoints.arm("source.spilling", stall=go)
        await execute(a.dsn(), "INSERT INTO big SELECT i, 'row ' || i FROM generate_series(1, 600000) AS i")
        await armed.wait_reached(120)
        started = "a -> b to start on the big transaction"
        await wait_for(lambda: applier.stats.early_transactions >= 1, started, limit=120)
        pids = [pid for (pid,) in await fetch(a.dsn(), WALSENDERS)]
        assert pids
        for pid in pids:
            await execute(a.dsn(), f"SELECT pg_catalog.pg_terminate_backend({pid})")
            await wait_for(lambda pid=pid: gone(a.dsn(), pid), "the terminated walsender to end", 30)
        go.set()
        await wait_converged(nodes, ["big"], limit=300)
        assert applier.stats.abandoned_transactions >= 1
        await wait_for(lambda: router.spool.files == 0, "the spool files to go")
    (row,) = await fetch(b.dsn(), "SELECT count(*), count(DISTINCT id) FROM big")
    assert row == (600000, 600000)


LARGE = """
CREATE TABLE big (id int PRIMARY KEY, v text);
CREATE TABLE plain (id int PRIMARY KEY, v text);
CREATE TABLE marked (id int PRIMARY KEY, v text);
"""


async def wait_equal(nodes: list[Any], tables: list[str], limit: float) -> None:
    """`wait_converged`, where a table may not exist yet on some node."""

    async def check() -> bool:
        try:
            return await converged(nodes, tables)
        except psycopg.errors.UndefinedTable:
            return False

    await wait_for(check, "all nodes to hold identical rows", limit)


async def begun_before_its_commit(armed: failpoints.Armed, go: asyncio.Event, applier: Any) -> None:
    """The source stopped in the middle of a transaction it handed out early: once the link has begun
    applying it (the commit not read yet), the source reads on."""
    await armed.wait_reached(120)
    started = "the link to begin the transaction before its commit"
    await wait_for(lambda: applier.stats.early_transactions >= 1, started, limit=120)
    go.set()


async def test_ddl_inside_a_large_transaction_is_run_in_place_while_it_still_arrives(
    mesh: MeshFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replaces test_large_transactions' test_ddl_inside_a_large_transaction, which made parts small so
    that some would go in before the commit arrived, and passed as well when the link began after it.
    Here the source stops reading in the middle of each transaction (its first spill handed out: the
    ALTER TABLE and about 4,700 rows in the file) until b's link has begun applying it, the ALTER run in
    place; the rest, a CREATE TABLE among it, arrives while the link applies. The second time one of its
    rows meets a key b holds: the DDL done so far is rolled back with it, and the whole transaction is
    decided on the careful path."""
    monkeypatch.setattr(parts, "LARGE_PART_CHANGES", 1000)  # parts go in before the commit
    m = await mesh(nodes=2, schema=LARGE, settings=WHOLE, replication="spill_mb = 1")
    nodes, config = m.nodes, m.config
    a, b = nodes
    tables = ["big", "plain", "later1", "later2"]

    def transaction(n: int, first: int) -> list[str]:
        """Rows from `first` on; column w<n> and table later<n> made inside it. ~220 bytes a row: the
        1 MB bound is passed after ~4,700 rows."""
        w, later = f"w{n}", f"later{n}"
        return [
            "BEGIN",
            f'ALTER TABLE "big" ADD COLUMN "{w}" integer DEFAULT 1',
            f'INSERT INTO "big" ("id", "v", "{w}") SELECT i, repeat(\'x\', 200) || i, i'
            f" FROM generate_series({first}, {first + 5999}) AS i",
            f'CREATE TABLE "{later}" ("id" integer PRIMARY KEY, "v" text)',
            f"INSERT INTO \"{later}\" SELECT i, repeat('y', 200) FROM generate_series(1, 3000) AS i",
            f'ALTER TABLE "plain" ADD COLUMN "{w}" integer',
            f'INSERT INTO "plain" ("id", "v", "{w}") SELECT i, \'a\', i'
            f" FROM generate_series({first}, {first + 2999}) AS i",
            "COMMIT",
        ]

    go = asyncio.Event()
    armed = failpoints.arm("source.spilling", stall=go)
    async with running_router(config) as router:
        await execute(a.dsn(), *transaction(1, 1))
        await begun_before_its_commit(armed, go, router.appliers[("a", "b")])
        await wait_equal(nodes, tables[:3], limit=240)
        applier = router.appliers[("a", "b")]
        assert applier.last_error is None and applier.stats.ddl_applied == 1 and applier.stats.conflicts == 0
        assert router.pumps["a"].source.stats.early_transactions == 1
    (row,) = await fetch(b.dsn(), "SELECT count(*), sum(w1) FROM big")
    assert row == (6000, sum(range(1, 6001)))
    # the same shape again, where B holds one key of the rows after the DDL: decided the careful way
    await execute(b.dsn(), "INSERT INTO plain VALUES (12500, 'b')")
    await execute(a.dsn(), *transaction(2, 10001))
    go = asyncio.Event()
    armed = failpoints.arm("source.spilling", stall=go)
    async with running_router(config) as router:
        await begun_before_its_commit(armed, go, router.appliers[("a", "b")])
        await wait_equal(nodes, tables, limit=240)
        applier = router.appliers[("a", "b")]
        # (the schema drift watch may still hold its view from while the DDL was half applied: next check)
        await wait_for(lambda: applier.last_error is None, "the link to run without an error", 60)
        assert applier.stats.conflicts >= 1
        await wait_for(lambda: router.spool.files == 0, "the spool file to go")
    (row,) = await fetch(b.dsn(), "SELECT count(*), max(v) FILTER (WHERE id = 12500), sum(w2) FROM plain")
    assert row == (6000, "a", sum(range(10001, 13001)))  # A's insert committed later: last update wins
