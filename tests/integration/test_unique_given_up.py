"""A unique value given up before an older (or newer) claim on it arrived: every node ends alike.

docs/conflicts.md, "A unique value given up" (the hole the schedule property test,
tests/integration/test_conflict_schedules.py, hit about once in 25 runs). Each test pauses one link so
that one node receives a claim on tag 'x' only after the row of the other claim has given 'x' up, while
the other nodes see both claims meet. The pairwise rule (the older claim's row goes, at the newer claim's
version) must then be applied from the record of given-up values (`pgmesh.given_up`).
"""

from __future__ import annotations

from router.testing.localnodes import LocalNode
from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE reg (id int PRIMARY KEY, v int NOT NULL, tag text UNIQUE);"


async def rows(node: LocalNode) -> list[tuple[int, int, str | None]]:
    return await fetch(node.dsn(), "SELECT id, v, tag FROM reg ORDER BY id")


async def test_an_older_claim_arriving_after_the_newer_one_was_given_up(mesh: MeshFactory) -> None:
    """c gives row 4 the tag 'x' (U1, t1); b, not having U1, gives row 3 the tag 'x' (U2, t2 > t1), then
    deletes row 3 (D3). On a and c, U2 meets row 4 holding 'x' at t1 and wins: row 4 goes. On b, U1
    arrives last and meets no row holding 'x': row 3's record of having held 'x' at t2 decides it, and
    row 4 goes there too (before: b kept row 4 with 'x', every link streaming)."""
    m = await mesh(nodes=3, schema=SCHEMA)
    nodes, config = m.nodes, m.config
    a, b, c = nodes
    async with running_router(config) as router:
        await execute(a.dsn(), "INSERT INTO reg VALUES (3, 0, NULL), (4, 0, NULL), (5, 0, NULL)")
        await wait_converged(nodes, ["reg"])
        router.appliers[("c", "b")].pause()
        await execute(c.dsn(), "UPDATE reg SET tag = 'x' WHERE id = 4")  # U1
        await wait_for(lambda: holds(a, 4, "x"), "a to apply U1 from c")
        await execute(b.dsn(), "UPDATE reg SET tag = 'x' WHERE id = 3")  # U2
        await execute(b.dsn(), "DELETE FROM reg WHERE id = 3")  # D3
        await wait_for(lambda: gone(c, 3), "c to apply U2 and D3 from b")
        await wait_for(lambda: gone(a, 3), "a to apply U2 and D3 from b")
        router.appliers[("c", "b")].resume()
        await wait_converged(nodes, ["reg"])
        assert all(applier.last_error is None for applier in router.appliers.values())
    for node in nodes:
        assert await rows(node) == [(5, 0, None)], (node.name, await rows(node))


async def test_an_older_claim_arriving_after_the_newer_one_moved_to_another_value(mesh: MeshFactory) -> None:
    """As above, but b gives 'x' up by giving row 3 the tag 'y' (U3): row 3 stays with 'y', row 4 goes."""
    m = await mesh(nodes=3, schema=SCHEMA)
    nodes, config = m.nodes, m.config
    a, b, c = nodes
    async with running_router(config) as router:
        await execute(a.dsn(), "INSERT INTO reg VALUES (3, 0, NULL), (4, 0, NULL), (5, 0, NULL)")
        await wait_converged(nodes, ["reg"])
        router.appliers[("c", "b")].pause()
        await execute(c.dsn(), "UPDATE reg SET tag = 'x' WHERE id = 4")  # U1
        await wait_for(lambda: holds(a, 4, "x"), "a to apply U1 from c")
        await execute(b.dsn(), "UPDATE reg SET tag = 'x' WHERE id = 3")  # U2
        await execute(b.dsn(), "UPDATE reg SET tag = 'y' WHERE id = 3")  # U3
        await wait_for(lambda: holds(c, 3, "y"), "c to apply U2 and U3 from b")
        await wait_for(lambda: holds(a, 3, "y"), "a to apply U2 and U3 from b")
        router.appliers[("c", "b")].resume()
        await wait_converged(nodes, ["reg"])
        assert all(applier.last_error is None for applier in router.appliers.values())
    for node in nodes:
        assert await rows(node) == [(3, 0, "y"), (5, 0, None)], (node.name, await rows(node))


async def test_a_newer_claim_arriving_after_the_older_one_was_given_up(mesh: MeshFactory) -> None:
    """The mirror: c gives row 4 the tag 'x' (U1, t1) and then 'y' (U1b, t1b); b, having neither, gives row
    3 the tag 'x' (U2, t2 > t1b). On a, U2 arrives while row 4 holds 'x' (c -> a paused after U1): row 4's
    version t1 loses and goes, its tombstone that version (t1), so U1b (t1b > t1, not holding 'x') brings
    row 4 back with 'y'. On b, U1 meets row 3 and loses (row 4 goes at t1), U1b brings it back likewise. On
    c, U2 meets no row holding 'x' (row 4 gave it up at t1b < t2): nothing to decide. Before, the tombstone
    of a row beaten on a unique key was the winner's version (t2 on a), and U1b lost to it there only."""
    m = await mesh(nodes=3, schema=SCHEMA)
    nodes, config = m.nodes, m.config
    a, b, c = nodes
    async with running_router(config) as router:
        await execute(a.dsn(), "INSERT INTO reg VALUES (3, 0, NULL), (4, 0, NULL), (5, 0, NULL)")
        await wait_converged(nodes, ["reg"])
        router.appliers[("c", "b")].pause()
        await execute(c.dsn(), "UPDATE reg SET tag = 'x' WHERE id = 4")  # U1
        await wait_for(lambda: holds(a, 4, "x"), "a to apply U1 from c")
        router.appliers[("c", "a")].pause()
        await execute(c.dsn(), "UPDATE reg SET tag = 'y' WHERE id = 4")  # U1b
        await execute(b.dsn(), "UPDATE reg SET tag = 'x' WHERE id = 3")  # U2
        await wait_for(lambda: holds(c, 3, "x"), "c to apply U2 from b")
        await wait_for(lambda: holds(a, 3, "x"), "a to apply U2 from b")
        router.appliers[("c", "a")].resume()
        router.appliers[("c", "b")].resume()
        await wait_converged(nodes, ["reg"])
        assert all(applier.last_error is None for applier in router.appliers.values())
    for node in nodes:
        assert await rows(node) == [(3, 0, "x"), (4, 0, "y"), (5, 0, None)], (node.name, await rows(node))


