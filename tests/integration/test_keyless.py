"""Tables without a key on a real two-node mesh with the router running (issue 17).

A table created without a primary key is made REPLICA IDENTITY FULL by the capture trigger on every node
(`new_table_without_key = "full"`, the default): its inserts, updates and deletes replicate from the
first row on, and a row is matched on the other nodes by all its columns (docs/ddl.md). Without a key a
row has no identity beyond its values: an update or delete takes away a row equal to its old row,
whoever wrote it; an update whose old row is gone on a node (updated or deleted there at the same time)
keeps its new row there, unless it left its row as it was (then it changes nothing), so concurrent
changes end the same on every node, but for the patterns docs/conflicts.md lists. A primary key added
later (pg_dump's order: CREATE TABLE, rows, ADD CONSTRAINT) makes the table REPLICA IDENTITY DEFAULT
again, and conflicts are decided by that key.
"""

from __future__ import annotations

import random
from typing import Any

import psycopg
import pytest

from router.cluster.install import init_cluster
from router.config.model import parse_config
from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import has, healthy, same_rows

IDENTITY = "SELECT relreplident::text FROM pg_class WHERE oid = to_regclass(%s)"
PUBLISHED = "SELECT count(*) FROM pg_publication_tables WHERE pubname LIKE 'pgmesh%%' AND tablename = %s"
TOMBSTONE_KEY = (
    "SELECT encode(tgargs, 'escape') FROM pg_trigger WHERE tgrelid = to_regclass(%s)"
    " AND tgname = 'pgmesh_tombstone' AND tgparentid = 0"
)


async def identity(dsn: str, table: str) -> str | None:
    rows = await fetch(dsn, IDENTITY, [table])
    return rows[0][0] if rows else None


async def identity_everywhere(nodes: list[Any], table: str, expected: str, router: Any = None) -> None:
    async def check() -> bool:
        links = router.appliers.items() if router else ()
        errors = {name: a.last_error for name, a in links if a.last_error}
        assert not errors, errors
        return all([await identity(n.dsn(), table) == expected for n in nodes])

    await wait_for(check, f"replica identity {expected!r} of {table} on every node")


