"""A partitioned table whose root its owner made REPLICA IDENTITY FULL, on a real two-node mesh with the
router running (issue 17, found by the property test).

pgoutput sends a partition's changes with the partition's own replica identity, converted to the root's
columns: under a FULL root whose partitions kept DEFAULT, an update came with no old row and an unchanged
TOAST value, and the link stopped ("column big arrived as 'u'"). pgmesh makes every partition of such a
root FULL too: `init` for the tables it finds, the DDL capture for a root made FULL later and for
partitions created or attached later.
"""

from __future__ import annotations

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

BIG = "repeat('x', 20000)"
ROOT_FULL = """
CREATE TABLE p (k text PRIMARY KEY, big text, v int) PARTITION BY LIST (k);
CREATE TABLE p1 PARTITION OF p FOR VALUES IN ('x', 'y');
CREATE TABLE p2 PARTITION OF p DEFAULT;
ALTER TABLE p REPLICA IDENTITY FULL;
"""
IDENTITIES = ("SELECT c.relname::text, c.relreplident::text FROM pg_class c"
              " WHERE c.relname ~ '^[pq][0-9]*$' AND c.relkind IN ('r', 'p') ORDER BY 1")


async def _full(dsn: str, table: str) -> bool:
    return await fetch(dsn, f"SELECT relreplident::text FROM pg_class WHERE relname = '{table}'") == [("f",)]


async def _identities_everywhere(nodes: list[object], expected: list[tuple[str, str]]) -> None:
    for node in nodes:
        dsn = node.dsn()  # type: ignore[attr-defined]

        async def alike(dsn: str = dsn) -> bool:
            return await fetch(dsn, IDENTITIES) == expected

        await wait_for(alike, f"replica identities {expected}")


async def test_partitions_of_a_full_root_are_full_and_toasted_updates_replicate(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=ROOT_FULL)
    a, b = m.nodes
    await _identities_everywhere(m.nodes, [("p", "f"), ("p1", "f"), ("p2", "f")])
    await execute(a.dsn(), f"INSERT INTO p VALUES ('x', {BIG}, 0), ('z', {BIG}, 0)")
    await execute(b.dsn(), f"INSERT INTO p VALUES ('y', {BIG}, 0)")
    async with running_router(m.config) as router:
        await wait_converged(m.nodes, ["p"])
        await execute(a.dsn(), "UPDATE p SET v = 1 WHERE k IN ('x', 'z')")  # big unchanged: not sent
        await execute(b.dsn(), "UPDATE p SET v = 2 WHERE k = 'y'")
        # a root made FULL later, by DDL on a, and a partition created after it
        await execute(a.dsn(), "CREATE TABLE q (k int PRIMARY KEY, big text, v int) PARTITION BY RANGE (k);"
                      " CREATE TABLE q1 PARTITION OF q FOR VALUES FROM (0) TO (10)")
        await execute(a.dsn(), "ALTER TABLE q REPLICA IDENTITY FULL")
        await wait_for(lambda: _full(b.dsn(), "q"), "q made FULL on b")
        await execute(b.dsn(), "CREATE TABLE q2 PARTITION OF q FOR VALUES FROM (10) TO (20)")
        expected = [("p", "f"), ("p1", "f"), ("p2", "f"), ("q", "f"), ("q1", "f"), ("q2", "f")]
        await _identities_everywhere(m.nodes, expected)
        await execute(a.dsn(), f"INSERT INTO q VALUES (1, {BIG}, 0), (11, {BIG}, 0)")
        await wait_converged(m.nodes, ["q"])
        await execute(b.dsn(), "UPDATE q SET v = 3")
        await wait_converged(m.nodes, ["p", "q"])
        assert await fetch(a.dsn(), "SELECT k, v, length(big) FROM p ORDER BY k") == [
            ("x", 1, 20000), ("y", 2, 20000), ("z", 1, 20000)]
        assert await fetch(a.dsn(), "SELECT k, v FROM q ORDER BY k") == [(1, 3), (11, 3)]
        assert all(applier.last_error is None for applier in router.appliers.values())
