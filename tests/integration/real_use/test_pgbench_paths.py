"""pgbench as users run it on a pgmesh cluster, three nodes and a router process: without `-n` each run
starts with `TRUNCATE pgbench_history`, which pgmesh replicates and decides by version (a table
tombstone): the rows older than the TRUNCATE go on every node, newer ones stay on every node.

Each node is initialised with `pgbench -i -s 1` before `pgmesh init` (pgbench_history has no key: init
makes it REPLICA IDENTITY FULL). To know which rows must remain, the tests add an observer that pgbench
does not see: local-only triggers (they fire for the application's sessions, not for the router's) copy
each pgbench_history insert and each TRUNCATE into two keyed tables, `seen_rows` and `seen_truncates`,
which replicate like any table. A replicated row keeps its source's commit time on every node, so the
rows that must stay are exactly those committed after the last TRUNCATE, on any node's clock.

Owns: those scripted paths, each ending in `wait_identical` (every table, the keyless one included, the
same on every node) and an exact count.
Must not: sleep for a fixed time, or reach into the router's objects (only its CLI and its log).
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

from router.testing.mesh import fetch, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.real_use.users import (
    RouterProcess,
    pgbench,
    pgbench_async,
    pgmesh,
    psql,
    wait_identical,
)

# The observer: fires only in the application's sessions (ENABLE ORIGIN, the default), so each row is
# written once, on the node where pgbench committed it, in pgbench's own transaction (same commit time)
OBSERVER = """
CREATE TABLE seen_rows (port int, xid bigint, PRIMARY KEY (port, xid));
CREATE TABLE seen_truncates (port int, xid bigint, PRIMARY KEY (port, xid));
CREATE FUNCTION seen_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO seen_rows VALUES (inet_server_port(), txid_current()) ON CONFLICT DO NOTHING;
  RETURN NULL;
END $$;
CREATE FUNCTION seen_truncate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO seen_truncates VALUES (inet_server_port(), txid_current()) ON CONFLICT DO NOTHING;
  RETURN NULL;
END $$;
CREATE TRIGGER seen_row AFTER INSERT ON pgbench_history FOR EACH ROW EXECUTE FUNCTION seen_row();
CREATE TRIGGER seen_truncate AFTER TRUNCATE ON pgbench_history FOR EACH STATEMENT
  EXECUTE FUNCTION seen_truncate();
"""

# The rows committed after every TRUNCATE (on the source's clock: the commit time travels with the row)
SHOULD_STAY = """
SELECT count(*) FROM seen_rows r
 WHERE pg_xact_commit_timestamp(r.xmin) > (SELECT coalesce(max(pg_xact_commit_timestamp(t.xmin)), '-infinity')
                                             FROM seen_truncates t)
