"""Partial nodes (router.cluster.partial): a receive-only node that gets some tables only, the rows a
filter keeps and some columns; under writes and conflicts on the nodes that send it holds exactly the
others' rows through its filter, decided alike (a change that takes a row out is that key's newer version
there), and records no conflict for the rows it does not hold. init makes rows already there fit, and
refuses what could not converge."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from router.cluster.install import init_cluster
from router.config.model import Config
from router.errors import PgmeshError
from router.ops.control import render_status
from router.ops.join import join_node
from router.testing.localnodes import LocalNode
from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = """
CREATE TABLE orders (id int PRIMARY KEY, region text, amount int);
CREATE TABLE customers (id int PRIMARY KEY, name text, secret text);
CREATE TABLE logs (id int PRIMARY KEY, msg text NOT NULL);
"""
EU = "SELECT id, region, amount FROM orders WHERE region = 'eu' ORDER BY id"
NAMES = "SELECT id, name, NULL::text FROM customers ORDER BY id"


def partial(config: Config, name: str, **part: Any) -> Config:
    nodes = [msgspec.structs.replace(n, receive_only=True, **part) if n.name == name else n
             for n in config.nodes]
    return msgspec.structs.replace(config, nodes=nodes)


PART = {
    "tables": ["public.orders", "public.customers"],
    "rows": {"public.orders": "region = 'eu'"},
    "columns": {"public.customers": ["id", "name"]},
}


async def holds_part(full: LocalNode, part: LocalNode) -> bool:
    return (await fetch(part.dsn(), "SELECT id, region, amount FROM orders ORDER BY id")
            == await fetch(full.dsn(), EU)
            and await fetch(part.dsn(), "SELECT id, name, secret FROM customers ORDER BY id")
            == await fetch(full.dsn(), NAMES))


async def test_a_partial_node_holds_the_filtered_rows_and_columns_under_writes(mesh: MeshFactory) -> None:
    m = await mesh(nodes=["a", "b", "r"], schema=SCHEMA, init=False)
    a, b, r = m.nodes
    before = ("INSERT INTO orders SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, g"
              " FROM generate_series(1, 20) g;"
              " INSERT INTO customers SELECT g, 'n' || g, 's' || g FROM generate_series(1, 10) g;"
              " INSERT INTO logs VALUES (1, 'kept where it was')")
    for node in m.nodes:  # r held everything before it was made partial
        await execute(node.dsn(), before)
    config = partial(m.config, "r", **PART)
    _, lines = await init_cluster(config)
    assert any(line.startswith("node r: holds part of the data: 2 of 3") for line in lines), lines
    assert await holds_part(a, r)  # init made the rows already there fit
    async with running_router(config) as router:
        assert set(router.appliers) == {("a", "b"), ("b", "a"), ("a", "r"), ("b", "r")}
        assert ("; r holds only public.orders, public.customers; rows of public.orders where region = 'eu'"
                in render_status(router.status()))

        async def writes(node: LocalNode, base: int) -> None:
            for i in range(40):
                key = 1 + (i * 7 + base) % 30
                region = "eu" if (i + base) % 3 else "us"
                await execute(node.dsn(),
                              f"INSERT INTO orders VALUES ({key}, '{region}', {i})"
                              f" ON CONFLICT (id) DO UPDATE SET region = excluded.region, amount = {i}",
                              f"UPDATE customers SET name = 'w{base}-{i}', secret = 'x{i}'"
                              f" WHERE id = {1 + i % 10}",
                              f"INSERT INTO logs VALUES ({100 * base + i}, 'm') ON CONFLICT DO NOTHING")
                if i % 9 == 4:
                    await execute(node.dsn(), f"DELETE FROM orders WHERE id = {key}")

        await asyncio.gather(writes(a, 1), writes(b, 2))
        await wait_converged([a, b], ["orders", "customers", "logs"], 120)
        await wait_for(lambda: holds_part(a, r), "r to hold a's eu orders and customer names", 120)
        held, total = len(await fetch(r.dsn(), EU)), len(await fetch(a.dsn(), "SELECT 1 FROM orders"))
        assert 0 < held < total, (held, total)

        # the order that makes a tombstone necessary: a change taking a row out reaches r before an older
        # change that would bring it in
        router.appliers[("a", "r")].pause()
        await execute(a.dsn(), "INSERT INTO orders VALUES (200, 'eu', 1), (300, 'us', 1)")
        both = "SELECT count(*) FROM orders WHERE id IN (200, 300)"
        await wait_for(lambda: _count(b, both, 2), "b to get them")
        await execute(b.dsn(), "UPDATE orders SET region = 'us' WHERE id = 200",
                      "UPDATE orders SET region = 'eu' WHERE id = 300")
        await wait_for(lambda: _count(r, "SELECT count(*) FROM orders WHERE id = 300", 1), "b's update on r")
        router.appliers[("a", "r")].resume()
        await wait_converged([a, b], ["orders"], 60)
        await wait_for(lambda: holds_part(a, r), "r to hold the eu orders again", 60)
        assert await fetch(r.dsn(), "SELECT id, region FROM orders WHERE id IN (200, 300)") == [(300, "eu")]
        # a column added later (replicated DDL) is not in r's list: NULL there as well
        await execute(a.dsn(), "ALTER TABLE customers ADD COLUMN note text")
        has = "SELECT count(*) FROM pg_attribute WHERE attrelid = 'customers'::regclass AND attname = 'note'"
        await wait_for(lambda: _count(b, has, 1), "the new column on b", 60)
        await execute(b.dsn(), "UPDATE customers SET note = 'n' || id")
        await wait_converged([a, b], ["customers"], 60)
        noted = ("SELECT count(*) FROM customers AS c"
                 " WHERE to_jsonb(c) ? 'note' AND to_jsonb(c) ->> 'note' IS NULL")
        await wait_for(lambda: _count(r, noted, 10), "the new column on r, NULL in every row", 60)
        assert await fetch(a.dsn(), "SELECT count(*) FROM customers WHERE note IS NOT NULL") == [(10,)]
        assert all(applier.last_error is None for applier in router.appliers.values())
    assert await fetch(r.dsn(), "SELECT * FROM logs") == [(1, "kept where it was")]  # never written there
    unrecorded = await fetch(
        r.dsn(), "SELECT count(*) FROM pgmesh.conflict_history WHERE table_name = 'public.orders'"
        " AND conflict_type IN ('update_missing', 'delete_missing', 'update_deleted', 'insert_deleted')")
    assert unrecorded == [(0,)]


async def _count(node: LocalNode, query: str, wanted: int) -> bool:
    return (await fetch(node.dsn(), query))[0][0] == wanted


@pytest.mark.parametrize(("part", "says"), [
    ({"rows": {"public.orders": "random() < 0.5"}}, "mutable functions are not allowed"),
    ({"columns": {"public.logs": ["id"]}}, "NOT NULL"),
    ({"columns": {"public.orders": ["region", "amount"]}}, "a key or unique index"),
    ({"rows": {"public.uniq": "v > 0"}}, "unique key besides the primary key"),
    ({"tables": ["public.nothere"]}, "not a replicated table"),
    ({"columns": {"public.uexpr": ["id", "note"]}}, "a key or unique index"),  # in lower(email)
    ({"rows": {"public.orders": "amount > 1"}, "columns": {"public.orders": ["id", "region"]}},
     "left out of the column list"),
])
async def test_init_refuses_a_part_that_could_not_converge(
    mesh: MeshFactory, part: dict[str, Any], says: str
) -> None:
    schema = SCHEMA + ("CREATE TABLE uniq (id int PRIMARY KEY, v int UNIQUE);"
                       " CREATE TABLE uexpr (id int PRIMARY KEY, email text, note text);"
                       " CREATE UNIQUE INDEX ON uexpr (lower(email));")
    m = await mesh(nodes=2, schema=schema, init=False)
    config = partial(m.config, m.nodes[1].name, **part)
    with pytest.raises(PgmeshError) as refused:
        await init_cluster(config)
    assert says in str(refused.value) and f"node {m.nodes[1].name}" in str(refused.value), str(refused.value)


async def test_a_partial_node_joins_with_its_part_only(mesh: MeshFactory) -> None:
    """join copies whole tables from a full donor; the install after the copy makes them fit (and a
    partial node is never picked as a donor)."""
    m = await mesh(nodes=["a", "b"], schema=SCHEMA, spares=["r"])
    a, b, r = m.all_nodes
    async with running_router(m.config):
        await execute(a.dsn(), "INSERT INTO orders SELECT g, CASE WHEN g % 3 = 0 THEN 'eu' ELSE 'us' END, g"
                      " FROM generate_series(1, 3000) g",
                      "INSERT INTO customers SELECT g, 'n' || g, 's' || g FROM generate_series(1, 50) g",
                      "INSERT INTO logs SELECT g, 'm' FROM generate_series(1, 100) g")
        await wait_converged([a, b], ["orders", "customers", "logs"])
    config = partial(m.config_for(m.all_nodes), "r", **PART)
    await join_node(config, "r")
    assert await holds_part(a, r)
    async with running_router(config):
        await execute(b.dsn(), "UPDATE orders SET region = 'eu' WHERE id <= 10",
                      "UPDATE customers SET secret = 'again' WHERE id <= 10")
        await execute(a.dsn(), "DELETE FROM orders WHERE id BETWEEN 2990 AND 3000")
        await wait_converged([a, b], ["orders", "customers"])
        await wait_for(lambda: holds_part(a, r), "r to hold its part", 60)


async def test_large_and_streamed_transactions_into_a_partial_node(mesh: MeshFactory) -> None:
    """The large path (COPY runs, a table's tombstones probed after them), spilled and early-applied
    transactions, into a partial node: rows the filter drops go, tables it does not get stay empty."""
    m = await mesh(nodes=["a", "b", "r"], schema=SCHEMA, init=False, replication="spill_mb = 1")
    a, b, r = m.nodes
    config = partial(m.config, "r", **PART)
    await init_cluster(config)
    async with running_router(config) as router:
        await execute(a.dsn(), "INSERT INTO orders SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, g"
                      " FROM generate_series(1, 100000) g")
        await execute(b.dsn(), "INSERT INTO logs SELECT g, 'm' FROM generate_series(1, 50000) g")
        await wait_converged([a, b], ["orders", "logs"], 180)
        await wait_for(lambda: holds_part(a, r), "r to hold the eu orders", 180)
        await execute(b.dsn(), "UPDATE orders SET region = CASE WHEN region = 'eu' THEN 'us' ELSE 'eu' END"
                      " WHERE id <= 30000")
        await execute(a.dsn(), "DELETE FROM orders WHERE id > 90000")
        await execute(a.dsn(), "INSERT INTO orders SELECT g, 'eu', g FROM generate_series(95001, 96000) g")
        await wait_converged([a, b], ["orders"], 180)
        await wait_for(lambda: holds_part(a, r), "r to hold the eu orders after the big changes", 180)
        assert all(applier.last_error is None for applier in router.appliers.values())
        into_r = [applier.stats for (_, target), applier in router.appliers.items() if target == "r"]
        assert sum(s.copied_rows for s in into_r) > 0
        assert sum(s.early_transactions + s.early_streams for s in into_r) > 0
    assert await fetch(r.dsn(), "SELECT count(*) FROM logs") == [(0,)]


async def test_a_node_made_partial_later_drops_the_rest_without_tombstones(mesh: MeshFactory) -> None:
    """init on a cluster that ran: the rows r no longer holds go in init's transaction, under an origin of
    their own, so r's tombstone recorder (which reads r's slot from before) records no deletion of them:
    such a tombstone would carry init's time and beat older changes still on their way."""
    m = await mesh(nodes=["a", "b", "r"], schema=SCHEMA)
    a, b, r = m.nodes
    async with running_router(m.config):
        await execute(a.dsn(), "INSERT INTO orders SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, g"
                      " FROM generate_series(1, 1000) g",
                      "INSERT INTO customers SELECT g, 'n' || g, 's' || g FROM generate_series(1, 10) g")
        await wait_converged(m.nodes, ["orders", "customers"])
    config = partial(m.config, "r", **PART)
    await init_cluster(config)
    assert await holds_part(a, r)
    [(after_init,)] = await fetch(r.dsn(), "SELECT pg_current_wal_lsn()::text")
    past = f"SELECT count(*) FROM pg_replication_slots WHERE confirmed_flush_lsn >= '{after_init}'"
    async with running_router(config) as router:
        await execute(b.dsn(), "INSERT INTO orders VALUES (5000, 'eu', 1)")
        await wait_for(lambda: holds_part(a, r), "r to hold its part", 60)
        await wait_for(lambda: _count(r, past, 1), "r's slot (its recorder) to have read past init", 60)
        assert all(recorder.error is None for recorder in router.recorders.values())
    assert await fetch(r.dsn(), "SELECT count(*) FROM pgmesh.tombstones") == [(0,)]
