"""Replication origins on a node that are not pgmesh's: how many of the node's origin states they hold.

Each origin that ever had progress keeps one of the node's states until it is dropped (PostgreSQL 18+:
`max_active_replication_origins`; before, `max_replication_slots` sizes them too); `pgmesh init` checks
that pgmesh's own (`Config.pgmesh_origins`) fit beside the others'. Reading them takes superuser (or a
grant on `pg_replication_origin_status`); without it they count as none, and init's superuser check
fails on its own.

Must not: create, advance or drop an origin.
"""

from __future__ import annotations

from typing import Any

import psycopg

__all__ = ["origins_of_others"]

_READABLE = "SELECT pg_catalog.has_table_privilege('pg_catalog.pg_replication_origin_status', 'SELECT')"


async def origins_of_others(conn: psycopg.AsyncConnection[Any], ours: list[str]) -> int:
    """States held on the node by origins whose names are not in `ours`."""
    cur = await conn.execute(_READABLE)
    row = await cur.fetchone()
    if not row or not row[0]:
        return 0
    cur = await conn.execute(
        "SELECT count(*) FROM pg_catalog.pg_replication_origin_status WHERE NOT external_id = ANY(%s)", [ours]
    )
    row = await cur.fetchone()
    return int(row[0]) if row else 0
