"""pglogical's apply_delay.sql, ported to a two-node pgmesh mesh with the router running (issue 17).

pglogical's subscription takes `apply_delay := 2 seconds`; pgmesh's is `[replication] apply_delay_ms`, for
every link. The original creates a table by DDL and inserts rows, and checks that each reached the other
node at least the delay after it committed. Here each change is watched on the other node: whenever it is
visible there, that node's clock is at least its commit time plus the delay (the check is sound, whatever
the polling rate: a row cannot be seen before it is applied). Both directions, DDL and rows.
"""

from __future__ import annotations

import datetime
from typing import Any

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import healthy

DELAY = datetime.timedelta(seconds=2)
BASIC_DML1 = """CREATE TABLE public.basic_dml1 (
    id serial primary key,
    other integer,
    data text,
    something interval
)"""


async def _seen_late(node: Any, visible: str, committed: datetime.datetime, what: str) -> None:
    """Wait until `visible` (a boolean query) holds on `node`; each time it does, it is late enough."""
    async def check() -> bool:
        ((seen, now),) = await fetch(node.dsn(), f"SELECT ({visible}), clock_timestamp()")
        if seen:
            assert now >= committed + DELAY, (what, now, committed)
        return bool(seen)

    await wait_for(check, f"{what} on {node.name}", 30)


async def _committed(node: Any, query: str) -> datetime.datetime:
    ((at,),) = await fetch(node.dsn(), query)
    assert isinstance(at, datetime.datetime)
    return at


async def test_apply_delay(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, replication=f"apply_delay_ms = {int(DELAY.total_seconds() * 1000)}")
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), BASIC_DML1)
        ddl_at = await _committed(
            a, "SELECT pg_xact_commit_timestamp(xmin) FROM pg_class WHERE relname = 'basic_dml1'")
        await _seen_late(b, "to_regclass('public.basic_dml1') IS NOT NULL", ddl_at, "the CREATE TABLE")

        await execute(a.dsn(), """INSERT INTO basic_dml1(other, data, something)
            VALUES (5, 'foo', '1 minute'::interval),
                   (4, 'bar', '12 weeks'::interval),
                   (3, 'baz', '2 years 1 hour'::interval),
                   (2, 'qux', '8 months 2 days'::interval),
                   (1, NULL, NULL)""")
        rows_at = await _committed(a, "SELECT max(pg_xact_commit_timestamp(xmin)) FROM basic_dml1")
        await _seen_late(b, "(SELECT count(*) FROM basic_dml1) = 5", rows_at, "a's inserts")

        await execute(b.dsn(), "INSERT INTO basic_dml1 VALUES (100, 100, 'from b', '1 day')")
        b_at = await _committed(b, "SELECT pg_xact_commit_timestamp(xmin) FROM basic_dml1 WHERE id = 100")
        await _seen_late(a, "EXISTS (SELECT FROM basic_dml1 WHERE id = 100)", b_at, "b's insert")

        await wait_converged(m.nodes, ["basic_dml1"])
        rows = await fetch(b.dsn(), "SELECT id, other, data, something::text FROM basic_dml1 ORDER BY id")
        assert rows == [
            (1, 5, "foo", "00:01:00"), (2, 4, "bar", "84 days"), (3, 3, "baz", "2 years 01:00:00"),
            (4, 2, "qux", "8 mons 2 days"), (5, 1, None, None), (100, 100, "from b", "1 day"),
        ]
        healthy(router)
