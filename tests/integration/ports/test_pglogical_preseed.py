"""pglogical's preseed.sql and preseed_check.sql, ported to a two-node pgmesh mesh (issue 17).

pglogical clones a provider whose tables, rows and sequences exist before the clone, and checks they are
all there after. A DBA's way to the same with pgmesh (an empty new node is `pgmesh join`'s, see
docs/join.md): seed b with `pg_dump` of a, then `pgmesh init` both. The original's keyless tables get the
replica identity a DBA would give them: the unique NOT NULL key where there is one, FULL otherwise. After
init, every table and sequence of the dump is on b with its rows, and writes on either node replicate.
"""

from __future__ import annotations

import asyncio

from router.cluster.install import init_cluster
from router.nodes.pgbin import find_pg_bindir
from router.testing.mesh import execute, fetch, running_router, wait_converged
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import healthy

SEED = """CREATE SEQUENCE some_local_seq;
CREATE TABLE some_local_tbl(id serial primary key, key text unique not null, data text);
INSERT INTO some_local_tbl(key, data) VALUES('key1', 'data1');
INSERT INTO some_local_tbl(key, data) VALUES('key2', NULL);
INSERT INTO some_local_tbl(key, data) VALUES('key3', 'data3');
CREATE TABLE some_local_tbl1(id serial, key text unique not null, data text);
INSERT INTO some_local_tbl1(key, data) VALUES('key1', 'data1');
INSERT INTO some_local_tbl1(key, data) VALUES('key2', NULL);
INSERT INTO some_local_tbl1(key, data) VALUES('key3', 'data3');
CREATE TABLE some_local_tbl2(id serial, key text, data text);
INSERT INTO some_local_tbl2(key, data) VALUES('key1', 'data1');
INSERT INTO some_local_tbl2(key, data) VALUES('key2', NULL);
INSERT INTO some_local_tbl2(key, data) VALUES('key3', 'data3');
CREATE TABLE some_local_tbl3(id integer, key text, data text);
INSERT INTO some_local_tbl3(key, data) VALUES('key1', 'data1');
INSERT INTO some_local_tbl3(key, data) VALUES('key2', NULL);
INSERT INTO some_local_tbl3(key, data) VALUES('key3', 'data3');
ALTER TABLE some_local_tbl1 REPLICA IDENTITY USING INDEX some_local_tbl1_key_key;
ALTER TABLE some_local_tbl2 REPLICA IDENTITY FULL;
ALTER TABLE some_local_tbl3 REPLICA IDENTITY FULL;
SELECT nextval('some_local_seq') FROM generate_series(1, 3)"""

TABLES = ["some_local_tbl", "some_local_tbl1", "some_local_tbl2", "some_local_tbl3"]


async def _dump_into(source: str, target: str) -> None:
    """pg_dump of `source` restored into `target`, as a DBA seeds a node."""
    bindir = find_pg_bindir()
    dump = await asyncio.create_subprocess_exec(
        str(bindir / "pg_dump"), "--no-owner", "-d", source, stdout=asyncio.subprocess.PIPE)
    script, _ = await dump.communicate()
    assert dump.returncode == 0
    restore = await asyncio.create_subprocess_exec(
        str(bindir / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", target,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL)
    await restore.communicate(script)
    assert restore.returncode == 0


async def test_preseed(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, init=False)
    a, b = m.nodes
    await execute(a.dsn(), SEED)
    await _dump_into(a.dsn(), b.dsn())

    # preseed_check: everything is on b as on a
    for table in TABLES:
        query = f"SELECT id, key, data FROM {table} ORDER BY key"
        assert await fetch(b.dsn(), query) == await fetch(a.dsn(), query) != []
    assert await fetch(b.dsn(), "SELECT last_value FROM some_local_seq") == [(3,)]

    report, _ = await init_cluster(m.config)
    assert report.ok, report.render()
    assert sorted(t for _, t in report.tables) == TABLES
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO some_local_tbl(id, key, data) VALUES (10, 'key10', 'from a')",
                      "UPDATE some_local_tbl1 SET data = 'upd a' WHERE key = 'key2'",
                      "DELETE FROM some_local_tbl3 WHERE key = 'key1'")
        await execute(b.dsn(), "INSERT INTO some_local_tbl(id, key, data) VALUES (20, 'key20', 'from b')",
                      "UPDATE some_local_tbl2 SET data = 'upd b' WHERE key = 'key3'",
                      "INSERT INTO some_local_tbl3 VALUES (4, 'key4', 'from b')")
        await wait_converged(m.nodes, TABLES)
        assert await fetch(a.dsn(), "SELECT key, data FROM some_local_tbl1 ORDER BY key") == [
            ("key1", "data1"), ("key2", "upd a"), ("key3", "data3")]
        assert await fetch(a.dsn(), "SELECT key, data FROM some_local_tbl3 ORDER BY key") == [
            ("key2", None), ("key3", "data3"), ("key4", "from b")]
        healthy(router)
