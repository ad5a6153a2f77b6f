"""`pgmesh join` as users run it: the router running as a process, the new node added to its config.toml,
`pgmesh join` from the command line. After `pgmesh sequences convert` (the docs recommend converting
before nodes join); a join that fails (a role the schema needs is missing on the new node) and leaves
no pins behind; a join while the application truncates tables every ~2 s; a join from Debian's current
PostgreSQL 15 (15.20: every column carries an attribute option an 18 server refuses) into an 18 node.
Each ends with every table (keyless ones as multisets) and every schema identical on every node.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import psycopg
import pytest

from router.testing.mesh import fetch, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.real_use.users import RouterProcess, pgmesh, psql, wait_identical

slow = pytest.mark.slow  # each join copies with Spark (a JVM)

SCHEMA = """
CREATE TABLE acct (id bigserial PRIMARY KEY, owner text NOT NULL, balance int NOT NULL DEFAULT 0);
CREATE TABLE events (id bigint NOT NULL, what text);
"""
SYNC = '[sync]\nspark_master = "local[2]"\n'


def _status(config: Path) -> dict[str, Any]:
    done = pgmesh(config, "status", "--json", check=True)
    status: dict[str, Any] = json.loads(done.stdout)
    return status


def _streaming(config: Path, nodes: int) -> bool:
    links = _status(config)["links"]
    return len(links) == nodes * (nodes - 1) and all(lk["state"] == "streaming" for lk in links)


async def _router(tmp_path: Path, made: Any) -> tuple[RouterProcess, Path]:
    """`pgmesh run` over the members, streaming; its config file."""
    router = RouterProcess(tmp_path, made)
    router.start(made.nodes)
    config = tmp_path / "r.toml"
    await wait_for(lambda: _streaming(config, len(made.nodes)), "every link streaming", 60)
    return router, config


def _add_node(config: Path, node: Any, extra: str = "") -> None:
    """What a user does before `pgmesh join`: the new node's [[nodes]] entry in config.toml."""
    text = config.read_text()
    entry = f'[[nodes]]\nname = "{node.name}"\ndsn = "{node.dsn()}"\n\n'
    config.write_text(text.replace("[replication]", entry + "[replication]", 1) + extra)


async def _pins(nodes: list[Any]) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    for node in nodes:
        if await fetch(node.dsn(), "SELECT to_regclass('pgmesh.joining') IS NOT NULL") == [(True,)]:
            rows += await fetch(node.dsn(), "SELECT %s, node, pin::text FROM pgmesh.joining", [node.name])
    return rows


@slow
async def test_join_after_sequences_convert(mesh: MeshFactory, tmp_path: Path) -> None:
    """docs/sequences.md: convert before nodes join. The join restores column defaults that call
    pgmesh.snowflake_nextval once pgmesh is installed on the new node; the new node inserts with its own
    node id; a key added later to a table init made REPLICA IDENTITY FULL makes it DEFAULT again on the
    joined node too; join says the running router took the node in."""
    made = await mesh(nodes=2, schema=SCHEMA, spares=["c"])
    a, b, c = made.all_nodes
    psql(a, "INSERT INTO acct (owner) SELECT 'a' FROM generate_series(1, 200);"
            " INSERT INTO events SELECT g, 'seed' FROM generate_series(1, 100) g")
    router, config = await _router(tmp_path, made)
    try:
        await wait_identical(made.nodes)
        pgmesh(config, "sequences", "convert", check=True)
        for node in made.nodes:
            psql(node, f"INSERT INTO acct (owner) SELECT '{node.name}' FROM generate_series(1, 50)")
        _add_node(config, c, SYNC)
        joined = pgmesh(config, "join", "c")
        assert joined.returncode == 0, joined.stdout + joined.stderr
        assert "the running router has taken node c in" in joined.stdout, joined.stdout
        assert "start `pgmesh run`" not in joined.stdout, joined.stdout
        default = psql(c, "SELECT pg_get_expr(adbin, adrelid) FROM pg_attrdef"
                          " WHERE adrelid = 'acct'::regclass AND adnum = 1")
        assert "pgmesh.snowflake_nextval" in default.stdout, default.stdout
        await wait_for(lambda: _streaming(config, 3), "every link of three nodes streaming", 120)
        psql(c, "INSERT INTO acct (owner) SELECT 'c' FROM generate_series(1, 50)")
        psql(c, "INSERT INTO events VALUES (101, 'from c')")
        done = pgmesh(config, "ddl", "--wait", "ALTER TABLE events ADD PRIMARY KEY (id)")
        assert done.returncode == 0, done.stdout + done.stderr
        await wait_identical([a, b, c])
        for node in (a, b, c):
            ident = await fetch(node.dsn(), "SELECT relreplident::text FROM pg_class WHERE relname = %s",
                                ["events"])
            assert ident == [("d",)], (node.name, ident)
        assert await fetch(c.dsn(), "SELECT count(*) FROM acct WHERE owner = 'c'") == [(50,)]
        assert await _pins([a, b, c]) == []
    finally:
        await router.stop()