async def test_a_table_created_without_a_key_replicates_from_its_first_row(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        notices: list[str] = []
        async with await psycopg.AsyncConnection.connect(a.dsn(), autocommit=True) as conn:
            conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
            await conn.execute('CREATE TABLE "log" ("at" int, "what" text)')
            await conn.execute("""INSERT INTO "log" VALUES (1, 'x'), (1, 'x'), (2, 'y')""")
        full = "public.log has no primary key: replicated with REPLICA IDENTITY FULL"
        assert any(full in n for n in notices), notices
        await identity_everywhere(m.nodes, "log", "f", router)
        for node in m.nodes:
            assert await fetch(node.dsn(), PUBLISHED, ["log"]) == [(1,)]
        await execute(b.dsn(), """INSERT INTO "log" VALUES (3, 'z'), (1, 'x')""")
        rows = await same_rows(a, b, 'SELECT * FROM "log" ORDER BY 1, 2', "the rows of both nodes")
        assert rows == [(1, "x"), (1, "x"), (1, "x"), (2, "y"), (3, "z")], rows
        # updates and deletes of rows that repeat, on both nodes: each touches the rows it touched
        await execute(b.dsn(), """UPDATE "log" SET "what" = 'xx' WHERE "at" = 1""")
        await execute(a.dsn(), """DELETE FROM "log" WHERE "at" = 2""")
        rows = await same_rows(a, b, 'SELECT * FROM "log" ORDER BY 1, 2', "the updates and deletes")
        assert rows == [(1, "xx"), (1, "xx"), (1, "xx"), (3, "z")], rows
        await execute(a.dsn(), """DELETE FROM "log"
                               WHERE ctid = (SELECT min(ctid) FROM "log" WHERE "at" = 1)""")
        rows = await same_rows(a, b, 'SELECT * FROM "log" ORDER BY 1, 2', "one of three equal rows deleted")
        assert rows == [(1, "xx"), (1, "xx"), (3, "z")], rows
        # created and filled in one transaction (applied the careful way, row by row): equal rows stay two
        await execute(b.dsn(), "BEGIN", 'CREATE TABLE "bag" ("v" int, "w" text)',
                      """INSERT INTO "bag" VALUES (1, 'one'), (1, 'one'), (2, NULL)""", "COMMIT")
        await identity_everywhere(m.nodes, "bag", "f", router)
        await wait_converged(m.nodes, ["bag"])
        assert await fetch(a.dsn(), 'SELECT * FROM "bag" ORDER BY 1') == [(1, "one"), (1, "one"), (2, None)]
        await execute(a.dsn(), """UPDATE "bag" SET "w" = 'two' WHERE "v" = 2""")
        two = """SELECT "w" FROM "bag" WHERE "v" = 2"""
        await wait_for(lambda: has(b.dsn(), two, [("two",)]), "the update of bag on b")
        await wait_converged(m.nodes, ["log", "bag"])
        healthy(router)


async def test_concurrent_changes_to_a_table_without_a_key_end_equal(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), 'CREATE TABLE "k" ("a" int, "b" text)',
                      """INSERT INTO "k" VALUES (1, 'x'), (2, 'y'), (3, 'z'), (4, 'w'), (6, 'u')""")
        await identity_everywhere(m.nodes, "k", "f", router)
        await wait_converged(m.nodes, ["k"])
    # the router is down: both nodes write the same rows, then it starts and the changes meet
    await execute(a.dsn(), """UPDATE "k" SET "b" = 'xa' WHERE "a" = 1""", """DELETE FROM "k" WHERE "a" = 2""",
                  """INSERT INTO "k" VALUES (5, 'v')""", """UPDATE "k" SET "b" = 'wa' WHERE "a" = 4""",
                  """DELETE FROM "k" WHERE "a" = 6""")
    await execute(b.dsn(), """UPDATE "k" SET "b" = 'xb' WHERE "a" = 1""",
                  """UPDATE "k" SET "b" = 'yb' WHERE "a" = 2""",
                  """INSERT INTO "k" VALUES (5, 'v')""", """DELETE FROM "k" WHERE "a" = 4""",
                  """DELETE FROM "k" WHERE "a" = 6""")
    async with running_router(m.config) as router:
        await wait_converged(m.nodes, ["k"])
        healthy(router)
    rows = await fetch(a.dsn(), 'SELECT * FROM "k" ORDER BY 1, 2')
    # both updates of row 1 kept; an update beats a delete (its old row is gone: its new row stays);
    # both inserts kept; row 6, deleted on both, is gone
    assert rows == [(1, "xa"), (1, "xb"), (2, "yb"), (3, "z"), (4, "wa"), (5, "v"), (5, "v")], rows
    for node in m.nodes:
        types = await fetch(node.dsn(), "SELECT DISTINCT conflict_type FROM pgmesh.conflict_history"
                                        " WHERE table_name = 'public.k' ORDER BY 1")
        assert ("update_missing",) in types, types


