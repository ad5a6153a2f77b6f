"""pglogical's conflict_secondary_unique.sql, ported to a two-node pgmesh mesh with the router running
(issue 17).

A table with a partial unique index (`UNIQUE (b) WHERE check_unique`): a remote row that does not match
the index's predicate must not be taken for a conflict with a local row that does. Added for a mesh: the
same from b; two nodes inserting at once (links held, so the writes are truly concurrent) rows that do
not collide because one of them is outside the predicate, and rows that collide on the partial index,
which every node must resolve alike (docs/conflicts.md, "Insert against insert on another unique key").
"""

from __future__ import annotations

import psycopg
import pytest

from router.testing.mesh import converged, execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import has, healthy, same_rows

SCHEMA = """CREATE TABLE public.secondary_unique_pred (
    a integer PRIMARY KEY,
    b integer NOT NULL,
    check_unique boolean NOT NULL
);
CREATE UNIQUE INDEX ON public.secondary_unique_pred (b) WHERE (check_unique)"""

ROWS = "SELECT a, b, check_unique FROM secondary_unique_pred ORDER BY a"


async def test_conflict_secondary_unique(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), SCHEMA)  # one query string with two commands, replayed as one
        index = "SELECT count(*) FROM pg_indexes WHERE tablename = 'secondary_unique_pred'"
        await wait_for(lambda: has(b.dsn(), index, [(2,)]), "the table and its partial index on b")

        await execute(a.dsn(), "INSERT INTO secondary_unique_pred (a, b, check_unique) VALUES (1, 1, false)")
        await execute(a.dsn(), "INSERT INTO secondary_unique_pred (a, b, check_unique) VALUES (2, 1, false)")
        await execute(a.dsn(), "INSERT INTO secondary_unique_pred (a, b, check_unique) VALUES (3, 2, true)")
        with pytest.raises(psycopg.errors.UniqueViolation, match="secondary_unique_pred_b_idx"):
            await execute(a.dsn(), "INSERT INTO secondary_unique_pred VALUES (5, 2, true)")
        rows = await same_rows(a, b, ROWS, "a's rows on b")
        assert rows == [(1, 1, False), (2, 1, False), (3, 2, True)], rows

        # no conflict on b: its row 3 matches the predicate, the new row does not
        await execute(a.dsn(), "INSERT INTO secondary_unique_pred (a, b, check_unique) VALUES (4, 2, false)")
        rows = await same_rows(a, b, ROWS, "row 4 on b")
        assert rows == [(1, 1, False), (2, 1, False), (3, 2, True), (4, 2, False)], rows
        # the same written on b
        await execute(b.dsn(), "INSERT INTO secondary_unique_pred (a, b, check_unique) VALUES (6, 2, false)")
        rows = await same_rows(a, b, ROWS, "row 6 on a")
        assert rows[-1] == (6, 2, False), rows
        assert sum(applier.stats.conflicts for applier in router.appliers.values()) == 0

        # at once on both nodes (links held): 9 (a, inside the predicate) and 10 (b, outside it) share
        # b = 30 and both stay
        await router.pause(None)
        await execute(a.dsn(), "INSERT INTO secondary_unique_pred VALUES (9, 30, true)")
        await execute(b.dsn(), "INSERT INTO secondary_unique_pred VALUES (10, 30, false)")
        await router.resume(None)
        await wait_converged(m.nodes, ["secondary_unique_pred"])
        rows = await fetch(a.dsn(), ROWS.replace("ORDER BY", "WHERE a >= 7 ORDER BY"))
        assert rows == [(9, 30, True), (10, 30, False)], rows

        await execute(a.dsn(), "DROP TABLE public.secondary_unique_pred CASCADE")
        gone = "SELECT to_regclass('public.secondary_unique_pred') IS NULL"
        await wait_for(lambda: has(b.dsn(), gone, [(True,)]), "the table dropped on b")
        healthy(router)


