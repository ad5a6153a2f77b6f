"""A row re-created by an update that arrives after a local delete must not break a secondary unique key.

Found by the schedule property test (tests/integration/test_conflict_schedules.py, once): B deletes row 1,
then gives row 2 the unique tag 'x'; later A gives row 1 the tag 'x'. On B, A's update finds row 1
deleted (update_deleted); A's change is newer, so row 1 comes back, with tag 'x', which row 2 holds.
That is decided like an insert meeting row 2 on the unique tag (insert_exists, as
docs/conflicts.md "Update onto another row's unique value"): A's version is newer, row 2 goes. On A,
B's delete of row 1 loses against A's newer update, and B's tag on row 2 meets row 1's: row 2 goes.
Both nodes end with row 1 holding 'x' and no row 2.
"""

from __future__ import annotations

from router.testing.localnodes import LocalNode
from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE reg (id int PRIMARY KEY, v int NOT NULL, tag text UNIQUE);"


async def test_update_recreating_a_deleted_row_meets_a_unique_value(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    nodes, config = m.nodes, m.config
    a, b = nodes
    async with running_router(config):
        await execute(a.dsn(), "INSERT INTO reg VALUES (1, 0, NULL), (2, 0, NULL)")
        await wait_converged(nodes, ["reg"])
    await execute(b.dsn(), "DELETE FROM reg WHERE id = 1")
    await execute(b.dsn(), "UPDATE reg SET tag = 'x' WHERE id = 2")
    await execute(a.dsn(), "UPDATE reg SET tag = 'x', v = 1 WHERE id = 1")
    async with running_router(config) as router:
        await wait_converged(nodes, ["reg"])
        assert all(applier.last_error is None for applier in router.appliers.values())
    for node in nodes:
        rows = await fetch(node.dsn(), "SELECT id, v, tag FROM reg ORDER BY id")
        assert rows == [(1, 1, "x")], (node.name, rows)


async def test_update_lost_to_a_deletion_still_beats_an_older_holder_of_its_unique_value(
    mesh: MeshFactory,
) -> None:
    """Found by the schedule property test (CI, 2026-11-28; seed 13 here): c gives row 4 the tag 'x' (U1),
    b then gives row 3 the tag 'x' (U2), c then deletes row 3 (D3). On b, U1 meets row 3 holding 'x' at
    U2's newer version and loses: row 4 goes. On a (and c) D3 came before U2: U2 loses to row 3's
    tombstone and is not written, but the pair U1 / U2 is decided alike: U2 is newer, so row 4 goes there
    too (before, a and c kept row 4 with 'x', b had none, every link streaming without an error)."""
    m = await mesh(nodes=3, schema=SCHEMA)
    nodes, config = m.nodes, m.config
    a, b, c = nodes
    async with running_router(config) as router:
        await execute(a.dsn(), "INSERT INTO reg VALUES (3, 0, NULL), (4, 0, NULL), (5, 0, NULL)")
        await wait_converged(nodes, ["reg"])
        for link in (("c", "b"), ("b", "a"), ("b", "c")):
            router.appliers[link].pause()
        await execute(c.dsn(), "UPDATE reg SET tag = 'x' WHERE id = 4")  # U1
        await execute(b.dsn(), "UPDATE reg SET tag = 'x' WHERE id = 3")  # U2
        await execute(c.dsn(), "DELETE FROM reg WHERE id = 3")  # D3
        await wait_for(lambda: holds(a, [(4, "x"), (5, None)]), "a to apply U1 and D3 from c")
        for applier in router.appliers.values():
            applier.resume()
        await wait_converged(nodes, ["reg"])
        assert all(applier.last_error is None for applier in router.appliers.values())
    for node in nodes:
        rows = await fetch(node.dsn(), "SELECT id, tag FROM reg ORDER BY id")
        assert rows == [(5, None)], (node.name, rows)


async def holds(node: LocalNode, rows: list[tuple[int, str | None]]) -> bool:
    return await fetch(node.dsn(), "SELECT id, tag FROM reg ORDER BY id") == rows
