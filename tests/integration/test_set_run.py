"""A set run (issue 18, "Must show"): clients on all three nodes insert rows with keys of their own, delete
and re-insert some of them, and update other nodes' rows at the same time; every insert a client saw
commit, and did not delete again itself, is on every node exactly once, and the nodes hold the same rows.

Keys are (node, n): a client owns the keys of its node and is the only one to insert or delete them, so
no conflict decided by last-update-wins may take one of its acknowledged rows away (an update racing a
delete may bring a deleted row back, which is allowed: the check is on the acknowledged rows, and on no
row appearing that no client inserted). Each client's choices are random with a fixed seed; a statement
that fails on a transient error (a deadlock with an applier) is retried until it commits. The first round
runs while every link streams; the second while every link is held, so that all its writes are concurrent.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import psycopg

from router.testing.mesh import fetch, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy

OPS = 150  # per node and round: two rounds, 300 per node
HOT = 20  # updates of other nodes' rows go to their first HOT keys half of the time
TABLES = ["items"]
SCHEMA = """
CREATE TABLE items (node text, n int, v int NOT NULL, who text NOT NULL, PRIMARY KEY (node, n));
"""
TRANSIENT = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure,
             psycopg.errors.LockNotAvailable)
DELETE = "DELETE FROM items WHERE node = %(node)s AND n = %(n)s"
INSERT = "INSERT INTO items VALUES (%(node)s, %(n)s, %(v)s, %(node)s)"
REINSERT = (
    "INSERT INTO items VALUES (%(node)s, %(n)s, %(v)s, %(node)s)"
    " ON CONFLICT (node, n) DO UPDATE SET v = excluded.v, who = excluded.who"
)  # a concurrent update from another node may have brought the deleted row back: it is ours again


class Client:
    """One node's client: its own keys (acknowledged, and deleted by itself), and a seeded random plan."""

    __slots__ = ("acked", "deleted", "name", "next_n", "others", "retries", "rng")

    def __init__(self, name: str, others: list[str], seed: int) -> None:
        self.name = name
        self.others = others
        self.rng = random.Random(seed)
        self.acked: set[int] = set()  # committed inserts of this node's keys, not deleted since
        self.deleted: set[int] = set()  # this node's keys it deleted (and did not insert again)
        self.next_n = 0
        self.retries = 0

    async def run(self, dsn: str, ops: int) -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            for _ in range(ops):
                await self.step(conn)

    async def step(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """One transaction, chosen at random; its effect on `acked` / `deleted` once it committed."""
        rng, choice = self.rng, self.rng.random()
        mine, gone = sorted(self.acked), sorted(self.deleted)
        value = rng.randrange(1_000_000)
        if choice < 0.15 and mine:  # delete one of its rows
            n = rng.choice(mine)
            await self.commit(conn, [(DELETE, n, value)])
            self.acked.discard(n)
            self.deleted.add(n)
        elif choice < 0.25 and gone:  # insert a deleted one again
            n = rng.choice(gone)
            await self.commit(conn, [(REINSERT, n, value)])
            self.deleted.discard(n)
            self.acked.add(n)
        elif choice < 0.32 and mine:  # delete and insert again in one transaction
            n = rng.choice(mine)
            await self.commit(
                conn, [(DELETE, n, value), (REINSERT, n, value)]
            )
        elif choice < 0.5:  # update another node's row (it may not be there yet, or be deleted)
            other = rng.choice(self.others)
            n = rng.randrange(HOT) if rng.random() < 0.5 else rng.randrange(OPS)
            await self.commit(
                conn, [("UPDATE items SET v = %(v)s, who = %(me)s WHERE node = %(other)s AND n = %(n)s",
                        n, value)], other=other,
            )
        else:  # a new row
            n = self.next_n
            self.next_n += 1
            await self.commit(conn, [(INSERT, n, value)])
            self.acked.add(n)

    async def commit(
        self, conn: psycopg.AsyncConnection[Any], statements: list[tuple[str, int, int]], other: str = ""
    ) -> None:
        """Run `statements` in one transaction, again until it commits."""
        while True:
            try:
                async with conn.transaction():
                    for sql, n, value in statements:
                        params = {"node": self.name, "me": self.name, "other": other, "n": n, "v": value}
                        await conn.execute(sql, params)
                return
            except TRANSIENT:
                self.retries += 1


async def test_acknowledged_inserts_are_on_every_node_once(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA)
    nodes = m.nodes
    names = [n.name for n in nodes]
    clients = [Client(n, [o for o in names if o != n], seed) for seed, n in enumerate(names, 1)]
    async with running_router(m.config) as router:
        await asyncio.gather(*(c.run(n.dsn(), OPS) for c, n in zip(clients, nodes, strict=True)))
        await router.pause(None)  # every link held: this round's writes are all concurrent
        await asyncio.gather(*(c.run(n.dsn(), OPS) for c, n in zip(clients, nodes, strict=True)))
        await router.resume(None)
        await converge(router, nodes, TABLES, 60)
        healthy(router)
        # the links' decisions, and the tombstone recorders' late ones (router.apply.recorder: a remote
        # change that met a key deleted just before, on a node that had not recorded that deletion yet)
        decided = router.conflicts_decided()
    acked = {(c.name, n) for c in clients for n in c.acked}
    inserted = acked | {(c.name, n) for c in clients for n in c.deleted}
    for node in nodes:
        rows = await fetch(node.dsn(), "SELECT node, n, count(*) FROM items GROUP BY 1, 2")
        counts = {(owner, n): int(count) for owner, n, count in rows}
        missing = sorted(acked - counts.keys())
        assert not missing, f"node {node.name}: acknowledged rows missing: {missing}"
        twice = sorted(k for k, count in counts.items() if count != 1)
        assert not twice, f"node {node.name}: rows held more than once: {twice}"
        strange = sorted(counts.keys() - inserted)
        assert not strange, f"node {node.name}: rows no client inserted: {strange}"
    recorded: Counter[str] = Counter()
    for node in nodes:
        for kind, count in await fetch(
            node.dsn(), "SELECT conflict_type, count(*) FROM pgmesh.conflict_history GROUP BY 1"
        ):
            recorded[kind] += int(count)
    print(f"acknowledged rows: {len(acked)} (of {len(inserted)} keys inserted); conflicts decided by the"
          f" links: {decided}; recorded: {dict(recorded)}; client retries: {sum(c.retries for c in clients)}")
    assert sum(recorded.values()) == decided > 0, (decided, recorded)