# Secondary unique keys with a predicate or on expressions (the conflict path once read plain column lists
# only, and both links stopped on the unique violation): two rows inserted at once on two nodes collide.
UNSEEN_KEYS = {
    "partial": (SCHEMA, "secondary_unique_pred", "(7, 20, true)", "(8, 20, true)"),
    "expression": (
        "CREATE TABLE public.u (id int PRIMARY KEY, email text);"
        " CREATE UNIQUE INDEX ON public.u (lower(email))",
        "u", "(7, 'X@y')", "(8, 'x@Y')",
    ),
}


@pytest.mark.parametrize("shape", sorted(UNSEEN_KEYS))
async def test_conflict_on_an_unseen_unique_index_at_once(mesh: MeshFactory, shape: str) -> None:
    """Two nodes insert at once rows that collide on such an index: to be decided like any insert_exists on
    a secondary unique key (docs/conflicts.md): b's later insert wins on every node."""
    schema, table, on_a, on_b = UNSEEN_KEYS[shape]
    key = "a" if shape == "partial" else "id"
    m = await mesh(nodes=2, schema=schema)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await router.pause(None)
        await execute(a.dsn(), f"INSERT INTO {table} VALUES {on_a}")
        await execute(b.dsn(), f"INSERT INTO {table} VALUES {on_b}")
        await router.resume(None)

        async def equal_or_stopped() -> bool:
            healthy(router)
            return await converged(m.nodes, [table])

        await wait_for(equal_or_stopped, f"{table} equal on both nodes")
        assert await fetch(a.dsn(), f"SELECT {key} FROM {table}") == [(8,)]


# An index on two expressions with a predicate, on columns named after pgmesh's own aliases (the remote
# row's VALUES is "pgmesh_r", the table "pgmesh_t": the index's terms name columns unqualified).
ALIASED = """CREATE TABLE public.w (id int PRIMARY KEY, "pgmesh_r" text, "pgmesh_t" int);
CREATE UNIQUE INDEX ON public.w (lower("pgmesh_r"), ("pgmesh_t" % 10)) WHERE "pgmesh_t" > 0;
INSERT INTO public.w VALUES (1, 'p', 1), (2, 'q', 2), (3, 'r', 3)"""


async def test_updates_onto_one_value_of_an_expression_index_at_once(mesh: MeshFactory) -> None:
    """a sets row 1 and b, later, row 2 to values that collide on the index (lower('X') = 'x', 13 % 10 =
    3 % 10): decided like any update onto another row's unique value (docs/conflicts.md): b's row 2 wins
    and row 1 goes, on both nodes. Row 3 is set at once on a to a colliding value outside the predicate
    (-3 % 10 is -3, and -3 > 0 fails): no conflict, it stays."""
    m = await mesh(nodes=2, schema=ALIASED)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await router.pause(None)
        await execute(a.dsn(), """UPDATE w SET "pgmesh_r" = 'X', "pgmesh_t" = 13 WHERE id = 1""",
                      """UPDATE w SET "pgmesh_r" = 'x', "pgmesh_t" = -3 WHERE id = 3""")
        await execute(b.dsn(), """UPDATE w SET "pgmesh_r" = 'x', "pgmesh_t" = 3 WHERE id = 2""")
        await router.resume(None)

        async def equal_or_stopped() -> bool:
            healthy(router)
            return await converged(m.nodes, ["w"])

        await wait_for(equal_or_stopped, "w equal on both nodes")
        rows = await fetch(a.dsn(), 'SELECT id, "pgmesh_r", "pgmesh_t" FROM w ORDER BY id')
        assert rows == [(2, "x", 3), (3, "x", -3)], rows
        history = "SELECT conflict_type FROM pgmesh.conflict_history WHERE table_name = 'public.w'"
        for node in m.nodes:
            assert ("insert_exists",) in await fetch(node.dsn(), history)
