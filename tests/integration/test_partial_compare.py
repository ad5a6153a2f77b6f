"""`pgmesh compare` and `pgmesh repair` with a partial node (router.cluster.partial) on a real 3-node mesh,
the router running: the full nodes are compared with each other, the partial node r with the first full
node (a) through its filter and columns, on the tables it gets only.

Divergences are made on purpose in sessions whose changes replication does not carry (a replication
origin of their own, and `session_replication_role = replica`: r refuses other local writes). Compare must
find all of them and only them, also under a live load on other keys that reach r (read again once every
link has applied past the first read); repair must make r hold a's filtered projection again, from a's
rows after the full nodes' own repair (a repair is forwarded nowhere, so r's copy of a key repaired on a
is written too), with only r's columns in what it writes and records there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import msgspec
import psycopg

from router.cluster.install import init_cluster
from router.config.model import Config
from router.ops.compare.job import compare_cluster
from router.ops.compare.repair import repair_cluster
from router.testing.localnodes import LocalNode
from router.testing.mesh import execute, fetch, free_port, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = """
CREATE TABLE orders (id int PRIMARY KEY, region text, amount int);
CREATE TABLE customers (id int PRIMARY KEY, name text, secret text);
CREATE TABLE logs (id int PRIMARY KEY, msg text);
"""
PART = {
    "tables": ["public.orders", "public.customers"],
    "rows": {"public.orders": "region = 'eu'"},
    "columns": {"public.customers": ["id", "name"]},
}
ORDERS = "SELECT id, region, amount FROM orders ORDER BY id"
EU = "SELECT id, region, amount FROM orders WHERE region = 'eu' ORDER BY id"
CUSTOMERS = "SELECT id, name, secret FROM customers ORDER BY id"
NAMES = "SELECT id, name, NULL::text FROM customers ORDER BY id"
LIVE = 100_000  # keys from here on: the live load's


def partial(config: Config, name: str) -> Config:
    nodes = [msgspec.structs.replace(n, receive_only=True, **PART) if n.name == name else n
             for n in config.nodes]
    return msgspec.structs.replace(config, nodes=nodes)


async def holds_part(full: LocalNode, part: LocalNode) -> bool:
    """`part` holds `full`'s eu orders and its customers' names only."""
    return (await fetch(part.dsn(), ORDERS) == await fetch(full.dsn(), EU)
            and await fetch(part.dsn(), CUSTOMERS) == await fetch(full.dsn(), NAMES))


async def unreplicated(node: LocalNode, *statements: str) -> None:
    """Run `statements` on `node` in a session whose changes the router does not carry (and that r does
    not refuse)."""
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        await conn.execute("SELECT pg_replication_origin_create('test_local') WHERE NOT EXISTS"
                           " (SELECT 1 FROM pg_replication_origin WHERE roname = 'test_local')")
        await conn.execute("SELECT pg_replication_origin_session_setup('test_local')")
        await conn.execute("SET session_replication_role = replica")
        async with conn.transaction():
            for statement in statements:
                await conn.execute(statement.encode())


@contextlib.asynccontextmanager
async def writing(nodes: list[LocalNode]) -> AsyncIterator[list[int]]:
    """Live orders (keys from LIVE on, in and out of r's filter) written on `nodes` until the block ends."""
    done = asyncio.Event()
    count = [0]

    async def write(node: LocalNode, offset: int) -> None:
        async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
            i = 0
            while not done.is_set() and i < 5_000:
                i += 1
                await conn.execute(
                    "INSERT INTO orders VALUES (%s, %s, 0)"
                    " ON CONFLICT (id) DO UPDATE SET amount = orders.amount + 1, region = excluded.region",
                    [LIVE + offset + i % 500, "eu" if i % 3 else "us"],
                )
                count[0] += 1

    tasks = [asyncio.create_task(write(node, 1_000 * n)) for n, node in enumerate(nodes)]
    try:
        yield count
    finally:
        done.set()
        await asyncio.gather(*tasks)


async def test_compare_and_repair_a_partial_node_through_its_filter_and_columns(mesh: MeshFactory) -> None:
    m = await mesh(nodes=["a", "b", "r"], schema=SCHEMA, admin_port=free_port(), init=False)
    a, b, r = m.nodes
    config = partial(m.config, "r")
    report, _ = await init_cluster(config)
    assert report.ok, report.render()
    async with running_router(config):
        await execute(a.dsn(),
                      "INSERT INTO orders SELECT g, CASE WHEN g % 3 = 0 THEN 'us' ELSE 'eu' END, g"
                      " FROM generate_series(1, 3000) g",
                      "INSERT INTO customers SELECT g, 'name ' || g, 'secret ' || g"
                      " FROM generate_series(1, 500) g",
                      "INSERT INTO logs SELECT g, 'log ' || g FROM generate_series(1, 100) g",
                      "ANALYZE orders, customers, logs")
        await wait_converged([a, b], ["orders", "customers", "logs"])
        await wait_for(lambda: holds_part(a, r), "r to hold a's eu orders and customer names", 120)
        assert await fetch(r.dsn(), "SELECT count(*) FROM logs") == [(0,)]

        clean = await compare_cluster(config)
        assert clean.differences == [] and clean.unsettled == [] and clean.exit_code == 0, clean.render()
        assert clean.tables == ["public.customers", "public.logs", "public.orders"]

        # on r: an eu order changed, one deleted, one that is nowhere else, one that is a us order elsewhere
        # (the filter keeps it out on a), a customer's name changed; r's logs are not compared (it does not
        # get them): a row there is no difference
        await unreplicated(r, "UPDATE orders SET amount = -1 WHERE id = 10",
                           "DELETE FROM orders WHERE id = 20",
                           "INSERT INTO orders VALUES (5000, 'eu', 7)",
                           "INSERT INTO orders VALUES (3, 'eu', 3)",
                           "UPDATE customers SET name = 'changed on r' WHERE id = 7",
                           "INSERT INTO logs VALUES (1, 'only on r')")
        # on b: an eu order (b's is the newer version: repair writes it on a, then a's new row on r)
        await unreplicated(b, "UPDATE orders SET amount = -2 WHERE id = 11")
        on_r = {("public.orders", "(10)"), ("public.orders", "(20)"), ("public.orders", "(5000)"),
                ("public.orders", "(3)"), ("public.customers", "(7)")}
        on_full = {("public.orders", "(11)")}

        async with writing([a, b]) as written:  # a live load on other keys, some of them reaching r
            await wait_for(lambda: written[0] > 100, "the writes on a and b to start")
            found = await compare_cluster(config)
        assert written[0] > 0
        assert {(d.table, d.key) for d in found.differences} == on_r | on_full, found.render()
        assert found.exit_code == 1 and found.rechecked
        # a live key is never a difference; one written at every recheck is listed as still being written
        assert all(int(d.key.strip("()")) >= LIVE for d in found.unsettled), found.render()
        by_key = {(d.table, d.key): d for d in found.differences}
        assert set(by_key[("public.orders", "(11)")].rows) == {"a", "b"}  # the full nodes only
        for ident in on_r:  # r's, against a
            assert set(by_key[ident].rows) == {"a", "r"}, ident
        assert by_key[("public.orders", "(20)")].rows["r"] is None
        assert by_key[("public.orders", "(5000)")].rows["a"] is None
        assert by_key[("public.orders", "(3)")].rows["a"] is None  # a's row, through r's filter
        encoded = json.loads(msgspec.json.encode(found))
        assert encoded["nodes"] == ["a", "b", "r"] and len(encoded["differences"]) == 6
        assert "missing" in found.render()

        await wait_for(lambda: live_settled(a, b, r), "the live orders on every node")
        repaired = await repair_cluster(config)
        assert repaired.exit_code == 0, repaired.render()
        fixes = {(f.table, f.key, f.winner, tuple(f.written)) for f in repaired.fixes}
        assert fixes == {
            ("public.orders", "(11)", "b", ("a",)),
            ("public.orders", "(11)", "a", ("r",)),  # a's row rewritten by repair: r's copy too
            ("public.orders", "(10)", "a", ("r",)),
            ("public.orders", "(20)", "a", ("r",)),
            ("public.orders", "(5000)", "a", ("r",)),
            ("public.orders", "(3)", "a", ("r",)),  # deleted there: a's row is not r's
            ("public.customers", "(7)", "a", ("r",)),
        }, repaired.render()

        again = await compare_cluster(config)
        assert again.differences == [] and again.exit_code == 0, again.render()
        assert await holds_part(a, r)
        assert await fetch(r.dsn(), "SELECT * FROM logs") == [(1, "only on r")]  # not compared, not repaired
        assert await fetch(a.dsn(), "SELECT amount FROM orders WHERE id = 11") == [(-2,)]
        # the fixes recorded where written, with only r's columns of a customer
        recorded = await fetch(r.dsn(), "SELECT table_name, key, remote_row FROM pgmesh.conflict_history"
                                        " WHERE source = 'repair' ORDER BY table_name, key")
        assert {(t, k) for t, k, _ in recorded} == {(t, k) for t, k, _, w in fixes if w == ("r",)}
        customer = next(row for t, _, row in recorded if t == "public.customers")
        assert customer == {"id": 7, "name": "name 7"}
        repairs = "SELECT count(*) FROM pgmesh.conflict_history WHERE source = 'repair'"
        assert await fetch(b.dsn(), repairs) == [(0,)] and await fetch(a.dsn(), repairs) == [(1,)]

        # a later write still reaches r over the repaired rows
        await execute(a.dsn(), "UPDATE orders SET amount = 99 WHERE id IN (10, 11)",
                      "UPDATE customers SET name = 'after repair' WHERE id = 7")
        await wait_converged([a, b], ["orders", "customers"])
        await wait_for(lambda: holds_part(a, r), "r to hold the writes after the repair")


async def live_settled(a: LocalNode, b: LocalNode, r: LocalNode) -> bool:
    live = f"SELECT id, region, amount FROM orders WHERE id >= {LIVE}"
    on_a = await fetch(a.dsn(), live + " ORDER BY id")
    return (on_a == await fetch(b.dsn(), live + " ORDER BY id")
            and await fetch(r.dsn(), live + " ORDER BY id")
            == await fetch(a.dsn(), live + " AND region = 'eu' ORDER BY id"))
