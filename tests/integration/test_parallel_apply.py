"""Apply of a backlog with transactions that share keys, in lanes (replication.apply_lanes = 2) and in one
session with the next batch built while the last one runs (apply_lanes = 1): same rows, source order.

A backlog is written on A while the router is stopped: independent inserts interleaved with a chain of
updates of one row (each its own transaction), transactions touching two keys already in different
lanes, a unique value moved from one row to another, and deletes. B must end with A's rows, the chain's
counter must be exactly its length (no update lost or applied twice), and B must have committed the
transactions in A's commit order: a test_decoding slot on B, created before the router starts, lists
B's commits in order, and the `seq` values of the `log` rows (one per source transaction, increasing in
A's commit order) must come out increasing. B also writes a row whose key one of A's inserts takes: that
batch meets a conflict in its middle (the careful path decides it; what was built ahead is thrown away).
"""

from __future__ import annotations

import re

import pytest

from router.testing.mesh import (
    execute,
    fetch,
    running_router,
    wait_converged,
    wait_for,
)
from tests.fix_mesh import MeshFactory

SCHEMA = """
CREATE TABLE kv (id int PRIMARY KEY, v int NOT NULL, u text UNIQUE);
CREATE TABLE log (seq int PRIMARY KEY, what text);
"""


def _backlog() -> list[str]:
    """One SQL transaction per item; each also logs its position in A's commit order."""
    out: list[str] = ["INSERT INTO kv VALUES (1, 0, 'one'), (2, 0, 'two')"]
    for i in range(300):
        if i % 3 == 0:
            out.append("UPDATE kv SET v = v + 1 WHERE id = 1")  # a chain on one key
        elif i % 3 == 1:
            out.append(f"INSERT INTO kv VALUES ({1000 + i}, {i}, 'u{i}')")  # independent
        else:
            out.append(f"UPDATE kv SET v = v + 1 WHERE id IN (1, {1000 + i - 1})")  # two keys, two lanes
        if i % 50 == 49:
            # a unique value moves: the row holding it gives it up, then another row takes it
            out.append(f"UPDATE kv SET u = 'moved{i}' WHERE id = {1000 + i - 2 - (i - 2) % 3 + 1}")
            out.append(f"DELETE FROM kv WHERE id = {1000 + i - 5 - (i - 5) % 3 + 1}")
    return [f"BEGIN; {statement}; INSERT INTO log VALUES ({seq}, 'x'); COMMIT;"
            for seq, statement in enumerate(out, 1)]


@pytest.mark.parametrize(("lanes", "transport"), [(1, "script"), (1, "pipeline"), (2, "pipeline")])
async def test_backlog_keeps_rows_and_source_order(mesh: MeshFactory, lanes: int, transport: str) -> None:
    two = await mesh(nodes=2, schema=SCHEMA,
                     replication=f'apply_lanes = {lanes}\napply_transport = "{transport}"')
    nodes, config = two.nodes, two.config
    a, b = nodes
    await execute(b.dsn(), "SELECT pg_create_logical_replication_slot('order_check', 'test_decoding')")
    scripts = _backlog()
    await execute(a.dsn(), *scripts)
    await execute(b.dsn(), "INSERT INTO kv VALUES (1004, -1, 'b-side')")  # A inserts 1004 too
    async with running_router(config) as router:
        await wait_converged(nodes, ["kv", "log"])
        applier = router.appliers[("a", "b")]
        await wait_for(lambda: applier.pending == 0, "the link a -> b to drain")
        assert applier.stats.conflicts + router.appliers[("b", "a")].stats.conflicts > 0
        if lanes > 1:
            assert applier.stats.parallel_batches > 0, "the lanes never ran"
            assert applier.stats.parallel_transactions > 0
        elif transport == "script":
            assert applier.stats.scripts_ahead > 0, "no script was built ahead"
        else:  # the pipe took the small transactions, each encoded once
            assert applier.encoder.encodes > 0 and applier.link.pipe is not None, "the pipe never ran"
    (chain,) = await fetch(b.dsn(), "SELECT v FROM kv WHERE id = 1")
    assert chain[0] == 200  # 100 updates of the chain, 100 of the two-key transactions
    rows = await fetch(b.dsn(), "SELECT data FROM pg_logical_slot_get_changes('order_check', NULL, NULL)")
    seqs = [int(m.group(1)) for (data,) in rows
            if (m := re.search(r"table public\.log: INSERT: seq\[integer\]:(\d+)", data))]
    assert len(seqs) == len(scripts)
    assert seqs == sorted(seqs), "B committed A's transactions out of order"
