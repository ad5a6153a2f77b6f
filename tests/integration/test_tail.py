"""`pgmesh tail NODE` (router.ops.tail): a node's transactions, decoded, as they commit, each labelled with
where it came from; its temporary slot is gone when it ends."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

from router.ops.tail import TailedTransaction, cmd_tail, render, tail
from router.testing.mesh import execute, fetch, running_router, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE items (id int PRIMARY KEY, v text, big text);"
SLOTS = "SELECT slot_name FROM pg_catalog.pg_replication_slots WHERE slot_name LIKE 'pgmesh\\_tail%%'"


async def test_tail_shows_local_and_applied_transactions_then_leaves_no_slot(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, replication="spill_mb = 1")
    a, b = m.nodes
    seen: list[TailedTransaction] = []
    started = asyncio.Event()
    async with running_router(m.config):
        task = asyncio.create_task(tail(m.config, "b", seen.append, limit=5, started=started))
        await asyncio.wait_for(started.wait(), 30)
        await execute(b.dsn(), "INSERT INTO items VALUES (1, 'it''s b', NULL)")
        await execute(a.dsn(), "INSERT INTO items VALUES (2, 'from a', NULL)")  # applied on b by the router
        await wait_for(lambda: _has(b, 2), "a's row on b")
        await execute(b.dsn(), "UPDATE items SET v = 'two' WHERE id = 1")
        await execute(b.dsn(), "DELETE FROM items WHERE id = 1")
        # bigger than spill_mb: spilled to disk as it arrives, printed from there
        await execute(b.dsn(), "INSERT INTO items SELECT g, 'bulk', repeat('x', 200)"
                               " FROM generate_series(10, 20009) g")
        assert await asyncio.wait_for(task, 60) == 5
    local, applied, update, delete, bulk = seen
    assert local.origin == "local" and [c.op for c in local.changes] == ["INSERT"]
    assert local.changes[0].table == "public.items"
    assert local.changes[0].row == {"id": "1", "v": "it's b", "big": None}
    assert applied.origin == "from a" and applied.changes[0].row == {"id": "2", "v": "from a", "big": None}
    assert update.changes[0].op == "UPDATE" and update.changes[0].row == {"id": "1", "v": "two", "big": None}
    assert delete.changes[0].op == "DELETE" and delete.changes[0].key == {"id": "1"}
    assert len(bulk.changes) == 20_000
    assert bulk.changes[-1].row == {"id": "20009", "v": "bulk", "big": "x" * 200}
    text = render(local)
    assert text.startswith(f"{local.commit_lsn} ") and "local: 1 change(s)" in text
    assert "  INSERT public.items (id='1', v='it''s b', big=NULL)" in text
    assert "  DELETE public.items key (id='1')" in render(delete)
    assert await fetch(b.dsn(), SLOTS) == []  # the temporary slot went with the command's session


async def test_tail_prints_json_lines(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a = m.nodes[0]
    out = io.StringIO()
    task = asyncio.create_task(cmd_tail(m.config, "a", as_json=True, limit=1, out=out))

    async def slot_made() -> bool:
        return bool(await fetch(a.dsn(), SLOTS))

    await wait_for(slot_made, "tail's slot on a", 30)
    await execute(a.dsn(), "INSERT INTO items VALUES (7, 'seven', NULL)")
    assert await asyncio.wait_for(task, 60) == 0
    (line,) = out.getvalue().splitlines()
    record = json.loads(line)
    assert record["node"] == "a" and record["origin"] == "local"
    assert record["changes"] == [
        {"op": "INSERT", "table": "public.items", "row": {"id": "7", "v": "seven", "big": None}, "key": None,
         "content": None}
    ]


async def _has(node: Any, key: int) -> bool:
    return bool(await fetch(node.dsn(), "SELECT 1 FROM items WHERE id = %s", [key]))
