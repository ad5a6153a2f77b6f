"""PostgreSQL's 020_messages.pl ported to a two-node pgmesh mesh with the router running (issue 17).

The original reads pgoutput's stream for logical decoding messages (pg_logical_emit_message). pgmesh
asks for them (its DDL travels as messages with prefix `pgmesh.ddl`); a user's message, transactional or
not, is read and not replayed: it is not emitted again on the other nodes, and the rows of its
transaction are. A probe slot (test_decoding) on b shows what b's WAL gets: on PostgreSQL 16+ also
the `pgmesh.applied` notes b's applier writes after what it applied (no echoes there, docs/conflicts.md).
"""

from __future__ import annotations

from protocol.lsn import datetime_to_pg_us
from router.testing.mesh import execute, fetch, running_router, wait_for
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
            ((version,),) = await fetch(b.dsn(), "SELECT current_setting('server_version_num')::int")
            last = "SELECT pg_xact_commit_timestamp(xmin) FROM tab_test WHERE a = 4"  # a's last commit
            ((when,),) = await fetch(a.dsn(), last)
            if version >= 160000:  # the note of it (below) has come back in b's stream
                pump = router.pumps["b"]
                await wait_for(lambda: dict(pump.seen.snapshot).get("a", 0) >= datetime_to_pg_us(when),
                               "b's seen vector to hold a's last commit")
            healthy(router)
        changes = await fetch(b.dsn(), "SELECT data FROM pg_logical_slot_get_changes('probe', NULL, NULL)")
        messages = [r[0] for r in changes if r[0].startswith("message:")]
        notes = [x for x in messages if " prefix: pgmesh.applied," in x]
        # b's WAL holds its own message only: none of a's was emitted again on b
        own = [x for x in messages if x not in notes]
        assert len(own) == 1 and "from b" in own[0], messages
        if version >= 160000:
            # and, on 16+ (origin 'none'), the notes of b's applier: non-transactional, each naming a
            # and the newest commit time of a's applied there so far, the last one a's last commit
            assert notes and all(x.startswith("message: transactional: 0 ") for x in notes), messages
            assert notes[-1].endswith(f" content:a|{datetime_to_pg_us(when)}"), (notes, when)
        else:
            assert notes == [], messages
        inserts = sorted(r[0] for r in changes if r[0].startswith("table public.tab_test: INSERT"))
        assert len(inserts) == 4, inserts  # a's three rows replayed, and b's own
    finally:
        await execute(b.dsn(), "SELECT pg_drop_replication_slot('probe')")
