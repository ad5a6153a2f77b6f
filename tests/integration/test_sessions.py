"""The appliers' sessions against a real node: several hosts in a DSN are tried in turn.

How DSNs become asyncpg's arguments (no server): tests/unit/router/apply/test_sessions.py.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from router.apply.sessions import asyncpg_connect_args
from router.testing.mesh import free_port


async def test_several_hosts_are_tried_in_turn(pg_nodes: Any) -> None:
    (node,) = pg_nodes(1)
    dead = free_port()  # nothing listens there
    dsn = node.dsn().replace(f"port={node.port}", f"port={dead},{node.port}").replace(
        f"host={node.host}", f"host={node.host},{node.host}"
    )
    assert f"port={dead},{node.port}" in dsn
    conn = await asyncpg.connect(**asyncpg_connect_args(dsn))
    try:
        assert await conn.fetchval("SELECT 1") == 1
    finally:
        await conn.close()
