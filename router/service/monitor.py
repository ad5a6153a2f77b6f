"""The router's monitoring connection to each node: flushed origin progress, paused links.

Must not: apply anything, or hold a replication origin. One psycopg connection per node,
`application_name` pgmesh-monitor, reopened on the next call after a failure.
"""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg

from protocol.lsn import parse_lsn
from router.config import Config, NodeConfig

__all__ = ["MonitorTarget"]


class MonitorTarget:
    """The router's monitoring connection to one node as a target (flushed origin progress)."""

    def __init__(self, config: Config, node: NodeConfig) -> None:
        self.config = config
        self.node = node
        self.conn: psycopg.AsyncConnection[Any] | None = None
        self.error: str | None = None

    async def query(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        if self.conn is None or self.conn.closed:
            self.conn = await psycopg.AsyncConnection.connect(
                self.node.dsn, autocommit=True, application_name="pgmesh-monitor", connect_timeout=5
            )
        cur = await self.conn.execute(sql, params)
        return await cur.fetchall() if cur.description else []

    async def origin_progress(self) -> dict[str, int]:
        """source node -> flushed position of its origin on this target."""
        prefix = self.config.origin_name("")
        rows = await self.query(
            "SELECT roname, pg_catalog.pg_replication_origin_progress(roname, true)::text"
            " FROM pg_catalog.pg_replication_origin WHERE starts_with(roname, %s)",
            [prefix],
        )
        return {r[0][len(prefix):]: parse_lsn(r[1]) if r[1] else 0 for r in rows}

    async def paused_sources(self) -> dict[str, str | None]:
        rows = await self.query("SELECT source, reason FROM pgmesh.links WHERE paused")
        return {r[0]: r[1] for r in rows}

    async def set_paused(self, source: str, paused: bool, reason: str | None) -> None:
        await self.query(
            "INSERT INTO pgmesh.links (source, paused, reason, updated) VALUES (%s, %s, %s, now())"
            " ON CONFLICT (source) DO UPDATE SET paused = excluded.paused, reason = excluded.reason,"
            " updated = now()",
            [source, paused, reason],
        )

    async def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                await self.conn.close()
