"""What PostgreSQL 16+ changes for the router, tested on whichever version the nodes run (issue 19).

1. A commit record right after a non-transactional logical message: the message carries the end of its
   record, the commit starts there (same LSN). On 16+ every applier batch ends with such a message
   (`pgmesh.applied`, router.apply.link.LinkSession.applied_note); the source took the next commit on
   the node for one sent again and dropped it (rows missing on every other node, every link
   streaming). Here a client emits the message itself inside its transactions, on any version.
"""

from __future__ import annotations

import psycopg

from router.testing.mesh import fetch, running_router, wait_converged
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE t (id int PRIMARY KEY, v text)"
ROUNDS = 20


async def test_a_commit_right_after_a_non_transactional_message_is_replicated(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config):
        async with await psycopg.AsyncConnection.connect(a.dsn(), autocommit=True) as conn:
            for i in range(ROUNDS):
                async with conn.transaction():
                    await conn.execute("INSERT INTO t VALUES (%s, 'a')", [i])
                    # its record ends where the COMMIT's begins: the commit's LSN is the message's
                    await conn.execute("SELECT pg_logical_emit_message(false, 'pgmesh.test', 'x')")
        await wait_converged(m.nodes, ["t"], limit=60)
    assert await fetch(b.dsn(), "SELECT count(*) FROM t") == [(ROUNDS,)]
