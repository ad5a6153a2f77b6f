"""pglogical's parallel.sql, ported to a two-node pgmesh mesh with the router running (issue 17).

pglogical splits one provider's tables over two subscriptions (replication sets `default` and
`parallel`), applied by two workers, and refuses a second subscription of the same name. pgmesh has one
link per pair of nodes; its parallel apply is `[replication] apply_lanes` (transactions of one link that
touch different rows applied side by side, committed in the source's order). The scenario's writes run
with two lanes, on both nodes: one statement that inserts into both tables (a data-modifying CTE), then one
transaction that updates one table and deletes from the other, and many small transactions on each
table from both nodes at once.
"""

from __future__ import annotations

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import has, healthy

TABLES = """CREATE TABLE public.basic_dml1 (
    id serial primary key,
    other integer,
    data text,
    something interval
);
CREATE TABLE public.basic_dml2 (
    id serial primary key,
    other integer,
    data text,
    something interval
)"""

BOTH = """WITH one AS (
INSERT INTO basic_dml1(other, data, something)
VALUES (5, 'foo', '1 minute'::interval),
       (4, 'bar', '12 weeks'::interval),
       (3, 'baz', '2 years 1 hour'::interval),
       (2, 'qux', '8 months 2 days'::interval),
       (1, NULL, NULL)
RETURNING *
)
INSERT INTO basic_dml2 SELECT * FROM one"""


async def test_parallel(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, replication="apply_lanes = 2")
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), TABLES)
        made = "SELECT to_regclass('basic_dml2') IS NOT NULL"
        await wait_for(lambda: has(b.dsn(), made, [(True,)]), "both tables on b")

        await execute(a.dsn(), BOTH)
        await execute(a.dsn(), "BEGIN",
                      "UPDATE basic_dml1 SET other = id,"
                      " something = something - '10 seconds'::interval WHERE id < 3",
                      "DELETE FROM basic_dml2 WHERE id < 3", "COMMIT")
        await wait_converged(m.nodes, ["basic_dml1", "basic_dml2"])  # b's updates below build on it
        for i in range(20):  # small transactions from both nodes, on both tables
            await execute(a.dsn(), f"INSERT INTO basic_dml1 VALUES ({100 + i}, {i}, 'a', NULL)")
            await execute(b.dsn(), f"INSERT INTO basic_dml2 VALUES ({200 + i}, {i}, 'b', NULL)")
            await execute(b.dsn(), f"UPDATE basic_dml1 SET other = other + 1 WHERE id = {1 + i % 5}")
        await wait_converged(m.nodes, ["basic_dml1", "basic_dml2"])

        first = "SELECT id, other, data, something::text FROM {} WHERE id < 100 ORDER BY id"
        assert await fetch(b.dsn(), first.format("basic_dml1")) == [
            (1, 5, "foo", "00:00:50"), (2, 6, "bar", "84 days -00:00:10"), (3, 7, "baz", "2 years 01:00:00"),
            (4, 6, "qux", "8 mons 2 days"), (5, 5, None, None),
        ]
        assert await fetch(b.dsn(), first.format("basic_dml2")) == [
            (3, 3, "baz", "2 years 01:00:00"), (4, 2, "qux", "8 mons 2 days"), (5, 1, None, None),
        ]
        counts = "SELECT (SELECT count(*) FROM basic_dml1), (SELECT count(*) FROM basic_dml2)"
        assert await fetch(a.dsn(), counts) == [(25, 23)]
        healthy(router)
