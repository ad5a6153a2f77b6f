"""PostgreSQL's 035_conflicts.pl ported to a two-node pgmesh mesh with the router running (issue 17).

The original shows multiple_unique_conflicts in the subscriber's log: a remote row that meets three local
rows, on its primary key and two other unique keys, stops the apply. pgmesh decides each of those
meetings as an insert_exists by last-update-wins (docs/conflicts.md, "Insert against insert on another
unique key"): the newer row replaces every row it collides with, on every node alike, and each decision
is recorded. The original's retain_dead_tuples / pg_conflict_detection part is PostgreSQL 19's and has
no pgmesh counterpart (pgmesh keeps tombstones for deleted keys).
"""

from __future__ import annotations

import pytest

from router.testing.mesh import execute, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import conflicts, converge, healthy, rows_everywhere

SCHEMA = """
CREATE TABLE conf_tab (a int PRIMARY KEY, b int UNIQUE, c int UNIQUE);
CREATE TABLE conf_tab_2 (a int PRIMARY KEY, b int, c int, unique(a,b)) PARTITION BY RANGE (a);
CREATE TABLE conf_tab_2_p1 PARTITION OF conf_tab_2 FOR VALUES FROM (MINVALUE) TO (100);
"""
ROWS = "SELECT * FROM conf_tab ORDER BY a"


async def test_035_insert_meets_three_rows(mesh: MeshFactory) -> None:
    """INSERT: a's newer row meets three of b's rows, one on each unique key."""
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await router.pause(None)
        await execute(a.dsn(), "INSERT INTO conf_tab VALUES (1,1,1);")
        await execute(b.dsn(), "INSERT INTO conf_tab VALUES (2,2,2), (3,3,3), (4,4,4);")
        await execute(a.dsn(), "INSERT INTO conf_tab VALUES (2,3,4);")
        await router.resume(None)
        await converge(router, m.nodes, ["conf_tab"], 15)
        await rows_everywhere(m.nodes, ROWS, [(1, 1, 1), (2, 3, 4)])
        healthy(router)
    found = await conflicts(m.nodes, "public.conf_tab")
    assert found.count("insert_exists") >= 3, found


async def test_035_insert_meets_two_rows_on_secondary_keys(mesh: MeshFactory) -> None:
    """The same without the primary key clash: two of b's rows, on b and on c."""
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await router.pause(None)
        await execute(b.dsn(), "INSERT INTO conf_tab VALUES (3,3,3), (4,4,4);")
        await execute(a.dsn(), "INSERT INTO conf_tab VALUES (2,3,4);")
        await router.resume(None)
        await converge(router, m.nodes, ["conf_tab"])
        await rows_everywhere(m.nodes, ROWS, [(2, 3, 4)])
        healthy(router)
    found = await conflicts(m.nodes, "public.conf_tab")
    assert found.count("insert_exists") >= 2, found


async def test_035_update_meets_three_rows(mesh: MeshFactory) -> None:
    """UPDATE of a's row onto the key and unique values of three of b's rows."""
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO conf_tab VALUES (5,5,5);")
        await rows_everywhere(m.nodes, ROWS, [(5, 5, 5)])
        await router.pause(None)
        await execute(b.dsn(), "INSERT INTO conf_tab VALUES (6,6,6), (7,7,7), (8,8,8);")
        await execute(a.dsn(), "UPDATE conf_tab set a=6, b=7, c=8 where a=5;")
        await router.resume(None)
        await converge(router, m.nodes, ["conf_tab"], 15)
        await rows_everywhere(m.nodes, ROWS, [(6, 7, 8)])
        healthy(router)


async def test_035_leaf_partition(mesh: MeshFactory) -> None:
    """The same row on a leaf partition with a unique (a, b), from both nodes: the later one is kept."""
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await router.pause(None)
        await execute(b.dsn(), "INSERT INTO conf_tab_2 VALUES (55,2,3);")
        await execute(a.dsn(), "INSERT INTO conf_tab_2 VALUES (55,2,4);")
        await router.resume(None)
        await converge(router, m.nodes, ["conf_tab_2"])
        await rows_everywhere(m.nodes, "SELECT * FROM conf_tab_2", [(55, 2, 4)])
        healthy(router)


@pytest.mark.parametrize(
    ("first", "last", "kept"),
    [
        ("(2,2,2)", "(5,3,5)", (5, 3, 5)),  # b's row beats a's older row on a, loses to a's newer on b
        ("(5,3,5)", "(2,2,2)", (2, 2, 2)),  # b's row beats a's older row on b, loses to a's newer on a
    ],
)
async def test_035_insert_wins_one_meeting_loses_another(
    mesh: MeshFactory, first: str, last: str, kept: tuple[int, int, int]
) -> None:
    """b's row (2,3,9) meets two of a's rows, one older and one newer: each meeting is decided alone (the
    older row goes, b's row is not written), and both nodes keep only a's newer row."""
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await router.pause(None)
        await execute(a.dsn(), f"INSERT INTO conf_tab VALUES {first};")
        await execute(b.dsn(), "INSERT INTO conf_tab VALUES (2,3,9);")
        await execute(a.dsn(), f"INSERT INTO conf_tab VALUES {last};")
        await router.resume(None)
        await converge(router, m.nodes, ["conf_tab"])
        await rows_everywhere(m.nodes, ROWS, [kept])
        healthy(router)
