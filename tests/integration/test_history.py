"""Bounded history on real nodes with the router running (router.conflicts.history, `[conflicts] keep`):
conflict_history rows older than keep go in batches while the links apply and decide more; a row a link
has not counted yet stays until it has; resolved quarantine entries older than keep go, pending ones
never do; /metrics counts what was pruned."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE kv (id int PRIMARY KEY, v int NOT NULL);"
KEYS = 60
KEEP = "[conflicts]\nkeep = \"2s\"\n"  # rounds every second (router.conflicts.history.prune_interval)
SMALL_BATCH = 25  # rows per DELETE here, so that a round takes several

# A stand-in for pgmesh.quarantine where init does not create it yet (its columns as init makes them)
QUARANTINE = """
CREATE TABLE IF NOT EXISTS pgmesh.quarantine (
  id bigserial PRIMARY KEY, created_at timestamptz NOT NULL DEFAULT now(),
  source text NOT NULL, source_lsn pg_lsn NOT NULL, commit_time timestamptz,
  table_name text NOT NULL, key jsonb, change_kind text NOT NULL, new_row jsonb, old_key jsonb,
  sqlstate text, message text, follows bigint, state text NOT NULL DEFAULT 'pending',
  resolved_at timestamptz)
"""
# (state, resolved_at): the first four must stay, the last two go
ENTRIES = [
    ("pending", None),
    ("pending", "now() - interval '1 hour'"),  # pending is data, whatever else it says
    ("replayed", "now() + interval '1 hour'"),  # resolved, but not for longer than keep
    ("discarded", None),
    ("replayed", "now() - interval '1 hour'"),
    ("discarded", "now() - interval '1 hour'"),
]
KEPT_ENTRIES = 4
PENDING = "SELECT id FROM pgmesh.quarantine WHERE state = 'pending' ORDER BY id"
# Rows no link counts (source zz): one from an hour ago (goes at the first round), one from the future
# (never older than keep here: stays)
MARKERS = (
    "INSERT INTO pgmesh.conflict_history (at, source, table_name, key, conflict_type, resolution, resolver,"
    " remote_origin, remote_commit_time) VALUES"
    " (now() - interval '1 hour', 'zz', 'public.kv', 'old', 'update_origin_differs', 'apply_remote',"
    " 'last_update_wins', 'zz', now()),"
    " (now() + interval '1 hour', 'zz', 'public.kv', 'future', 'update_origin_differs', 'apply_remote',"
    " 'last_update_wins', 'zz', now())"
)
# An old row of source a on b, written after the link a -> b read where its counting starts: not counted
# yet, so it must stay until the link counts again
UNCOUNTED = (
    "INSERT INTO pgmesh.conflict_history (at, source, table_name, key, conflict_type, resolution, resolver,"
    " remote_origin, remote_commit_time) VALUES (now() - interval '1 hour', 'a', 'public.kv', 'uncounted',"
    " 'update_origin_differs', 'apply_remote', 'last_update_wins', 'a', now()) RETURNING id"
)


async def count(node: Any, where: str = "true") -> int:
    return int((await fetch(node.dsn(), f"SELECT count(*) FROM pgmesh.conflict_history WHERE {where}"))[0][0])


async def updates(node: Any, round_: int) -> None:
    """Every key updated once on `node`, one transaction each."""
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        for key in range(1, KEYS + 1):
            await conn.execute("UPDATE kv SET v = %s WHERE id = %s", [round_, key])


@pytest.mark.slow
async def test_history_older_than_keep_is_pruned_in_batches_while_apply_goes_on(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, extra=KEEP)
    a, b = m.nodes
    await execute(a.dsn(), f"INSERT INTO kv SELECT g, 0 FROM generate_series(1, {KEYS}) g")
    for node in (a, b):
        await execute(node.dsn(), QUARANTINE)
        for state, resolved in ENTRIES:
            await execute(node.dsn(), "INSERT INTO pgmesh.quarantine (source, source_lsn, table_name,"
                          " change_kind, state, resolved_at) VALUES ('x', '0/1', 'public.kv', 'insert', %s,"
                          f" {resolved or 'NULL'})", params=[state])
        await execute(node.dsn(), MARKERS)
    pending = {n.name: await fetch(n.dsn(), PENDING) for n in (a, b)}
    async with running_router(m.config) as router:
        pruner = router.history
        pruner.batch_rows = SMALL_BATCH
        await wait_converged(m.nodes, ["kv"])
        link = router.appliers[("a", "b")].link
        await wait_for(lambda: link.history_at is not None, "a -> b read where its counting starts")
        (uncounted,), = await fetch(b.dsn(), UNCOUNTED)
        rounds = pruner.stats["b"].rounds
        await wait_for(lambda: pruner.stats["b"].rounds >= rounds + 2, "two rounds on b")
        assert await count(b, f"id = {uncounted}") == 1  # an hour old, but a -> b has not counted it
        assert await count(b, "key = 'old'") == 0 and await count(a, "key = 'old'") == 0
        for node in (a, b):  # the resolved entries an hour old went at the first round; the rest stays
            assert await fetch(node.dsn(), "SELECT count(*) FROM pgmesh.quarantine") == [(KEPT_ENTRIES,)]

        # Conflicts on every round (both nodes update every key while the links wait), until each node's
        # history was pruned in several batches while the links went on applying
        round_ = 0
        while min(pruner.stats[n].batches for n in "ab") < 6:
            round_ += 1
            assert round_ <= 60, pruner.stats
            await router.pause(None)
            await asyncio.gather(updates(a, round_ * 2), updates(b, round_ * 2 + 1))
            await router.resume(None)
            await wait_converged(m.nodes, ["kv"])
        assert all(applier.last_error is None for applier in router.appliers.values())

        # Once the writes stop, everything older than keep goes (the uncounted row too, now that a -> b has
        # counted it); the row from the future stays
        for node in (a, b):
            await wait_for(lambda n=node: _only_future(n), f"{node.name}'s history pruned", limit=60)
        counted = {t: sum(router.appliers[(s, t)].conflict_counts().values()) for s, t in router.appliers}
        stats = {n: pruner.stats[n] for n in "ab"}
        text = router.metrics.render()
    # Every conflict a link counted was written to its target's history, and every row pruned there was
    # counted first (or was no link's: the marker an hour old)
    assert counted["b"] == stats["b"].pruned - 1 > 100, (counted, stats)  # the uncounted row is a's: counted
    assert counted["a"] == stats["a"].pruned - 1 > 100, (counted, stats)
    for name in "ab":
        assert stats[name].capped == 0 and stats[name].quarantine_pruned == 2, stats
        assert f'pgmesh_conflict_history_pruned_total{{node="{name}"}} {float(stats[name].pruned)}' in text
        assert f'pgmesh_quarantine_pruned_total{{node="{name}"}} 2.0' in text
        assert f'pgmesh_conflict_history_rows{{node="{name}"}}' in text
    for node in (a, b):  # the pending entries, untouched
        assert await fetch(node.dsn(), PENDING) == pending[node.name]
        resolved = "SELECT state FROM pgmesh.quarantine WHERE state <> 'pending' ORDER BY id"
        assert await fetch(node.dsn(), resolved) == [("replayed",), ("discarded",)]


async def _only_future(node: Any) -> bool:
    return await fetch(node.dsn(), "SELECT key FROM pgmesh.conflict_history") == [("future",)]



# Rows no link counts, all younger than keep (written "an hour from now"): only the cap can take them
CAPPED = (
    "INSERT INTO pgmesh.conflict_history (at, source, table_name, key, conflict_type, resolution, resolver,"
    " remote_origin, remote_commit_time) SELECT now() + interval '1 hour', 'zz', 'public.kv', g::text,"
    " 'update_origin_differs', 'apply_remote', 'last_update_wins', 'zz', now() FROM generate_series(1, %s) g"
)


async def test_keep_rows_caps_each_nodes_history_oldest_first(mesh: MeshFactory,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """keep_rows: a node keeps its newest keep_rows rows whatever their age (here all younger than keep),
    in batches, with a warning that says so; a node under the cap keeps all of its rows."""
    m = await mesh(nodes=2, schema=SCHEMA, extra='[conflicts]\nkeep = "10s"\nkeep_rows = 50\n')
    a, b = m.nodes
    await execute(a.dsn(), CAPPED, params=[180])
    await execute(b.dsn(), CAPPED, params=[30])  # under the cap: nothing goes
    async with running_router(m.config) as router:
        pruner = router.history
        pruner.batch_rows = 40
        await wait_for(lambda: pruner.stats["a"].capped == 130, "a's history capped")
        await wait_for(lambda: pruner.stats["b"].rounds >= 1, "a round on b")
    kept = "SELECT min(key::int), max(key::int), count(*) FROM pgmesh.conflict_history"
    assert await fetch(a.dsn(), kept) == [(131, 180, 50)]  # the newest 50
    assert await count(b) == 30 and pruner.stats["b"].pruned == 0
    assert pruner.stats["a"].batches == 4  # 40 + 40 + 40 + 10
    warned = [r.getMessage() for r in caplog.records if "keep_rows" in r.getMessage()]
    assert len(warned) == 1, warned
    assert warned[0].startswith("node a: pgmesh.conflict_history holds more than [conflicts] keep_rows = 50"
                                " rows: the oldest 130 pruned although younger than keep = 10s"), warned