async def test_a_key_added_later_takes_over(mesh: MeshFactory) -> None:
    """pg_dump's order: the table, its rows, then its primary key."""
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), 'CREATE TABLE "d" ("id" int NOT NULL, "v" text)',
                      """INSERT INTO "d" SELECT g, 'a' FROM generate_series(1, 10) g""")
        await identity_everywhere(m.nodes, "d", "f", router)
        await execute(b.dsn(), """INSERT INTO "d" SELECT g, 'b' FROM generate_series(11, 20) g""")
        await wait_converged(m.nodes, ["d"])
        await execute(b.dsn(), 'ALTER TABLE "d" ADD CONSTRAINT "d_pkey" PRIMARY KEY ("id")')
        await identity_everywhere(m.nodes, "d", "d", router)
        for node in m.nodes:
            assert await fetch(node.dsn(), TOMBSTONE_KEY, ["d"]) == [("id\\000",)]
        await execute(a.dsn(), """UPDATE "d" SET "v" = 'a2' WHERE "id" = 11""")
        await execute(b.dsn(), """DELETE FROM "d" WHERE "id" = 1""")
        await wait_converged(m.nodes, ["d"])
    # conflicts are decided by the key again: the later of two updates of one row wins everywhere
    await execute(a.dsn(), """UPDATE "d" SET "v" = 'first' WHERE "id" = 5""")
    await execute(b.dsn(), """UPDATE "d" SET "v" = 'second' WHERE "id" = 5""")
    async with running_router(m.config) as router:
        await wait_converged(m.nodes, ["d"])
        healthy(router)
    assert await fetch(a.dsn(), 'SELECT "v" FROM "d" WHERE "id" = 5') == [("second",)]
    assert await fetch(a.dsn(), 'SELECT count(*) FROM "d"') == [(19,)]
    for node in m.nodes:
        history = await fetch(node.dsn(), "SELECT conflict_type, key FROM pgmesh.conflict_history"
                                          " WHERE table_name = 'public.d'")
        assert ("update_origin_differs", "5") in history, history  # decided by the key, on both nodes


async def test_a_key_replaced_in_one_transaction_while_the_other_node_writes(mesh: MeshFactory) -> None:
    """DROP CONSTRAINT, changes without a key, ADD PRIMARY KEY (other columns): one transaction on a,
    while b updates rows by the old key; then conflicts are decided by the new key."""
    schema = """CREATE TABLE "t" ("id" int PRIMARY KEY, "other" int NOT NULL, "v" text);
                INSERT INTO "t" SELECT g, g + 100, 'start' FROM generate_series(1, 40) g;"""
    m = await mesh(nodes=2, schema=schema)
    a, b = m.nodes
    shape = ("SELECT (SELECT string_agg(attname, ',') FROM pg_index JOIN pg_attribute ON attrelid = indrelid"
             " AND attnum = ANY(indkey) WHERE indrelid = 't'::regclass AND indisprimary), relreplident::text,"
             " (SELECT encode(tgargs, 'escape') FROM pg_trigger WHERE tgrelid = 't'::regclass"
             " AND tgname = 'pgmesh_tombstone') FROM pg_class WHERE oid = 't'::regclass")
    async with running_router(m.config) as router:
        await execute(a.dsn(), "BEGIN", 'ALTER TABLE "t" DROP CONSTRAINT "t_pkey"',
                      """UPDATE "t" SET "v" = 'between' WHERE "id" <= 5""", 'DELETE FROM "t" WHERE "id" = 6',
                      """INSERT INTO "t" VALUES (41, 141, 'between'), (41, 142, 'between')""",
                      """UPDATE "t" SET "id" = 42 WHERE "other" = 142""",
                      'ALTER TABLE "t" ADD PRIMARY KEY ("other")',
                      """UPDATE "t" SET "v" = 'after' WHERE "other" = 107""", "COMMIT")
        for i in range(20, 30):  # by the old key, on b, while a's transaction travels
            await execute(b.dsn(), """UPDATE "t" SET "v" = 'b' WHERE "id" = %s""", params=[i])
        identity = [("other", "d", "other\\000")]
        await identity_everywhere(m.nodes, "t", "d", router)
        for node in m.nodes:
            assert await fetch(node.dsn(), shape) == identity
        await wait_converged(m.nodes, ["t"])
        rows = await fetch(b.dsn(), 'SELECT "id", "other", "v" FROM "t" WHERE "v" <> \'start\' ORDER BY 2')
        assert rows == [
            *[(i, i + 100, "between") for i in range(1, 6)], (7, 107, "after"),
            *[(i, i + 100, "b") for i in range(20, 30)], (41, 141, "between"), (42, 142, "between"),
        ], rows
        assert await fetch(b.dsn(), 'SELECT count(*) FROM "t" WHERE "id" = 6') == [(0,)]
        healthy(router)
    await execute(a.dsn(), """UPDATE "t" SET "v" = 'first' WHERE "other" = 111""")
    await execute(b.dsn(), """UPDATE "t" SET "v" = 'second' WHERE "other" = 111""")
    async with running_router(m.config) as router:
        await wait_converged(m.nodes, ["t"])
        healthy(router)
    assert await fetch(a.dsn(), 'SELECT "v" FROM "t" WHERE "other" = 111') == [("second",)]
    for node in m.nodes:
        history = await fetch(node.dsn(), "SELECT conflict_type, key FROM pgmesh.conflict_history"
                                          " WHERE table_name = 'public.t'")
        assert ("update_origin_differs", "111") in history, history


