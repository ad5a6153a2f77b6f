"""The pipelined transport (router.apply.pipe): small transactions go through the extended protocol, each
encoded once for all of its source's links; conflicts, refusals of the pipe (a TRUNCATE, a keyless
table's update), and a transport switched off still converge."""

from __future__ import annotations

import asyncio

import msgspec

from router.testing.mesh import execute, fetch, running_router, wait_converged
from tests.fix_mesh import MeshFactory

SCHEMA = """
CREATE TABLE acct (id int PRIMARY KEY, balance int NOT NULL, note text);
CREATE TABLE hist (acct int NOT NULL, delta int NOT NULL, at timestamptz NOT NULL DEFAULT now());
CREATE TABLE big (id int PRIMARY KEY, body text);
"""


async def _transfers(dsn: str, first: int, count: int) -> None:
    for i in range(first, first + count):
        await execute(
            dsn,
            "BEGIN",
            f"UPDATE acct SET balance = balance - 1 WHERE id = {i % 10}",
            f"UPDATE acct SET balance = balance + 1 WHERE id = {(i + 3) % 10}",
            f"INSERT INTO hist (acct, delta) VALUES ({i % 10}, -1)",
            "COMMIT",
        )


PIPELINE = 'apply_transport = "pipeline"'


async def test_small_transactions_go_through_the_pipe_encoded_once(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, replication=PIPELINE)
    a, b, _c = m.nodes
    await execute(a.dsn(), "INSERT INTO acct SELECT i, 100, repeat('x', i) FROM generate_series(0, 9) i")
    async with running_router(m.config) as router:
        await wait_converged(m.nodes, ["acct", "hist"])
        await _transfers(a.dsn(), 0, 200)
        await execute(a.dsn(), "DELETE FROM hist WHERE delta = -1 AND acct = 3")  # keyless: the script path
        await execute(b.dsn(), "UPDATE acct SET note = NULL WHERE id = 4", "DELETE FROM acct WHERE id = 9")
        await wait_converged(m.nodes, ["acct", "hist"])
        # DDL: every link's statements are made again (the old ones closed by the next batch)
        await execute(a.dsn(), "ALTER TABLE acct ADD COLUMN flag int")
        await _transfers(a.dsn(), 200, 20)
        await execute(b.dsn(), "UPDATE acct SET flag = 1 WHERE id = 2")
        await wait_converged(m.nodes, ["acct", "hist"])
        appliers = router.appliers
        assert all(applier.last_error is None for applier in appliers.values())
        encoder = appliers[("a", "b")].encoder
        assert encoder is appliers[("a", "c")].encoder
        assert encoder.encodes >= 220 and encoder.hits >= 220  # each once, for both of a's links
        pipe = appliers[("a", "b")].link.pipe
        assert pipe is not None and not pipe.closed
    rows = [await fetch(node.dsn(), "SELECT id, balance, note FROM acct ORDER BY id") for node in m.nodes]
    assert rows[0] == rows[1] == rows[2] and len(rows[0]) == 9


async def test_conflicts_met_in_the_pipe_are_decided_and_converge(mesh: MeshFactory) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, replication=PIPELINE)
    a, b, c = m.nodes
    await execute(a.dsn(), "INSERT INTO acct SELECT i, 100, NULL FROM generate_series(0, 9) i")
    async with running_router(m.config) as router:
        await wait_converged(m.nodes, ["acct"])
        await router.pause(None)
        await asyncio.gather(
            _transfers(a.dsn(), 0, 40), _transfers(b.dsn(), 5, 40), _transfers(c.dsn(), 7, 40))
        # the same new key on two nodes: a unique violation in the pipe, decided the careful way
        await execute(a.dsn(), "INSERT INTO acct VALUES (50, 1, 'a')")
        await execute(b.dsn(), "INSERT INTO acct VALUES (50, 2, 'b')")
        await router.resume(None)
        await wait_converged(m.nodes, ["acct", "hist"])
        assert all(applier.last_error is None for applier in router.appliers.values())
    rows = [await fetch(node.dsn(), "SELECT id, balance, note FROM acct ORDER BY id") for node in m.nodes]
    assert rows[0] == rows[1] == rows[2]
    assert [tuple(r) for r in rows[0] if r[0] == 50] == [(50, 2, "b")]  # b's, the newer


async def test_script_transport_still_applies(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, _b = m.nodes
    replication = msgspec.structs.replace(m.config.replication, apply_transport="script")
    config = msgspec.structs.replace(m.config, replication=replication)
    await execute(a.dsn(), "INSERT INTO acct SELECT i, 100, NULL FROM generate_series(0, 9) i")
    async with running_router(config) as router:
        await _transfers(a.dsn(), 0, 30)
        await execute(a.dsn(), "TRUNCATE big")
        await wait_converged(m.nodes, ["acct", "hist"])
        applier = router.appliers[("a", "b")]
        assert applier.link.pipe is None and applier.encoder.encodes == 0