async def holds(node: LocalNode, key: int, tag: str) -> bool:
    return await fetch(node.dsn(), "SELECT tag FROM reg WHERE id = %s", [key]) == [(tag,)]


async def gone(node: LocalNode, key: int) -> bool:
    return await fetch(node.dsn(), "SELECT 1 FROM reg WHERE id = %s", [key]) == []


TWO_KEYS = "CREATE TABLE two (id int PRIMARY KEY, a int UNIQUE, b int UNIQUE);"


async def test_a_chain_of_rows_met_on_two_unique_keys(mesh: MeshFactory) -> None:
    """z = (3, a 8, b 1) on c (t1), y = (2, a 1, b 1) on b (t2), x = (1, a 1, b 9) on a (t3), every link
    paused: x meets y on a, y meets z on b, x and z never meet. y loses to x and z to y on every node, in
    whatever order they arrive. On a, y arrives first and is not written (it meets x), so z then meets no
    row on b: y's record of having held b 1 at t2 decides it (before, a kept z and the others did not)."""
    m = await mesh(nodes=3, schema=TWO_KEYS)
    nodes, config = m.nodes, m.config
    a, b, c = nodes
    async with running_router(config) as router:
        for link in router.appliers.values():
            link.pause()
        await execute(c.dsn(), "INSERT INTO two VALUES (3, 8, 1)")  # z
        await execute(b.dsn(), "INSERT INTO two VALUES (2, 1, 1)")  # y
        await execute(a.dsn(), "INSERT INTO two VALUES (1, 1, 9)")  # x
        # a: y, then z; b: x, then z; c: y, then x
        for first, then, target, key in (("b", "c", a, "2"), ("a", "c", b, "1"), ("b", "a", c, "2")):
            router.appliers[(first, target.name)].resume()
            await wait_for(lambda n=target, k=key: decided(n, k), f"{target.name} to decide {first}'s row")
            router.appliers[(then, target.name)].resume()
        await wait_converged(nodes, ["two"])
        assert all(applier.last_error is None for applier in router.appliers.values())
    for node in nodes:
        got = await fetch(node.dsn(), "SELECT id, a, b FROM two ORDER BY id")
        assert got == [(1, 1, 9)], (node.name, got)


async def decided(node: LocalNode, key: str) -> bool:
    """A conflict of the remote row `key` of table two is recorded on `node`."""
    query = "SELECT 1 FROM pgmesh.conflict_history WHERE table_name = 'public.two' AND key = %s"
    return bool(await fetch(node.dsn(), query, [key]))


async def test_a_unique_index_created_later_is_taken_up(mesh: MeshFactory) -> None:
    """CREATE UNIQUE INDEX after init (replicated DDL) puts the given-up trigger on the table on every
    node; a table without a unique key besides its primary key has none (it needs no record)."""
    m = await mesh(nodes=2, schema="CREATE TABLE plain (id int PRIMARY KEY, tag text);")
    nodes, config = m.nodes, m.config
    assert not any([await given_up_trigger(node) for node in nodes])
    async with running_router(config):
        await execute(nodes[0].dsn(), "CREATE UNIQUE INDEX plain_tag ON plain (lower(tag))")
        for node in nodes:
            await wait_for(lambda n=node: given_up_trigger(n), f"the given-up trigger on {node.name}")


async def given_up_trigger(node: LocalNode) -> bool:
    query = "SELECT 1 FROM pg_trigger WHERE tgrelid = 'plain'::regclass AND tgname = 'pgmesh_given_up'"
    return bool(await fetch(node.dsn(), query))


PARTITIONED = """
CREATE TABLE pt (id int, part int, tag text, PRIMARY KEY (id, part), UNIQUE (tag, part))
  PARTITION BY LIST (part);
CREATE TABLE pt_1 PARTITION OF pt FOR VALUES IN (1);
CREATE TABLE pt_2 PARTITION OF pt FOR VALUES IN (2);
"""


async def test_a_partitioned_table_records_under_its_root(mesh: MeshFactory) -> None:
    """The triggers are the root's (cloned to its partitions): a value given up in a partition is recorded
    under the root's name, with the version that held it, on the node that gave it up and where the
    deletion is applied."""
    m = await mesh(nodes=2, schema=PARTITIONED)
    nodes, config = m.nodes, m.config
    a, b = nodes
    async with running_router(config):
        await execute(a.dsn(), "INSERT INTO pt VALUES (1, 1, 'x'), (2, 2, 'y')")
        await wait_converged(nodes, ["pt"])
        await execute(b.dsn(), "DELETE FROM pt WHERE id = 2")
        await wait_converged(nodes, ["pt"])
    for node in nodes:
        records = await fetch(node.dsn(), "SELECT table_name, unique_key, value, key FROM pgmesh.given_up"
                                          " WHERE pg_xact_commit_timestamp(xid(xid)) IS NOT NULL")
        assert records == [("public.pt", '["tag", "part"]', "{y,2}", "{2,2}")], (node.name, records)