async def test_a_partitioned_table_without_a_key(mesh: MeshFactory) -> None:
    """The root and every partition (also one created later) are made REPLICA IDENTITY FULL: pgoutput
    takes the old row from the partition a change is made in."""
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), 'CREATE TABLE "p" ("a" int, "b" text) PARTITION BY RANGE ("a")',
                      'CREATE TABLE "p1" PARTITION OF "p" FOR VALUES FROM (0) TO (100)')
        await identity_everywhere(m.nodes, "p1", "f", router)
        await execute(b.dsn(), 'CREATE TABLE "p2" PARTITION OF "p" FOR VALUES FROM (100) TO (200)')
        await identity_everywhere(m.nodes, "p2", "f", router)
        await identity_everywhere(m.nodes, "p", "f", router)
        await execute(a.dsn(), """INSERT INTO "p" VALUES (1, 'x'), (1, 'x'), (150, 'y')""")
        await execute(b.dsn(), """INSERT INTO "p" VALUES (2, 'z'), (199, 'w')""")
        await same_rows(a, b, 'SELECT * FROM "p" ORDER BY 1, 2', "the inserts")
        await execute(b.dsn(), """UPDATE "p" SET "a" = 120 WHERE "a" = 1""")  # moves across partitions
        await execute(a.dsn(), """DELETE FROM "p" WHERE "a" = 199""",
                      """UPDATE "p" SET "b" = 'zz' WHERE "a" = 2""")
        where = 'SELECT tableoid::regclass::text, * FROM "p" ORDER BY 2, 3'
        rows = await same_rows(a, b, where, "the changes")
        assert rows == [("p1", 2, "zz"), ("p2", 120, "x"), ("p2", 120, "x"), ("p2", 150, "y")], rows
        healthy(router)


async def test_what_is_refused(mesh: MeshFactory) -> None:
    """A replica identity set by hand that cannot identify rows, on a replicated table; and, with
    new_table_without_key = "refuse", a new table without a key and dropping a replicated table's key."""
    m = await mesh(nodes=2, schema='CREATE TABLE "t" ("id" int PRIMARY KEY, "v" text);')
    a = m.nodes[0].dsn()
    refused = psycopg.errors.FeatureNotSupported
    left = r"public\.t is replicated and would be left without a replica identity"
    with pytest.raises(refused, match=left):
        await execute(a, 'ALTER TABLE "t" REPLICA IDENTITY NOTHING')
    await execute(a, 'CREATE TABLE "n" ("v" text)', 'ALTER TABLE "n" REPLICA IDENTITY FULL')
    with pytest.raises(refused, match=r"public\.n is replicated and would be left without"):
        await execute(a, 'ALTER TABLE "n" REPLICA IDENTITY DEFAULT')
    # an identity FULL set by its owner stays when a key arrives; one pgmesh set goes back to DEFAULT
    await execute(a, 'CREATE TABLE "m" ("v" int NOT NULL)', 'ALTER TABLE "n" ADD PRIMARY KEY ("v")',
                  'ALTER TABLE "m" ADD PRIMARY KEY ("v")')
    assert [await identity(a, "n"), await identity(a, "m")] == ["f", "d"]
    await execute(a, 'DROP TABLE "n", "m"')  # (no router here: b never got them)
    strict = m.config_text().replace("[replication]\n", '[replication]\nnew_table_without_key = "refuse"\n')
    report, _ = await init_cluster(parse_config(strict))
    assert report.ok
    with pytest.raises(refused, match=r"public\.k has no primary key"):
        await execute(a, 'CREATE TABLE "k" ("v" text)')
    with pytest.raises(refused, match=left):
        await execute(a, 'ALTER TABLE "t" DROP CONSTRAINT "t_pkey"')
    assert await identity(a, "t") == "d"


