"""A large plain transaction is applied while it still arrives, and a lost one is applied once.

The server decodes a plain (not streamed: logical_decoding_work_mem is large here) transaction after its
commit and sends it Begin .. Commit; past `replication.spill_mb` the router writes it to its spool and
hands it to the appliers at its first spill, before the Commit arrives (router.stream.source `early_spilled`).
Each applier applies it part by part as the file grows and commits once the Commit is there.

1. Three nodes: a 200,000-row transaction on A reaches B and C whole; both links began applying it
   before its commit arrived; the spool is empty afterwards. A second transaction right behind it,
   touching one of its rows, lands after it (source commit order).
2. A transaction lost by the source before its commit arrived (a's walsender terminated while the
   router receives it) is applied once: tests/integration/test_fail_points.py (fail point
   source.spilling).
"""

from __future__ import annotations

import pytest

from router.apply import parts as large_apply
from router.testing.mesh import (
    NODE_SETTINGS,
    execute,
    fetch,
    running_router,
    wait_converged,
    wait_for,
)
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE big (id int PRIMARY KEY, v text);"
# The server must not stream these transactions in progress: decoded after their commit, whole.
SETTINGS = {**NODE_SETTINGS, "logical_decoding_work_mem": "1GB"}


async def test_plain_transaction_is_applied_while_it_arrives(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, settings=SETTINGS, replication="spill_mb = 1")
    nodes, config = m.nodes, m.config
    a, b, c = nodes
    async with running_router(config) as router:
        await execute(
            a.dsn(),
            "INSERT INTO big SELECT i, 'row ' || i FROM generate_series(1, 200000) AS i",
            "UPDATE big SET v = 'after' WHERE id = 7",
        )
        await wait_converged(nodes, ["big"], limit=240)
        assert router.pumps["a"].source.stats.early_transactions >= 1
        for target in ("b", "c"):
            applier = router.appliers[("a", target)]
            assert applier.stats.early_transactions >= 1, f"a -> {target} waited for the commit"
            assert applier.stats.abandoned_transactions == 0
        await wait_for(lambda: router.spool.files == 0, "the spool file to go")
    for node in (b, c):
        (row,) = await fetch(node.dsn(), "SELECT count(*), max(v) FILTER (WHERE id = 7) FROM big")
        assert row == (200000, "after")


async def test_conflict_inside_a_transaction_applied_early(
    mesh: MeshFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B holds one key of A's big transaction (written while the router was stopped): the COPY of an
    early part meets it, the link waits for the whole transaction and decides it on the careful path
    (row by row: hence a smaller transaction, and smaller parts so that some go in before the commit)."""
    monkeypatch.setattr(large_apply, "LARGE_PART_CHANGES", 1000)
    m = await mesh(nodes=2, schema=SCHEMA, settings=SETTINGS, replication="spill_mb = 1")
    nodes, config = m.nodes, m.config
    a, b = nodes
    await execute(b.dsn(), "INSERT INTO big VALUES (2000, 'b')")
    # ~220 bytes a row: the 1 MB bound is passed after ~4,700 rows
    await execute(a.dsn(), "INSERT INTO big SELECT i, repeat('x', 200) || i"
                           " FROM generate_series(1, 8000) AS i")
    async with running_router(config) as router:
        await wait_converged(nodes, ["big"], limit=240)
        applier = router.appliers[("a", "b")]
        assert applier.stats.conflicts >= 1
        print(f"early: {router.pumps['a'].source.stats.early_transactions}, applied early: "
              f"{applier.stats.early_transactions}")
        await wait_for(lambda: router.spool.files == 0, "the spool file to go")
    for node in nodes:
        rows = await fetch(node.dsn(), "SELECT count(*) FROM pgmesh.conflict_history"
                                       " WHERE conflict_type = 'insert_exists'")
        assert rows[0][0] >= 1
    (row,) = await fetch(b.dsn(), "SELECT count(*), max(v) FILTER (WHERE id = 2000) FROM big")
    assert row == (8000, "x" * 200 + "2000")  # A's insert committed later: last update wins
