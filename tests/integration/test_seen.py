"""`Transaction.seen` over real nodes: what a source had applied from the others, read from its echoes.

A writes a row, the router applies it on B, then B updates the row (sequential, not concurrent) and C
updates it after both reached C. The transactions of B and C handed to their links carry the commit
times of the versions they wrote on top of, exactly as the local rows on the targets carry them
(`pg_xact_commit_timestamp_origin(xmin)`), so `router.conflicts.causality.sequential` calls them
sequential; a write made on B before A's version reached it carries nothing of A's.
"""

from __future__ import annotations

from typing import Any

from protocol.lsn import datetime_to_pg_us
from protocol.transactions import Transaction
from router.apply.applier import Applier
from router.conflicts.causality import sequential
from router.testing.mesh import execute, fetch, running_router, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE t (id int PRIMARY KEY, v text)"


async def commit_time(node: Any, key: int) -> int:
    """The local row's version time on `node` (µs since 2000-01-01)."""
    sql = "SELECT (pg_xact_commit_timestamp_origin(xmin)).timestamp FROM t WHERE id = %s"
    rows = await fetch(node.dsn(), sql, [key])
    return datetime_to_pg_us(rows[0][0])


async def test_a_write_on_top_of_another_nodes_version_carries_its_commit_time(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA)
    a, b, c = m.nodes
    applied: list[tuple[str, str, Transaction]] = []

    def record(applier: Applier, txn: Transaction) -> None:
        applied.append((applier.source, applier.target.name, txn))

    def applied_from(source: str, target: str) -> list[Transaction]:
        return [txn for s, t, txn in applied if (s, t) == (source, target)]

    holds = _holds

    async with running_router(m.config, on_applied=record) as router:
        await execute(b.dsn(), "INSERT INTO t VALUES (2, 'b first')")  # before anything of A's reached B
        await wait_for(lambda: holds(a, 2, "b first"), "b's first insert on a")
        first_b = applied_from("b", "a")[-1]
        await execute(a.dsn(), "INSERT INTO t VALUES (1, 'a')")
        await wait_for(lambda: holds(b, 1, "a"), "a's row on b")
        await wait_for(lambda: holds(c, 1, "a"), "a's row on c")
        version_a = await commit_time(a, 1)
        assert await commit_time(b, 1) == version_a  # the source's commit time, on every node
        assert not sequential("a", version_a, first_b.seen)  # written before a's version reached b
        await execute(b.dsn(), "UPDATE t SET v = 'b' WHERE id = 1")
        await wait_for(lambda: holds(c, 1, "b"), "b's update on c")
        update_b = applied_from("b", "c")[-1]
        assert dict(update_b.seen)["a"] >= version_a
        assert sequential("a", version_a, update_b.seen, remote_commit_time=update_b.commit_time)
        version_b = await commit_time(c, 1)
        await execute(c.dsn(), "UPDATE t SET v = 'c' WHERE id = 1")
        await wait_for(lambda: holds(a, 1, "c"), "c's update on a")
        update_c = applied_from("c", "a")[-1]
        assert sequential("b", version_b, update_c.seen, remote_commit_time=update_c.commit_time)
        assert sequential("a", version_a, update_c.seen, remote_commit_time=update_c.commit_time)
        assert router.pumps["c"].seen.snapshot == update_c.seen



async def test_every_update_in_a_round_of_sequential_updates_is_sequential(mesh: MeshFactory) -> None:
    """Nodes take turns updating one row, each once the previous update reached every node: each update
    carries the version it was written on top of (the previous writer's, as every node holds it)."""
    m = await mesh(nodes=3, schema=SCHEMA)
    nodes = m.nodes
    applied: list[tuple[str, Transaction]] = []

    def record(applier: Applier, txn: Transaction) -> None:
        applied.append((applier.source, txn))

    async def everywhere(value: str) -> None:
        for node in nodes:
            await wait_for(lambda node=node: _holds(node, 1, value), f"{value!r} on {node.name}")

    def from_(source: str) -> list[Transaction]:
        return [txn for s, txn in applied if s == source]

    rounds = 15
    sequential_rounds = 0
    async with running_router(m.config, on_applied=record):
        await execute(nodes[0].dsn(), "INSERT INTO t VALUES (1, '0')")
        await everywhere("0")
        for i in range(1, rounds + 1):
            writer, before = nodes[i % 3], nodes[(i - 1) % 3]
            version = await commit_time(writer, 1)  # the previous round's version, as the writer holds it
            done = len(from_(writer.name))
            await execute(writer.dsn(), "UPDATE t SET v = %s WHERE id = 1", params=[str(i)])
            await everywhere(str(i))
            await wait_for(lambda w=writer.name, n=done + 2: len(from_(w)) == n, f"round {i} applied on both")
            txn = from_(writer.name)[-1]
            sequential_rounds += sequential(before.name, version, txn.seen,
                                            remote_commit_time=txn.commit_time)
    assert sequential_rounds == rounds  # no sequential update left looking concurrent


async def _holds(node: Any, key: int, value: str) -> bool:
    return await fetch(node.dsn(), "SELECT v FROM t WHERE id = %s", [key]) == [(value,)]
