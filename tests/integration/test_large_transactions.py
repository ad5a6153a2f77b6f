"""Large transactions through the whole router: spilled to disk past the memory bound, applied in parts
with COPY, and conflicts met by COPY decided like any other.

1. A 300,000-row transaction on A, with `replication.spill_mb = 1` and A decoding with
   logical_decoding_work_mem = 64kB (so the server streams it in progress): the router keeps at most
   about 1 MB of it in memory per transaction, writes the rest to its spool, applies it to B in parts
   (COPY) and deletes the spool file. B ends with A's rows.
2. Two 1,000-row transactions on A whose keys include one B inserted on its own meanwhile: into a table
   without tombstones (COPY meets the key: unique violation) and into one with tombstones (COPY is not
   used: the guarded INSERT meets it). Both are decided on the careful path, recorded in
   pgmesh.conflict_history, and the nodes converge.
3. A large transaction with DDL applied on the large path while it still arrives (issue 17):
   tests/integration/test_fail_points.py (fail point source.spilling).
"""

from __future__ import annotations

from router.testing.mesh import (
    NODE_SETTINGS,
    execute,
    fetch,
    peak_rss_kb,
    reset_peak_rss,
    running_router,
    wait_converged,
    wait_for,
)
from tests.fix_mesh import MeshFactory

ROWS = 300_000
SCHEMA = """
CREATE TABLE big (id int PRIMARY KEY, v text);
CREATE TABLE plain (id int PRIMARY KEY, v text);
CREATE TABLE marked (id int PRIMARY KEY, v text);
"""
# A decodes with logical_decoding_work_mem = 64kB: the server streams the big transaction in progress.
STREAMED = {**NODE_SETTINGS, "logical_decoding_work_mem": "64kB"}


async def test_transaction_larger_than_the_memory_bound(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, settings=STREAMED, replication="spill_mb = 1")
    nodes, config = m.nodes, m.config
    a, b = nodes
    async with running_router(config) as router:
        before = reset_peak_rss()
        await execute(a.dsn(), "INSERT INTO big SELECT i, 'row number ' || i"
                               f" FROM generate_series(1, {ROWS}) AS i")
        await wait_converged(nodes, ["big"], limit=240)
        grew_mb = (peak_rss_kb() - before) / 1024
        applier = router.appliers[("a", "b")]
        stats = applier.stats
        assert stats.copied_transactions >= 1 and stats.copied_rows > ROWS * 0.9  # short runs: INSERT
        source = router.pumps["a"].source
        assert source.stats.spills > 0, "nothing spilled"
        assert source.stats.raw_inserts > ROWS // 2  # to disk and into COPY undecoded
        assert source.stats.spill_peak_bytes <= (1 << 20) + 64 * 1024  # the bound, plus one message at most
        # the router's log holds a spilled transaction's file until every target's flushed position (read
        # at the next progress tick) passes it (router.stream.log.store): released then, not kept
        await wait_for(lambda: router.spool.files == 0, "the spool file released after its transaction", 30)
    (count,) = await fetch(b.dsn(), "SELECT count(*) FROM big")
    assert count[0] == ROWS
    print(f"peak RSS grew by {grew_mb:.0f} MB")  # reported, not asserted: see the closing note


async def test_copy_meets_a_conflict(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    nodes, config = m.nodes, m.config
    a, b = nodes
    async with running_router(config):
        # a tombstone for `marked` on both nodes
        await execute(a.dsn(), "INSERT INTO marked VALUES (5000, 'gone soon')")
        await wait_converged(nodes, ["marked"])
        await execute(b.dsn(), "DELETE FROM marked WHERE id = 5000")
        await wait_converged(nodes, ["marked"])
    await execute(b.dsn(), "INSERT INTO plain VALUES (500, 'b'); INSERT INTO marked VALUES (500, 'b')")
    await execute(a.dsn(), "INSERT INTO plain SELECT i, 'a' FROM generate_series(1, 1000) AS i",
                  "INSERT INTO marked SELECT i, 'a' FROM generate_series(1, 1000) AS i")
    async with running_router(config) as router:
        await wait_converged(nodes, ["plain", "marked"])
        applier = router.appliers[("a", "b")]
        # (counted once the applier has the commit's answer, which may come after the rows show)
        await wait_for(lambda: applier.stats.conflicts >= 2, "a -> b to count both conflicts")
    for node in nodes:
        rows = await fetch(node.dsn(), "SELECT table_name, conflict_type FROM pgmesh.conflict_history"
                                       " WHERE conflict_type = 'insert_exists' ORDER BY 1")
        assert {r[0] for r in rows} == {"public.plain", "public.marked"}, rows
    (row,) = await fetch(b.dsn(), "SELECT v FROM plain WHERE id = 500")
    assert row[0] == "a"  # A's insert committed later: last update wins, on both nodes


async def test_copy_kept_with_tombstones(mesh: MeshFactory) -> None:
    """A table with (fewer) tombstones than a big insert has rows keeps COPY: the tombstones' keys are
    looked up after it; when one is among the rows, the COPY is undone and guarded INSERTs decide."""
    m = await mesh(nodes=2, schema=SCHEMA)
    nodes, config = m.nodes, m.config
    a, b = nodes
    async with running_router(config) as router:
        await execute(a.dsn(), "INSERT INTO marked SELECT i, 'x' FROM generate_series(5000, 5009) AS i")
        await wait_converged(nodes, ["marked"])
        await execute(b.dsn(), "DELETE FROM marked WHERE id >= 5000")  # ten tombstones on each node
        await wait_converged(nodes, ["marked"])
        applier = router.appliers[("a", "b")]
        before = applier.stats.copied_rows
        await execute(a.dsn(), "INSERT INTO marked SELECT i, 'a' FROM generate_series(1, 1000) AS i")
        await wait_converged(nodes, ["marked"])
        assert applier.stats.copied_rows - before == 1000  # COPY, not row-by-row guarded INSERTs
        # a key with a tombstone among the rows: a's insert is newer than b's delete and wins
        copied = applier.stats.copied_rows
        await execute(a.dsn(), "INSERT INTO marked SELECT i, 'a' FROM generate_series(4500, 5004) AS i")
        await wait_converged(nodes, ["marked"])
        assert applier.stats.copied_rows == copied  # undone: the guarded INSERTs decided
    (count,) = await fetch(b.dsn(), "SELECT count(*) FROM marked WHERE id BETWEEN 5000 AND 5004")
    assert count[0] == 5
