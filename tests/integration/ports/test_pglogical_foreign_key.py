"""pglogical's foreign_key.sql, ported to a two-node pgmesh mesh with the router running (issue 17).

A table with a primary key and a table without one that references it (pglogical puts the second in its
insert-only replication set; pgmesh makes it REPLICA IDENTITY FULL and replicates it, docs/ddl.md), both
made by DDL in one query string while the router runs. Rows are
inserted on both nodes, orders referencing products written on the other node.
"""

from __future__ import annotations

import psycopg
import pytest

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import has, healthy

SCHEMA = """CREATE TABLE public.f1k_products (
    product_no integer PRIMARY KEY,
    product_id integer,
    name text,
    price numeric
);

CREATE TABLE public.f1k_orders (
    order_id integer,
    product_no integer REFERENCES public.f1k_products (product_no),
    quantity integer
);
--pass
"""

PRODUCTS = "SELECT product_no, product_id, name, price::text FROM public.f1k_products ORDER BY product_no"
ORDERS = "SELECT order_id, product_no, quantity FROM public.f1k_orders ORDER BY order_id"


async def test_foreign_key(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), SCHEMA)
        made = "SELECT to_regclass('public.f1k_orders') IS NOT NULL"
        await wait_for(lambda: has(b.dsn(), made, [(True,)]), "both tables on b")

        await execute(a.dsn(), "INSERT into public.f1k_products VALUES (1, 1, 'product1', 1.20)")
        await execute(a.dsn(), "INSERT into public.f1k_products VALUES (2, 2, 'product2', 2.40)")
        await execute(a.dsn(), "INSERT into public.f1k_orders VALUES (300, 1, 4)")
        await execute(a.dsn(), "INSERT into public.f1k_orders VALUES (22, 2, 14)")
        await execute(a.dsn(), "INSERT into public.f1k_orders VALUES (23, 2, 24)")
        await execute(a.dsn(), "INSERT into public.f1k_orders VALUES (24, 2, 40)")
        # b: a product of its own, an order for a's product and one for its own
        await wait_for(lambda: has(b.dsn(), "SELECT count(*) FROM f1k_products", [(2,)]), "a's products on b")
        await execute(b.dsn(), "INSERT into public.f1k_products VALUES (3, 3, 'product3', 3.60)")
        await execute(b.dsn(), "INSERT into public.f1k_orders VALUES (25, 1, 5), (26, 3, 6)")
        with pytest.raises(psycopg.errors.ForeignKeyViolation):  # the constraint holds on every node
            await execute(b.dsn(), "INSERT into public.f1k_orders VALUES (27, 4, 7)")

        await wait_converged(m.nodes, ["f1k_products", "f1k_orders"], 30)
        assert await fetch(b.dsn(), PRODUCTS) == [
            (1, 1, "product1", "1.20"), (2, 2, "product2", "2.40"), (3, 3, "product3", "3.60")]
        assert await fetch(a.dsn(), ORDERS) == [
            (22, 2, 14), (23, 2, 24), (24, 2, 40), (25, 1, 5), (26, 3, 6), (300, 1, 4)]

        await execute(a.dsn(), "DROP TABLE public.f1k_orders CASCADE",
                      "DROP TABLE public.f1k_products CASCADE")
        gone = (
            "SELECT to_regclass('public.f1k_orders') IS NULL"
            " AND to_regclass('public.f1k_products') IS NULL")
        await wait_for(lambda: has(b.dsn(), gone, [(True,)]), "both tables dropped on b")
        healthy(router)


async def test_delete_at_once_with_a_referencing_insert(mesh: MeshFactory) -> None:
    """A limit, for docs/limits.md (as in every asynchronous multi-master system): a deletes a product
    while b, at the same time, inserts an order for it (links held: truly concurrent). Each node's own
    statement passed its foreign key check; the applier does not check foreign keys (session_replication_role
    = replica), so both nodes end alike, with the order and without its product, and no conflict is
    recorded. What this test pins down: the nodes converge, nothing stops, and the orphan is what is left."""
    # (made before init: init asks a table without a key for REPLICA IDENTITY FULL, given here)
    m = await mesh(nodes=2, schema=SCHEMA + ";ALTER TABLE public.f1k_orders REPLICA IDENTITY FULL")
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT into public.f1k_products VALUES (3, 3, 'product3', 3.60)")
        await wait_converged(m.nodes, ["f1k_products"])
        await router.pause(None)
        await execute(a.dsn(), "DELETE FROM public.f1k_products WHERE product_no = 3")
        await execute(b.dsn(), "INSERT into public.f1k_orders VALUES (30, 3, 1)")
        await router.resume(None)
        await wait_converged(m.nodes, ["f1k_products", "f1k_orders"])
        orphans = ("SELECT o.order_id FROM public.f1k_orders o"
                   " WHERE NOT EXISTS (SELECT FROM public.f1k_products p WHERE p.product_no = o.product_no)")
        for node in m.nodes:
            assert await fetch(node.dsn(), orphans) == [(30,)]
        assert sum(applier.stats.conflicts for applier in router.appliers.values()) == 0
        healthy(router)
