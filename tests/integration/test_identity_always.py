"""Tables keyed by an identity GENERATED ALWAYS column: PostgreSQL lets no UPDATE set such a column (not
even to its own value), so every UPDATE the appliers write leaves it out (router.apply.statements
.update_sets): plain updates, conflicting updates decided on the target, an insert that meets its key;
an update that moves the identity's value (`SET id = DEFAULT`) stops the link with an error naming the
table, never a silent difference."""

from __future__ import annotations

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE ident (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v text, n int);"
ROWS = "SELECT id, v, n FROM ident ORDER BY id"


async def test_updates_of_an_identity_always_table_replicate(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO ident (v, n) SELECT 'v' || g, g FROM generate_series(1, 20) g")
        await wait_converged(m.nodes, ["ident"], 60)
        await execute(a.dsn(), "UPDATE ident SET v = 'from a' WHERE id <= 5")
        await execute(b.dsn(), "UPDATE ident SET n = -n WHERE id BETWEEN 6 AND 10")
        await wait_converged(m.nodes, ["ident"], 60)
        assert (await fetch(b.dsn(), "SELECT v FROM ident WHERE id = 1")) == [("from a",)]
        # conflicts: the same row updated on both, an insert meeting its key on the other node
        await router.pause(None)
        await execute(a.dsn(), "UPDATE ident SET v = 'a wins?' WHERE id = 11")
        await execute(b.dsn(), "UPDATE ident SET v = 'b wins?' WHERE id = 11")
        await execute(a.dsn(), "INSERT INTO ident OVERRIDING SYSTEM VALUE VALUES (100, 'a', 1)")
        await execute(b.dsn(), "INSERT INTO ident OVERRIDING SYSTEM VALUE VALUES (100, 'b', 2)")
        await router.resume(None)
        await wait_converged(m.nodes, ["ident"], 60)
        assert await fetch(a.dsn(), ROWS) == await fetch(b.dsn(), ROWS)
        assert {s.state for s in router.status().links} <= {"streaming", "catching up"}
        # a moved identity value cannot be written by an UPDATE: the link stops, naming the table
        await execute(a.dsn(), "UPDATE ident SET id = DEFAULT WHERE id = 20")
        link = router.appliers[("a", "b")]
        await wait_for(lambda: link.state.value == "error", "a -> b to stop on the moved identity")
        error = {(x.source, x.target): x for x in router.status().links}[("a", "b")].last_error or ""
        assert "identity column id" in error and "ident" in error, error
