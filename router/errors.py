"""The router's errors, and the one place that decides what to do about any failure.

Every error pgmesh raises on purpose is a `PgmeshError` carrying what a person needs to act: the node,
the relation, the WAL position, the SQL state and a hint. `decide()` maps any exception (ours,
psycopg's, asyncpg's, the operating system's) to an `Action`: retry after a backoff, pause the link
that hit it, or fail the command. No other module chooses a retry policy.
"""

from __future__ import annotations

import enum
from typing import Final

import psycopg

from protocol.errors import ProtocolError
from protocol.lsn import format_lsn

__all__ = [
    "Action",
    "ConfigError",
    "ConnectionLost",
    "PgmeshError",
    "SlotError",
    "SourceError",
    "decide",
    "decide_sqlstate",
    "describe",
]


class PgmeshError(Exception):
    """A failure with its context. `str()` is one line a DBA can act on."""

    def __init__(
        self,
        message: str,
        *,
        node: str | None = None,
        lsn: int | None = None,
        relation: str | None = None,
        sqlstate: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.message = message
        self.node = node
        self.lsn = lsn
        self.relation = relation
        self.sqlstate = sqlstate
        self.hint = hint
        super().__init__(self._render())

    def _render(self) -> str:
        context = []
        if self.node is not None:
            context.append(f"node {self.node}")
        if self.relation is not None:
            context.append(f"table {self.relation}")
        if self.lsn is not None:
            context.append(f"LSN {format_lsn(self.lsn)}")
        if self.sqlstate is not None:
            context.append(f"SQLSTATE {self.sqlstate}")
        text = self.message
        if context:
            text = f"{', '.join(context)}: {text}"
        if self.hint:
            text = f"{text} (hint: {self.hint})"
        return text


class ConfigError(PgmeshError):
    """The configuration is wrong; nothing was started."""


class SourceError(PgmeshError):
    """The replication connection to a node failed in a way that retrying will not fix."""


class SlotError(SourceError):
    """A replication slot is missing, busy, or cannot be created."""


class ConnectionLost(PgmeshError):
    """A connection dropped or timed out; the work is resumed after a reconnect."""


class Action(enum.Enum):
    RETRY = "retry"
    PAUSE = "pause"
    FAIL = "fail"


# SQLSTATE classes and codes for which waiting and reconnecting is the right response.
_RETRY_CLASSES: Final = frozenset({"08", "53", "57"})  # connection, resources, operator intervention
_RETRY_CODES: Final = frozenset({"40001", "40P01", "55006", "55P03"})  # serialization, deadlock, busy
_FAIL_CODES: Final = frozenset({"28000", "28P01", "3D000", "42501", "42704", "0A000"})
# libpq reports a refused login before any SQLSTATE exists: recognise it by its text.
_FATAL_CONNECT_TEXT: Final = (
    "password authentication failed",
    "no pg_hba.conf entry",
    "authentication failed",
    "does not exist",
    "permission denied",
    "no password supplied",
    "must be superuser or replication role",
    "is not permitted to log in",
)


def sqlstate_of(exc: BaseException) -> str | None:
    if isinstance(exc, PgmeshError):
        return exc.sqlstate
    if isinstance(exc, psycopg.Error):
        return exc.sqlstate
    state = getattr(exc, "sqlstate", None)
    return state if isinstance(state, str) else None


def decide_sqlstate(state: str) -> Action:
    """What to do about a server error, by its SQLSTATE alone."""
    if state in _FAIL_CODES:
        return Action.FAIL
    if state in _RETRY_CODES or state[:2] in _RETRY_CLASSES:
        return Action.RETRY
    return Action.PAUSE


def decide(exc: BaseException) -> Action:
    """Retry, pause or fail: the whole retry policy of pgmesh."""
    if isinstance(exc, ConnectionLost):
        return Action.RETRY
    if isinstance(exc, (ConfigError, SourceError, ProtocolError)):
        return Action.FAIL
    state = sqlstate_of(exc)
    if state is not None:
        return decide_sqlstate(state)
    if isinstance(exc, psycopg.OperationalError) and any(t in str(exc) for t in _FATAL_CONNECT_TEXT):
        return Action.FAIL
    if isinstance(exc, (psycopg.OperationalError, OSError, TimeoutError, EOFError)):
        return Action.RETRY
    return Action.FAIL


def describe(exc: BaseException) -> str:
    """One line for a log or a status row: never a DSN or a password."""
    if isinstance(exc, PgmeshError):
        return str(exc)
    if isinstance(exc, psycopg.Error):
        diag = exc.diag
        primary = diag.message_primary or str(exc).splitlines()[0]
        state = f" (SQLSTATE {exc.sqlstate})" if exc.sqlstate else ""
        return f"{primary}{state}"
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
