"""A table keyed by a replica identity index (no primary key) in the careful path: a row is found by the
index's columns, as the fast path finds it. An update's row carries the values after it and a deletion's
key tuple only the index's columns (the others NULL), so a match on the whole row found nothing: the
update was decided as `update_missing`, the deletion as `delete_missing`, and the nodes stayed apart
while every link streamed."""

from __future__ import annotations

from router.testing.mesh import execute, fetch, running_router, wait_converged
from tests.fix_mesh import MeshFactory

SCHEMA = """
CREATE TABLE ri (a int NOT NULL, b int NOT NULL, v int NOT NULL);
CREATE UNIQUE INDEX ri_b ON ri (b);
ALTER TABLE ri REPLICA IDENTITY USING INDEX ri_b;
"""


async def test_concurrent_changes_of_rows_keyed_by_a_replica_identity_index_converge(
    mesh: MeshFactory,
) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    await execute(a.dsn(), "INSERT INTO ri SELECT i, i, 0 FROM generate_series(1, 20) i")
    async with running_router(m.config) as router:
        await wait_converged(m.nodes, ["ri"])
        await router.pause(None)  # both sides change the same rows: each change meets the other's
        # b's update first, then a's changes: the order of the commit times is fixed (a's deletion of
        # b's updated rows 16-20 is the newer change and wins on both nodes), so the outcome is too
        await execute(b.dsn(), "UPDATE ri SET v = 2 WHERE b > 5")
        await execute(a.dsn(), "UPDATE ri SET v = 1 WHERE b <= 10", "DELETE FROM ri WHERE b > 15")
        await execute(a.dsn(), "UPDATE ri SET v = 3 WHERE b = 1")  # a's newest: it wins everywhere
        await router.resume(None)
        await wait_converged(m.nodes, ["ri"])
        assert all(applier.last_error is None for applier in router.appliers.values())
    for node in m.nodes:
        history = await fetch(node.dsn(), "SELECT DISTINCT conflict_type FROM pgmesh.conflict_history")
        assert {"update_missing", "delete_missing"}.isdisjoint(r[0] for r in history), (node.name, history)
    rows = await fetch(a.dsn(), "SELECT b, v FROM ri ORDER BY b")
    assert [r[0] for r in rows] == list(range(1, 16))  # the rows a deleted stay deleted
    assert dict(rows)[1] == 3
