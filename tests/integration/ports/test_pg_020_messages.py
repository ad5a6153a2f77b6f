"""PostgreSQL's 020_messages.pl ported to a two-node pgmesh mesh with the router running (issue 17).

The original reads pgoutput's stream for logical decoding messages (pg_logical_emit_message). pgmesh
asks for them (its DDL travels as messages with prefix `pgmesh.ddl`); a user's message, transactional or
not, is read and not replayed: it is not emitted again on the other nodes, and the rows of its
transaction are. A probe slot (test_decoding) on b shows what b's WAL gets.
"""

from __future__ import annotations

from router.testing.mesh import execute, fetch, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SCHEMA = "CREATE TABLE tab_test (a int primary key);"
EMIT = "SELECT pg_logical_emit_message({}, 'pgoutput', '{}')"


async def test_020_messages(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    await execute(b.dsn(), "SELECT pg_create_logical_replication_slot('probe', 'test_decoding')")
    try:
        async with running_router(m.config) as router:
            await execute(a.dsn(), EMIT.format("true", "a transactional message"))
            await execute(a.dsn(), "INSERT INTO tab_test VALUES (1)")
            await execute(a.dsn(), EMIT.format("false", "a non-transactional message"))
            await execute(a.dsn(), "INSERT INTO tab_test VALUES (2)")
            await execute(
                a.dsn(), "BEGIN",
                "SELECT pg_logical_emit_message(false, 'pgoutput', 'non-transactional in an aborted one 1')",
                "INSERT INTO tab_test VALUES (3)",
                "SELECT pg_logical_emit_message(true, 'pgoutput', 'transactional in an aborted one')",
                "SELECT pg_logical_emit_message(false, 'pgoutput', 'non-transactional in an aborted one 2')",
                "ROLLBACK",
            )
            await execute(a.dsn(), "BEGIN", "INSERT INTO tab_test VALUES (4)",
                          "SELECT pg_logical_emit_message(true, 'pgoutput', 'with rows')", "COMMIT")
            await execute(b.dsn(), "BEGIN", "INSERT INTO tab_test VALUES (5)",
                          "SELECT pg_logical_emit_message(true, 'user', 'from b')", "COMMIT")
            await rows_everywhere(m.nodes, "SELECT a FROM tab_test ORDER BY a", [(1,), (2,), (4,), (5,)])
            await converge(router, m.nodes, ["tab_test"])
            healthy(router)
        changes = await fetch(b.dsn(), "SELECT data FROM pg_logical_slot_get_changes('probe', NULL, NULL)")
        messages = [r[0] for r in changes if r[0].startswith("message:")]
        # b's WAL holds its own message only: none of a's was emitted again on b
        assert len(messages) == 1 and "from b" in messages[0], messages
        inserts = sorted(r[0] for r in changes if r[0].startswith("table public.tab_test: INSERT"))
        assert len(inserts) == 4, inserts  # a's three rows replayed, and b's own
    finally:
        await execute(b.dsn(), "SELECT pg_drop_replication_slot('probe')")