@pytest.mark.parametrize("later", ["b", "a"])
async def test_a_no_op_update_against_an_update_of_the_same_row(mesh: MeshFactory, later: str) -> None:
    """Row (1, 0) on both; with the router down, a runs a no-op update of it (`SET b = 0`) and b sets it
    to (1, 1), in either order. a's no-op, found nowhere on b, changes nothing there (it takes a row
    away and puts the same row back); b's update finds the old row on a, whoever wrote it last, and
    replaces it: both nodes hold (1, 1). (Until issue 17 the no-op update was inserted on b as a
    missing row's new row, and a decided b's update by the versions: the nodes ended apart.)"""
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), 'CREATE TABLE "k" ("a" int, "b" int)', 'INSERT INTO "k" VALUES (1, 0)')
        await identity_everywhere(m.nodes, "k", "f", router)
        await wait_converged(m.nodes, ["k"])
    no_op = (a.dsn(), 'UPDATE "k" SET "b" = 0 WHERE "a" = 1')  # the same values: a version of a's
    update = (b.dsn(), 'UPDATE "k" SET "b" = 1 WHERE "a" = 1')
    for dsn, statement in (no_op, update) if later == "b" else (update, no_op):
        await execute(dsn, statement)
    skipped = "SELECT resolution FROM pgmesh.conflict_history WHERE table_name = 'public.k'"
    async with running_router(m.config) as router:
        await wait_converged(m.nodes, ["k"], 20)
        # the no-op changes nothing on b: the rows can match before b's link applied it; its record says so
        await wait_for(lambda: has(b.dsn(), skipped, [("keep_local",)]), "the no-op decided on b")
        healthy(router)
    assert await fetch(a.dsn(), 'SELECT * FROM "k"') == [(1, 1)]
    assert await fetch(b.dsn(), skipped) == [("keep_local",)]


@pytest.mark.parametrize("seed", [1, 2])
async def test_random_concurrent_changes_of_rows_never_equal_converge(mesh: MeshFactory, seed: int) -> None:
    """Inserts, updates and deletes of the same rows on both nodes at once, by rounds with the router down
    in between; no two rows are ever equal (each value written is new)."""
    m = await mesh(nodes=2)
    a = m.nodes[0]
    async with running_router(m.config) as router:
        await execute(a.dsn(), 'CREATE TABLE "k" ("a" int, "b" int)',
                      'INSERT INTO "k" SELECT g, 0 FROM generate_series(1, 30) g')
        await identity_everywhere(m.nodes, "k", "f", router)
        await wait_converged(m.nodes, ["k"])
    rng = random.Random(seed)
    written = 0
    for _ in range(2):
        for n, node in enumerate(m.nodes):
            statements = []
            for _ in range(25):
                written += 1
                row, value, choice = rng.randrange(1, 40), (n + 1) * 100_000 + written, rng.random()
                if choice < 0.5:
                    statements.append(f'UPDATE "k" SET "b" = {value} WHERE "a" = {row}')
                elif choice < 0.75:
                    statements.append(f'DELETE FROM "k" WHERE "a" = {row}')
                else:
                    statements.append(f'INSERT INTO "k" VALUES ({row}, {value})')
            await execute(node.dsn(), *statements)
        async with running_router(m.config) as router:
            await wait_converged(m.nodes, ["k"])
            healthy(router)
