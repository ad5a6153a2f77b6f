"""A streamed transaction that deletes and updates another node's rows, applied ahead of its commit.

Found by the property test (seed 825479013, three nodes): node c's large prepared transaction deleted a
row and updated another that node b had written; a and b kept theirs, c had its own. The server streams
a transaction in progress (here once it outgrows 64 kB), and the router's side session applies it on
each target before its commit (router.apply.side), when its commit time is not known yet. Its keyed
changes that met another node's row were decided there by the decision functions, against a remote
commit time of zero (2000-01-01, LSN 0/0 in pgmesh.conflict_history): the local row won, the change was
dropped, and the side session committed the rest under the source's real commit time. A conflict must
instead stop the side session, so that the transaction is decided at its commit, with its commit time.

The same for a transaction committed plainly and for one prepared (PREPARE TRANSACTION, then COMMIT
PREPARED: the slot has no two-phase decoding, so the server sends it at COMMIT PREPARED, streamed).
"""

from __future__ import annotations

import psycopg
import pytest

from router.apply import parts as large_apply
from router.testing.mesh import NODE_SETTINGS, execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.test_early_stream import side_started

SCHEMA = "CREATE TABLE big (id int PRIMARY KEY, v text);"
SETTINGS = {**NODE_SETTINGS, "logical_decoding_work_mem": "64kB", "max_prepared_transactions": "4"}
ROWS = 60_000
BIG = f"INSERT INTO big SELECT i, repeat('x', 40) || i FROM generate_series(1, {ROWS}) AS i"


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of 5,000 changes: the side session starts after the first spill, not the third."""
    monkeypatch.setattr(large_apply, "LARGE_PART_CHANGES", 5000)


@pytest.mark.parametrize("end", ["commit", "prepare"])
async def test_streamed_change_to_another_nodes_row_wins_everywhere(mesh: MeshFactory, end: str) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, settings=SETTINGS, replication="spill_mb = 1")
    nodes, config = m.nodes, m.config
    a, b = nodes
    async with running_router(config) as router:
        await execute(b.dsn(), "INSERT INTO big VALUES (-1, 'from b'), (0, 'from b')")
        await wait_converged(nodes, ["big"])
        async with await psycopg.AsyncConnection.connect(a.dsn(), autocommit=True) as writer:
            await writer.execute("BEGIN")
            await writer.execute(BIG)
            await side_started(router, [b])
            # b's rows, changed by a after a had them: sequential, a's changes win on every node
            await writer.execute("DELETE FROM big WHERE id = 0")
            await writer.execute("UPDATE big SET v = 'from a' WHERE id = -1")
            if end == "prepare":
                await writer.execute("PREPARE TRANSACTION 'pgmesh test'")
                await writer.execute("COMMIT PREPARED 'pgmesh test'")
            else:
                await writer.execute("COMMIT")
        # a's transaction is on b once its rows are (one target transaction, whichever session applied it)
        await wait_for(lambda: has_rows(b.dsn(), ROWS), "a's transaction on b", limit=240)
        rows = await fetch(b.dsn(), "SELECT id, v FROM big WHERE id <= 0 ORDER BY id")
        history = await fetch(b.dsn(), "SELECT key, conflict_type, resolution, remote_commit_time::text"
                                       " FROM pgmesh.conflict_history ORDER BY id")
        assert rows == [(-1, "from a")], history
        # no decision was taken without the transaction's commit time (zero: 2000-01-01)
        assert all(when > "2001" for *_, when in history), history
        await wait_converged(nodes, ["big"])
        await wait_for(lambda: router.spool.files == 0, "the spool file to go")


async def has_rows(dsn: str, wanted: int) -> bool:
    return (await fetch(dsn, "SELECT count(*) FROM big WHERE id > 0"))[0][0] == wanted
