"""A session on a node, opened one way: `connect`, the `Conn` type every module names such a session by,
`ADMIN_SETUP` (what pgmesh's own bookkeeping sessions run first) and `one` (the first column of the first
row of a query).

Each caller states what differs, by keyword: its application_name (`purpose`), how long to wait for the
server (`wait_s`), a lock_timeout set at start-up (`lock_wait_s`), autocommit, whether the session runs
`ADMIN_SETUP` (`admin`), and how a failure to connect is reported (`Failure`: as psycopg raised it, as
"cannot connect" with the SQL state, or as "cannot connect" naming the node that must be reachable).

Must not: stream (the replication connection is `router.stream.connection`'s), open the appliers' asyncpg
sessions (`router.apply.sessions`), retry, or put a DSN or a password into a message (psycopg errors go
through `describe`; a DSN that does not parse is never echoed).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeAlias

import psycopg
from psycopg import sql

from router.config.model import NodeConfig
from router.errors import PgmeshError, describe

__all__ = ["ADMIN_SETUP", "CONNECT_TIMEOUT_S", "Conn", "Failure", "connect", "one"]

Conn: TypeAlias = psycopg.AsyncConnection[Any]

CONNECT_TIMEOUT_S: Final = 10
# pgmesh's bookkeeping never waits for the router, a synchronous standby that may be down or held by it
ADMIN_SETUP: Final = "SET synchronous_commit = local"
_BAD_DSN: Final = "the dsn is not a valid libpq connection string"


class Failure(enum.Enum):
    """How `connect` reports a failure to connect (or to run `ADMIN_SETUP` once connected)."""

    AS_IS = "as is"
    """psycopg's and the OS's errors go through as raised (the caller builds its own hint from them); only
    a DSN that does not parse becomes a `PgmeshError`, which says to fix it and does not echo it."""
    CANNOT_CONNECT = "cannot connect"
    """psycopg's errors, a DSN that does not parse included, become `PgmeshError("cannot connect: ...")`
    with the node and the SQL state; the OS's go through."""
    UNREACHABLE = "unreachable"
    """A DSN that does not parse is a `PgmeshError` without a hint; any other failure, the OS's included,
    is "cannot connect: ..." with the hint that every node must be reachable (no SQL state)."""


def _as_is(node: str, exc: Exception, opened: bool) -> PgmeshError | None:
    if isinstance(exc, psycopg.ProgrammingError) and not opened:
        return PgmeshError(_BAD_DSN, node=node, hint="fix its dsn in the config")
    return None


def _cannot_connect(node: str, exc: Exception, opened: bool) -> PgmeshError | None:
    if isinstance(exc, psycopg.Error):
        return PgmeshError(f"cannot connect: {describe(exc)}", node=node, sqlstate=exc.sqlstate)
    return None


def _unreachable(node: str, exc: Exception, opened: bool) -> PgmeshError | None:
    if isinstance(exc, psycopg.ProgrammingError) and not opened:
        return PgmeshError(_BAD_DSN, node=node)
    hint = f"every node must be reachable; check that node {node} is running"
    return PgmeshError(f"cannot connect: {describe(exc)}", node=node, hint=hint)


# Failure -> the error to raise instead of `exc` (None: `exc` itself); `opened`: the connection was made
# (ADMIN_SETUP failed), so a ProgrammingError is no DSN's.
_REPORTS: Final[dict[Failure, Callable[[str, Exception, bool], PgmeshError | None]]] = {
    Failure.AS_IS: _as_is,
    Failure.CANNOT_CONNECT: _cannot_connect,
    Failure.UNREACHABLE: _unreachable,
}


async def connect(
    node: NodeConfig,
    *,
    purpose: str,
    autocommit: bool = True,
    wait_s: int = CONNECT_TIMEOUT_S,
    lock_wait_s: float | None = None,
    admin: bool = False,
    failure: Failure = Failure.CANNOT_CONNECT,
) -> Conn:
    """A session on `node` named `purpose` (its application_name), waiting at most `wait_s` for the server;
    with `lock_wait_s`, one that waits at most that long for any lock; with `admin`, one that ran
    `ADMIN_SETUP`. A failure is reported as `failure` says."""
    options: dict[str, Any] = {}
    if lock_wait_s is not None:
        options["options"] = f"-c lock_timeout={round(lock_wait_s * 1000)}"
    conn: Conn | None = None
    try:
        conn = await psycopg.AsyncConnection.connect(
            node.dsn, autocommit=autocommit, connect_timeout=wait_s, application_name=purpose, **options
        )
        if admin:
            await conn.execute(ADMIN_SETUP)
    except (psycopg.Error, OSError) as exc:
        error = _REPORTS[failure](node.name, exc, conn is not None)
        if error is None:
            raise
        raise error from None
    return conn


async def one(conn: Conn, query: str | sql.Composable, params: Sequence[Any] | None = None) -> Any:
    """The first column of the first row `query` returns on `conn` (None: no row)."""
    cur = await conn.execute(query, params)  # type: ignore[arg-type]
    row = await cur.fetchone()
    return None if row is None else row[0]
