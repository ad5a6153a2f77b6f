"""`pgmesh repair` (router.ops.compare.repair over router.cluster.compare.fix) on a real 3-node mesh with
the router running: the winner of each differing key decided by the conflict path's versions, tombstones
included.

Divergences are made on purpose in sessions whose changes replication does not carry (a replication origin
of their own). A deletion that leaves a tombstone is run as the router's own deletes are (replica role:
the tombstone trigger records it, with the deleting transaction's version); one without is a deletion
pgmesh never saw. Keys:

- 10: changed on b, then deleted on a (a's tombstone is newer): deleted everywhere, not resurrected;
- 20: deleted on a, then changed on b (a's tombstone is older): b's row everywhere;
- 5000: inserted on b only, never deleted anywhere: copied to a and c;
- 40: deleted on c with no record of it: copied back, with a run-time hint naming `--from c`.
"""

from __future__ import annotations

import asyncio
import io
from typing import Any

import psycopg
import pytest

from router.ops.cli import main as pgmesh
from router.ops.compare.job import compare_cluster
from router.ops.compare.repair import repair_cluster
from router.testing.mesh import execute, fetch, free_port, running_router, wait_converged
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE t (id bigint PRIMARY KEY, v text NOT NULL)"


async def unreplicated(node: Any, *statements: str, tombstone: bool = False) -> None:
    """Run `statements` on `node` in one transaction the router does not carry; `tombstone`: as a
    replicated change is applied (replica role), so a deletion is recorded in pgmesh.tombstones."""
    async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
        await conn.execute("SELECT pg_replication_origin_create('test_local') WHERE NOT EXISTS"
                           " (SELECT 1 FROM pg_replication_origin WHERE roname = 'test_local')")
        await conn.execute("SELECT pg_replication_origin_session_setup('test_local')")
        async with conn.transaction():
            if tombstone:
                await conn.execute("SET LOCAL session_replication_role = replica")
            for statement in statements:
                await conn.execute(statement.encode())


async def rows(node: Any) -> dict[int, str]:
    got = await fetch(node.dsn(), "SELECT id, v FROM t WHERE id IN (10, 20, 40, 5000)")
    return {int(i): str(v) for i, v in got}


async def test_repair_keeps_newer_deletions_and_copies_rows_never_deleted(
    mesh: MeshFactory, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, admin_port=free_port())
    a, b, c = m.nodes
    async with running_router(m.config):
        await execute(a.dsn(), "INSERT INTO t SELECT g, 'row ' || g FROM generate_series(1, 2000) g")
        await wait_converged(m.nodes, ["t"])
        await unreplicated(b, "UPDATE t SET v = 'b changed it' WHERE id = 10")
        await unreplicated(a, "DELETE FROM t WHERE id IN (10, 20)", tombstone=True)
        tombs = await fetch(a.dsn(), "SELECT key FROM pgmesh.tombstones WHERE table_name = 'public.t'")
        assert sorted(k[0] for k in tombs) == [["10"], ["20"]]
        await unreplicated(b, "UPDATE t SET v = 'b changed it after' WHERE id = 20",
                           "INSERT INTO t VALUES (5000, 'only on b')")
        await unreplicated(c, "DELETE FROM t WHERE id = 40")
        before = [await rows(n) for n in m.nodes]

        # --dry-run: the plan, nothing written (as the CLI runs it: progress on stderr, the plan on stdout)
        path = tmp_path / "config.toml"
        path.write_text(m.config_text())
        code = await asyncio.to_thread(pgmesh, ["repair", "--config", str(path), "--dry-run"])
        printed = capsys.readouterr()
        assert code == 1 and "plan (dry run: nothing written):" in printed.out, printed.out
        assert "keys decided" in printed.err and "hint:" in printed.err, printed.err
        out = io.StringIO()
        plan = await repair_cluster(m.config, dry_run=True, progress=out)
        assert plan.dry_run and plan.fixes == [] and plan.exit_code == 1, plan.render()
        assert [p.table for p in plan.plans] == ["public.t"] and plan.plans[0].keys == 4, plan.render()
        # (40: a's and b's rows are one version: the first node in order gives it)
        assert plan.plans[0].winners == {"a": 1, "a (deleted)": 1, "b": 2}, plan.render()
        nodes = {n: (p.insert, p.update, p.delete) for n, p in plan.plans[0].nodes.items()}
        assert nodes == {"a": (2, 0, 0), "b": (0, 0, 1), "c": (2, 1, 1)}, plan.render()
        assert "--from c" in out.getvalue() and "plan (dry run: nothing written)" in plan.render()
        assert "--from a" not in out.getvalue()  # 5000 lacks on a and c: no single node's absence
        assert [await rows(n) for n in m.nodes] == before
        for node in m.nodes:
            history = await fetch(node.dsn(), "SELECT 1 FROM pgmesh.conflict_history WHERE source = 'repair'")
            assert history == [], node.name

        out = io.StringIO()
        repaired = await repair_cluster(m.config, progress=out)
        assert repaired.exit_code == 0, repaired.render()
        by_key = {f.key: f for f in repaired.fixes}
        assert by_key["(10)"].winner == "a" and sorted(by_key["(10)"].written) == ["b", "c"]
        assert by_key["(20)"].winner == "b" and sorted(by_key["(20)"].written) == ["a", "c"]
        assert by_key["(40)"].winner == "a"
        assert sorted(by_key["(5000)"].written) == ["a", "c"] and by_key["(40)"].written == ["c"]
        printed = out.getvalue()
        assert "4/4 keys decided" in printed or "4 keys decided" in printed, printed
        assert "hint:" in printed and "missing on c only" in printed and "--from c" in printed, printed
        expected = {20: "b changed it after", 40: "row 40", 5000: "only on b"}
        for node in m.nodes:
            assert await rows(node) == expected, node.name  # 10 stays deleted
        again = await compare_cluster(m.config)
        assert again.differences == [] and again.exit_code == 0, again.render()
        for node in m.nodes:  # every fix recorded where it was written
            got = await fetch(node.dsn(), "SELECT key, resolution FROM pgmesh.conflict_history"
                              " WHERE source = 'repair'")
            fixed = {f.key for f in repaired.fixes if node.name in f.written}
            assert {k for k, _ in got} == fixed, node.name
        # b and c hold a tombstone of 10 now, with a's deletion as its version: a later stale write loses
        for node in (b, c):
            tomb = await fetch(node.dsn(), "SELECT 1 FROM pgmesh.tombstones WHERE table_name = 'public.t'"
                               " AND key = ARRAY['10']")
            assert tomb == [(1,)], node.name
        # a later write anywhere still replicates over the repaired rows
        await execute(c.dsn(), "UPDATE t SET v = 'after repair' WHERE id IN (20, 5000)")
        await wait_converged(m.nodes, ["t"])