@slow
async def test_a_failed_join_leaves_no_pins_and_the_next_one_completes(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    """The schema names a role the new node lacks (roles are per server, never replicated): the restore
    fails and join exits non-zero, naming it. Its pins, which would keep WAL on every member until
    `pgmesh part`, are gone. Once the role exists, the join completes."""
    schema = SCHEMA + "CREATE ROLE app_owner; ALTER TABLE acct OWNER TO app_owner;"
    made = await mesh(nodes=2, schema=schema, spares=["c"])
    a, b, c = made.all_nodes
    psql(b, "INSERT INTO acct (owner) SELECT 'b' FROM generate_series(1, 100)")
    router, config = await _router(tmp_path, made)
    try:
        _add_node(config, c, SYNC)
        failed = pgmesh(config, "join", "c")
        assert failed.returncode != 0, failed.stdout
        assert 'role "app_owner" does not exist' in failed.stderr, failed.stderr
        assert await _pins([a, b]) == []
        psql(a, "INSERT INTO acct (id, owner) VALUES (100001, 'a after the failed join')")
        psql(c, "CREATE ROLE app_owner")
        joined = pgmesh(config, "join", "c")
        assert joined.returncode == 0, joined.stdout + joined.stderr
        await wait_for(lambda: _streaming(config, 3), "every link of three nodes streaming", 120)
        psql(c, "INSERT INTO acct (id, owner) VALUES (200001, 'c')")
        await wait_identical([a, b, c])
        assert await _pins([a, b, c]) == []
    finally:
        await router.stop()


STAGING = """
CREATE TABLE big (id bigint PRIMARY KEY, pad text);
CREATE TABLE stage1 (id bigint PRIMARY KEY, batch int NOT NULL, note text);
CREATE TABLE stage2 (id bigint PRIMARY KEY, batch int NOT NULL, note text);
CREATE TABLE stage3 (id bigint PRIMARY KEY, batch int NOT NULL, note text);
"""


async def _staging_writer(node: Any, table: str, stop: asyncio.Event) -> int:
    """An application's staging table: emptied every ~2 s, filled in between (rows of this node only:
    a TRUNCATE is ordered against its own node's writes)."""
    batches = 0
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        while not stop.is_set() or batches < 2:
            batches += 1
            await conn.execute(f"TRUNCATE {table}")
            for i in range(20):
                row = [batches * 1000 + i, batches]
                await conn.execute(f"INSERT INTO {table} VALUES (%s, %s, 'row')", row)
                await asyncio.sleep(0.1)
    return batches


@slow
async def test_join_while_three_writers_truncate_every_two_seconds(mesh: MeshFactory, tmp_path: Path) -> None:
    """Three application sessions (two on the donor a, one on b) truncate and refill a staging table each
    every ~2 s for the whole join. A table truncated after the join's snapshot needs no copy (c replays
    the TRUNCATE and the rows after it): the join completes, and every node ends identical."""
    seed = "INSERT INTO big SELECT g, repeat('p', 200) FROM generate_series(1, 300000) g;"
    made = await mesh(nodes=2, schema=STAGING + seed, spares=["c"])
    a, b, c = made.all_nodes
    router, config = await _router(tmp_path, made)
    stop = asyncio.Event()
    writers = [asyncio.create_task(_staging_writer(node, table, stop))
               for node, table in ((a, "stage1"), (b, "stage2"), (a, "stage3"))]
    try:
        await wait_for(lambda: all(t.done() for t in writers) or _rows(a, "stage2") > 0, "the writers", 30)
        _add_node(config, c, SYNC)
        joined = await asyncio.to_thread(pgmesh, config, "join", "c")
        assert joined.returncode == 0, joined.stdout[-3000:] + joined.stderr[-5000:]
        await wait_for(lambda: _streaming(config, 3), "every link of three nodes streaming", 120)
    finally:
        stop.set()
        batches = await asyncio.gather(*writers)
    try:
        assert min(batches) >= 2, batches
        await wait_identical([a, b, c])
        assert await fetch(c.dsn(), "SELECT count(*) FROM big") == [(300_000,)]
    finally:
        await router.stop()


def _rows(node: Any, table: str) -> int:
    done = psql(node, f"SELECT count(*) FROM {table}")
    return int(done.stdout.split()[2])


# ---------------------------------------------------------------------------------------------------------
# From Debian's current PostgreSQL 15 (15.20) into 18

PG1520_BINDIR = Path(os.environ.get("PGMESH_TEST_PG1520_BINDIR", "/opt/pg15.20/usr/lib/postgresql/15/bin"))
ATTOPTIONS = "SELECT count(*) FROM pg_attribute WHERE attrelid = 'acct'::regclass AND attnum > 0 AND {}"


@slow
@pytest.mark.parametrize("new_major", [18, 15])
async def test_join_from_debians_15_20(mesh: MeshFactory, tmp_path: Path, new_major: int) -> None:
    """Debian's PostgreSQL 15.20 gives every column an attribute option (`pg_attver`) that 18 (and 15.18)
    refuse in `ALTER TABLE ... ALTER COLUMN ... SET (...)`: the join leaves out the options the new node
    does not accept, and says so. Two 15.20 nodes; an 18 node (18's pg_dump and pg_restore), or one of
    the machine's 15 (its own tools), joins from one of them."""
    if not (PG1520_BINDIR / "postgres").exists():
        pytest.skip(f"no PostgreSQL 15.20 server in {PG1520_BINDIR} (apt-get download postgresql-15"
                    " postgresql-client-15, dpkg -x them into /opt/pg15.20; or set"
                    " PGMESH_TEST_PG1520_BINDIR)")
    versions = [PG1520_BINDIR, PG1520_BINDIR, new_major]
    made = await mesh(nodes=2, schema=SCHEMA, spares=["c"], versions=versions)
    a, b, c = made.all_nodes
    version = psql(a, "SHOW server_version").stdout
    if "15.20" not in version:
        pytest.skip(f"the server in {PG1520_BINDIR} is not 15.20: {version.strip()}")
    refuses = psql(c, "CREATE TEMP TABLE probe (c int); ALTER TABLE probe ALTER COLUMN c SET (pg_attver = 1)",
                   check=False).returncode != 0
    with_options = await fetch(a.dsn(), ATTOPTIONS.format("attoptions IS NOT NULL"))
    assert with_options == [(3,)], with_options  # every column: the case the join must handle
    psql(a, "INSERT INTO acct (owner) SELECT 'a' FROM generate_series(1, 100)")
    router, config = await _router(tmp_path, made)
    try:
        _add_node(config, c, SYNC)
        joined = pgmesh(config, "join", "c")
        assert joined.returncode == 0, joined.stdout + joined.stderr
        if refuses:  # 18, 15.18: left out, and said
            assert "column options pg_attver left out" in joined.stderr, joined.stderr
            assert await fetch(c.dsn(), ATTOPTIONS.format("attoptions IS NULL")) == [(3,)]
        await wait_for(lambda: _streaming(config, 3), "every link of three nodes streaming", 120)
        psql(c, "INSERT INTO acct (owner) VALUES ('c')")
        psql(b, "INSERT INTO events VALUES (1, 'b')")
        await wait_identical([a, b, c])
    finally:
        await router.stop()