"""
HISTORY = "SELECT count(*) FROM pgbench_history"


def _processed(done: Any) -> int:
    found = re.search(r"number of transactions actually processed: (\d+)", done.stdout)
    assert found, done.stdout + done.stderr
    return int(found.group(1))


def _streaming(config: Path) -> bool:
    links = json.loads(pgmesh(config, "status", "--json", check=True).stdout)["links"]
    return bool(links) and all(lk["state"] == "streaming" and not lk["last_error"] for lk in links)


async def _pgbench_cluster(mesh: MeshFactory, tmp_path: Path) -> tuple[Any, RouterProcess, Path]:
    """Three nodes, each `pgbench -i -s 1` and the observer, `pgmesh init`, a router running."""
    made = await mesh(nodes=3, init=False)
    for node in made.nodes:
        pgbench(node, "-i", "-s", "1", "-q")
        psql(node, OBSERVER)
    pgmesh(made.write_config(tmp_path / "init.toml"), "init", check=True)
    router = RouterProcess(tmp_path, made)
    router.start()
    config = tmp_path / "r.toml"
    await wait_for(lambda: _streaming(config), "every link streaming", 60)
    return made, router, config


async def _counts(nodes: Any, query: str) -> list[int]:
    return [int((await fetch(n.dsn(), query))[0][0]) for n in nodes]


async def test_pgbench_without_n_on_three_nodes_at_once(mesh: MeshFactory, tmp_path: Path) -> None:
    """`pgbench -c 2 -T 30` (no `-n`: each run TRUNCATEs pgbench_history first) started on three nodes at
    once. Each node's TRUNCATE reaches the others while they already insert: it removes only the rows
    older than it. Every table ends identical on every node, pgbench_history holds exactly the rows
    committed after the last TRUNCATE (none lost), and `pgmesh compare` agrees."""
    made, router, config = await _pgbench_cluster(mesh, tmp_path)
    try:
        runs = await asyncio.gather(*(pgbench_async(n, "-c", "2", "-T", "30") for n in made.nodes))
        committed = sum(_processed(done) for done in runs)

        async def settled() -> bool:  # everything arrived, and every late older row was swept
            return (await _counts(made.nodes, "SELECT count(*) FROM seen_rows") == [committed] * 3
                    and await _counts(made.nodes, HISTORY) == await _counts(made.nodes, SHOULD_STAY))

        await wait_for(settled, "every row everywhere, none older than the last TRUNCATE", 120)
        await wait_identical(made.nodes)
        # every transaction pgbench counted is seen once (the observer replicated)
        assert await _counts(made.nodes, "SELECT count(*) FROM seen_rows") == [committed] * 3
        assert await _counts(made.nodes, "SELECT count(*) FROM seen_truncates") == [3] * 3
        stay = await _counts(made.nodes, SHOULD_STAY)
        assert stay[0] > 0 and stay == [stay[0]] * 3, stay
        assert await _counts(made.nodes, HISTORY) == stay, (committed, stay)
        compared = pgmesh(config, "compare")
        assert compared.returncode == 0, compared.stdout[-3000:] + compared.stderr[-3000:]
        # the four pgbench tables (pgbench_history keyless: as a multiset) and the observer's two
        out = compared.stdout
        assert "compared 6 table(s)" in out and " 0 difference(s)" in out, out
        assert "Traceback" not in router.output()
    finally:
        await router.stop()


async def test_a_truncate_reaching_a_node_after_a_newer_insert(mesh: MeshFactory, tmp_path: Path) -> None:
    """Links held (`pgmesh pause`): c inserts a history row, then a runs `pgbench -t 1` (its TRUNCATE, then
    one transaction), then b inserts a row. On resume a's TRUNCATE reaches b after b's newer insert and c
    after c's older one: b's row stays everywhere, c's goes everywhere (on a, where it arrives after the
    TRUNCATE, it is removed and recorded as `write_truncated`), and pgbench's own row stays."""
    made, router, config = await _pgbench_cluster(mesh, tmp_path)
    a, b, c = made.nodes
    row = "INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES ({}, 1, 1, 0, now())"
    try:
        pgmesh(config, "pause", check=True)
        psql(c, row.format(1003))  # older than the TRUNCATE
        pgbench(a, "-t", "1")  # TRUNCATE pgbench_history, then one transaction
        psql(b, row.format(1002))  # newer than the TRUNCATE
        pgmesh(config, "resume", check=True)
        lost = ("SELECT source, resolution FROM pgmesh.conflict_history"
                " WHERE conflict_type = 'write_truncated'")
        # c's row reaches a after a's TRUNCATE: removed there, and recorded (before that, a and b may look
        # alike already: wait for it, not for the rows)
        await wait_for(lambda: _has(a, lost, [("c", "keep_local")]), "c's older row removed on a", 60)
        await wait_identical(made.nodes)
        tids = "SELECT tid FROM pgbench_history ORDER BY tid"
        kept = await fetch(a.dsn(), tids)
        assert len(kept) == 2 and (1002,) in kept and (1003,) not in kept, kept
        for node in (b, c):
            assert await fetch(node.dsn(), tids) == kept
        assert await _counts(made.nodes, HISTORY) == await _counts(made.nodes, SHOULD_STAY)
        newer = "SELECT count(*) FROM pgmesh.conflict_history WHERE conflict_type = 'truncate_newer_rows'"
        assert await fetch(b.dsn(), newer) == [(1,)]
    finally:
        await router.stop()


async def _has(node: Any, query: str, want: Any) -> bool:
    return await fetch(node.dsn(), query) == want
