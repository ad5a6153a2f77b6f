"""An applier's sessions on its target node: how one is opened and set up, how it holds an origin.

Every session an applier opens on the target (the main one, the parallel lanes of `router.apply.lanes`, the
side session of `router.apply.side`) is opened by `open_session`: `asyncpg_connect_args` (with [ha], the
lease fence of `router.apply.fence`), then `SESSION_SETUP`: `session_replication_role = replica` (user and
FK triggers do not fire), UTC and ISO dates, a lock timeout; then `synchronous_commit`
(`replication.apply_synchronous_commit`, default off as the native apply worker). A replication origin
is held by one session at a time (PostgreSQL 15): `take_origin` waits a moment for a session that just
let it go, and `LET_ORIGIN_GO` lets it go after a failure.

Must not: build or run a transaction's SQL (router.apply.scripts, router.apply.applier), decide what an error
means (router.errors), or keep a connection of its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from router.apply.fence import FENCE
from router.config.model import SYNCHRONOUS_COMMIT
from router.nodes.dsn import asyncpg_args
from router.progress.applied import SOURCE_SETTING

__all__ = ["LET_ORIGIN_GO", "SESSION_SETUP", "asyncpg_connect_args", "open_session", "take_origin"]

SESSION_SETUP = """
SET session_replication_role = replica;
SET standard_conforming_strings = on;
SET lock_timeout = '10s';
SET TimeZone = 'UTC';
SET DateStyle = 'ISO, YMD';
SET IntervalStyle = 'postgres';
SET extra_float_digits = 3;
"""

# A session that may hold the source's origin (a lane, the side session) lets it go after a failure.
LET_ORIGIN_GO = ("SELECT pg_catalog.pg_replication_origin_session_reset()"
                 " WHERE pg_catalog.pg_replication_origin_session_is_setup()")


def asyncpg_connect_args(dsn: str) -> dict[str, Any]:
    """libpq keyword/URI DSN -> asyncpg.connect keyword arguments, with libpq's meaning (`router.nodes.dsn`:
    several hosts, the PG* environment, sslmode up to verify-full, client certificates, passfile)."""
    return asyncpg_args(dsn)


async def open_session(
    dsn: str, installed_at: str | None = None, source: str | None = None, synchronous_commit: str = "off"
) -> asyncpg.Connection:
    """A new session on the target, set up as every applier session is (`SESSION_SETUP`, and
    `synchronous_commit`: `replication.apply_synchronous_commit`, checked by the config), with
    `pgmesh.installed_at` (see `pgmesh.expect_origin`) when known, and the source it applies (the
    applied mark's, router.progress.applied). Closed again if the set-up fails."""
    if synchronous_commit not in SYNCHRONOUS_COMMIT:
        raise ValueError(f"synchronous_commit {synchronous_commit!r}")
    args = asyncpg_connect_args(dsn)
    name = FENCE.application_name
    if name is not None:  # [ha]: a session another router's takeover finds and ends (router.apply.fence)
        args["server_settings"] = {**args.get("server_settings", {}), "application_name": name}
    conn = await asyncpg.connect(**args)
    try:
        await FENCE.check(conn, dsn)
        await conn.execute(f"{SESSION_SETUP}SET synchronous_commit = {synchronous_commit};")
        if installed_at:
            await conn.execute("SELECT set_config('pgmesh.installed_at', $1, false)", installed_at)
        if source is not None:
            await conn.execute("SELECT set_config($1, $2, false)", SOURCE_SETTING, source)
    except BaseException:
        conn.terminate()
        raise
    return conn


async def take_origin(conn: asyncpg.Connection, origin: str) -> None:
    """Set the session up with `origin`; a session that just ended may not have let it go yet (a moment
    is allowed for that)."""
    for attempt in range(50):
        try:
            await conn.execute("SELECT pg_catalog.pg_replication_origin_session_setup($1)", origin)
            return
        except asyncpg.ObjectInUseError:
            if attempt == 49:
                raise
            await asyncio.sleep(0.1)
