"""The router's errors, and the one place that decides what to do about any failure.

Every error class of `router/` lives here (`protocol/errors.py` has the decoder's). Each pgmesh error is a
`PgmeshError` carrying what a person needs to act: the node, the relation, the WAL position, the SQL state
and a hint. Its text is rendered from those fields when it is printed; context is added by copy,
`raise exc.at(node=..., lsn=...) from exc`, never by changing an error that was raised.

`decide()` maps any exception (ours, psycopg's, asyncpg's, the operating system's) to an `Action`: retry
after a backoff, pause the link that hit it, or fail the command. Beside it, named, the appliers' own
rules: a connection asyncpg found closed is retried and a missing table or column is waited for
(`decide_link`, `SchemaWait`); which server errors mean the fast path met a conflict (`is_conflict`), that
the target's tables changed (`tables_changed`), and how often a careful apply is tried again after a
unique violation (`retry_unique`); which errors mean the target refused a change, so that a table
under `on_refused = "quarantine"` sets that change aside instead of pausing (`is_refused`); and the
join's: how long a join session waits for a lock, and when a join attempt starts again from a new
snapshot (`retry_join`). No other module chooses a retry policy.

Must not: do I/O, or import asyncpg (the command line does not load it; its errors are recognised once
it is loaded).
"""

from __future__ import annotations

import enum
import ssl
import sys
from typing import TYPE_CHECKING, Final, Self

import psycopg

from protocol.errors import ProtocolError
from protocol.lsn import format_lsn

if TYPE_CHECKING:
    from protocol.transactions import Transaction

__all__ = [
    "CONFLICT_STATES",
    "JOIN_ATTEMPTS",
    "JOIN_LOCK_WAIT_S",
    "JOIN_SLOT_WAIT_S",
    "QUARANTINE_MAX",
    "REFUSED_CLASSES",
    "SCHEMA_STATES",
    "SCHEMA_WAIT_S",
    "UNIQUE_ATTEMPTS",
    "Action",
    "ApplyError",
    "ConfigError",
    "ConnectionLost",
    "LostBeforeCommit",
    "PgmeshError",
    "SchemaMismatch",
    "SchemaWait",
    "SlotError",
    "SourceError",
    "Unpipeable",
    "decide",
    "decide_link",
    "decide_sqlstate",
    "describe",
    "is_conflict",
    "is_refused",
    "refused_sqlstate",
    "remote_version_missing",
    "retry_join",
    "retry_unique",
    "tables_changed",
]


class PgmeshError(Exception):
    """A failure with its context. `str()` is one line a DBA can act on, rendered from the fields."""

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
        super().__init__(message)
        self.message = message
        self.node = node
        self.lsn = lsn
        self.relation = relation
        self.sqlstate = sqlstate
        self.hint = hint

    def __str__(self) -> str:
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

    def at(self, *, node: str | None = None, lsn: int | None = None, relation: str | None = None) -> Self:
        """A copy of this error with the context it does not carry yet (what the raiser said stays:
        it knew best). This error itself is left as it is."""
        twin = type(self).__new__(type(self))
        twin.args = self.args
        twin.__dict__.update(self.__dict__)
        if twin.node is None:
            twin.node = node
        if twin.lsn is None:
            twin.lsn = lsn
        if twin.relation is None:
            twin.relation = relation
        return twin


class ConfigError(PgmeshError):
    """The configuration is wrong; nothing was started."""


class SourceError(PgmeshError):
    """The replication connection to a node failed in a way that retrying will not fix."""


class SlotError(SourceError):
    """A replication slot is missing, busy, or cannot be created."""


class ConnectionLost(PgmeshError):
    """A connection dropped or timed out; the work is resumed after a reconnect."""


class ApplyError(PgmeshError):
    """A change that cannot be applied as is (schema mismatch, missing column, binary value)."""


class Unpipeable(ApplyError):
    """A transaction the pipelined transport does not take on a target (router.apply.shapes): the script
    path applies it instead; never shown to anyone."""


class SchemaMismatch(ApplyError):
    """The target lacks a table or column the change names (possibly DDL still on its way here)."""


class LostBeforeCommit(PgmeshError):
    """A transaction handed out before its commit (or announced, streamed) that the source lost before the
    commit came: aborted, or to be sent again, whole, after a reconnect. Whoever applied part of it
    rolls that back; the transaction is applied when it comes again."""

    def __init__(self, txn: Transaction) -> None:
        super().__init__(f"transaction {txn.xid} was lost by the source before its commit arrived")
        self.txn = txn


class Action(enum.Enum):
    RETRY = "retry"
    PAUSE = "pause"
    FAIL = "fail"


# SQLSTATE classes and codes for which waiting and reconnecting is the right response.
_RETRY_CLASSES: Final = frozenset({"08", "53", "57"})  # connection, resources, operator intervention
_RETRY_CODES: Final = frozenset({"40001", "40P01", "55006", "55P03"})  # serialization, deadlock, busy
_FAIL_CODES: Final = frozenset({"28000", "28P01", "3D000", "42501", "42704", "0A000"})
# Two sessions changing one catalog row at once (a GRANT replayed from one node while a REVOKE of the same
# table from another applies on the same target): the loser's "internal error" is a race, gone on retry.
_CATALOG_RACE: Final = "tuple concurrently updated"
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
    "certificate verify failed",  # TLS: a wrong sslrootcert, or a server certificate for another name
    "server does not support SSL",
    "certificate file",  # sslrootcert / sslcert that cannot be read
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
    if state == "XX000" and _CATALOG_RACE in str(exc):
        return Action.RETRY
    if state is not None:
        return decide_sqlstate(state)
    if isinstance(exc, psycopg.OperationalError) and any(t in str(exc) for t in _FATAL_CONNECT_TEXT):
        return Action.FAIL
    if isinstance(exc, ssl.SSLCertVerificationError):  # asyncpg's: retrying will not make it trusted
        return Action.FAIL
    if isinstance(exc, (psycopg.OperationalError, OSError, TimeoutError, EOFError)):
        return Action.RETRY
    return Action.FAIL


# ---------------------------------------------------------------- the appliers' own rules

# How long a link retries a SchemaMismatch before it pauses: rows of a node that already ran another
# node's DDL can arrive before that DDL does (from a third node, still on its way).
SCHEMA_WAIT_S: Final = 60.0
# SQLSTATEs of a conflict met by the fast path (a guard fired, or a key is already there): the
# transaction is rolled back and applied the careful way (router.apply.careful.transaction).
CONFLICT_STATES: Final = frozenset({"PGM01", "PGM02", "23505"})
# The target's tables changed under a link (DDL run there): undefined column / table, datatype mismatch.
# The link reads the target's tables again, once, and tries the transaction again.
SCHEMA_STATES: Final = frozenset({"42703", "42P01", "42804", "42P10"})  # 42P10: a key ON CONFLICT names went
# A careful apply that meets a unique violation (a local session inserted the same key between its read
# and its write) is read and decided again, now seeing that row: this many attempts in all.
UNIQUE_ATTEMPTS: Final = 5
_UNIQUE_VIOLATION: Final = "23505"


class SchemaWait:
    """Since when a link has met a SchemaMismatch: it retries until `limit` seconds have passed."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since: float | None = None

    def done(self) -> None:
        """A transaction was applied: the next mismatch starts a new wait."""
        self.since = None

    def allows(self, now: float, limit: float) -> bool:
        """Whether to retry again now (else pause, and the next mismatch starts a new wait)."""
        if self.since is None:
            self.since = now
        if now - self.since < limit:
            return True
        self.since = None
        return False


def _closed_by_asyncpg(exc: BaseException) -> bool:
    """A session asyncpg found closed, or whose protocol state it lost ("cannot switch to state ...;
    another operation is in progress", after a stalled event loop): either way the session is dropped
    and opened again."""
    asyncpg = sys.modules.get("asyncpg")  # not loaded: the exception is none of its
    if asyncpg is None:
        return False
    return isinstance(exc, asyncpg.InternalClientError) or (
        isinstance(exc, asyncpg.InterfaceError) and "closed" in str(exc))


def decide_link(
    exc: BaseException, schema: SchemaWait, *, now: float, schema_wait_s: float, dropped: bool = False,
) -> Action:
    """`decide` for a link's applier: a session the router dropped itself (`dropped`: its target stopped
    answering), or one asyncpg found closed (or lost), is opened again, whatever its statement raised; a
    SchemaMismatch is retried for `schema_wait_s` (SCHEMA_WAIT_S unless set) and then pauses the link,
    naming table and column; anything else as `decide` says."""
    if dropped or _closed_by_asyncpg(exc):
        return Action.RETRY
    if isinstance(exc, SchemaMismatch):
        return Action.RETRY if schema.allows(now, schema_wait_s) else Action.PAUSE
    return decide(exc)


def is_conflict(exc: BaseException) -> bool:
    """The fast path met a conflict (CONFLICT_STATES): apply that transaction the careful way."""
    return sqlstate_of(exc) in CONFLICT_STATES


def tables_changed(exc: BaseException) -> bool:
    """The target's tables changed since the link read them (SCHEMA_STATES): read them again, once."""
    return sqlstate_of(exc) in SCHEMA_STATES


# A change the target refuses (`on_refused`, docs/conflicts.md "Quarantine"): what the target's own rules
# say about this row, which no retry and no reconnect changes. Integrity violations other than the unique
# ones pgmesh decides itself (23505 goes the conflict path): check 23514, foreign key 23503, not null
# 23502, exclusion 23P01, restrict 23001, and the class's generic 23000; class 22, a value the target's
# type or domain rejects; and errors raised by the user's code on the target (a trigger): P0 (PL/pgSQL's
# RAISE, P0001, and ASSERT), 38 and 39 (external routines), 2F (SQL routines). Never: connection and
# retryable states (08, 40, 53, 55, 57), schema mismatches (42: the link reads its tables again or
# waits), pgmesh's own PGMxx.
REFUSED_CLASSES: Final = frozenset({"22", "P0", "38", "39", "2F"})
_REFUSED_INTEGRITY: Final = frozenset({"23000", "23001", "23502", "23503", "23514", "23P01"})
# Pending quarantine entries per target beyond which a link pauses instead (invariant 6: bounded).
QUARANTINE_MAX: Final = 100_000


def refused_sqlstate(state: str | None) -> bool:
    """Whether SQLSTATE `state` means the target refused the change itself (REFUSED_CLASSES)."""
    if state is None or len(state) != 5:
        return False
    return state in _REFUSED_INTEGRITY or state[:2] in REFUSED_CLASSES


def is_refused(exc: BaseException) -> bool:
    """A server error by which the target refused a change (`refused_sqlstate`): with `on_refused =
    "quarantine"` for its table, that change is set aside in `pgmesh.quarantine`; else the link pauses."""
    return not isinstance(exc, PgmeshError) and refused_sqlstate(sqlstate_of(exc))


def remote_version_missing(exc: BaseException) -> bool:
    """A decision function needed the transaction's remote version, which the batch left out (a link
    without recent conflicts saves every transaction that setting, router.apply.decide.Decisions.remote):
    the batch is sent again with it."""
    return sqlstate_of(exc) == "PGM03"


def decision_function_lost(exc: BaseException) -> bool:
    """A decision function (router.apply.decide) a prepared statement calls is gone: created in a
    transaction that was rolled back, on this session or another. The batch is sent again; the session's
    statements start again and make sure of their functions first."""
    return sqlstate_of(exc) == "42883" and "pgmesh.d_" in str(exc)


def retry_unique(exc: BaseException, attempt: int) -> bool:
    """Attempt `attempt` of a careful apply met a unique violation: try again (UNIQUE_ATTEMPTS in all)."""
    return sqlstate_of(exc) == _UNIQUE_VIOLATION and attempt < UNIQUE_ATTEMPTS


# ---------------------------------------------------------------- the join's rules

# Every session `pgmesh join` opens on the donor that takes a lock waits at most this long for it
# (lock_timeout), and an application session waiting for a lock the join holds waits about this long
# before the join gives way (rolls its attempt back, so the application goes on).
JOIN_LOCK_WAIT_S: Final = 5.0
# Creating the join's slot waits for the transactions running on the donor to end (its snapshot needs
# them ended: a wait on their transaction ids, so lock_timeout bounds it); at most this long.
JOIN_SLOT_WAIT_S: Final = 60.0
# A join attempt that met the application's locks starts again, with a new snapshot: this many in all.
# 55P03: a lock_timeout ran out, or the join gave way to the application; 40P01: a deadlock the server
# broke; 40001: a table was truncated or rewritten between the snapshot and the join's lock on it.
JOIN_ATTEMPTS: Final = 5
_JOIN_RETRY_STATES: Final = frozenset({"55P03", "40P01", "40001"})


def retry_join(exc: BaseException, attempt: int) -> bool:
    """Attempt `attempt` (1-based) of a join failed on a lock: start again (JOIN_ATTEMPTS in all)."""
    return sqlstate_of(exc) in _JOIN_RETRY_STATES and attempt < JOIN_ATTEMPTS


def _table(schema: object, table: object) -> str:
    """`table s.t: ` when the server named the table the error is about (a constraint, a column)."""
    if not isinstance(table, str) or not table:
        return ""
    return f"table {schema}.{table}: " if isinstance(schema, str) and schema else f"table {table}: "


def describe(exc: BaseException) -> str:
    """One line for a log or a status row: the table the server named, the message, the SQL state;
    never a DSN or a password."""
    if isinstance(exc, PgmeshError):
        return str(exc)
    if isinstance(exc, psycopg.Error):
        diag = exc.diag
        primary = diag.message_primary or str(exc).splitlines()[0]
        state = f" (SQLSTATE {exc.sqlstate})" if exc.sqlstate else ""
        return f"{_table(diag.schema_name, diag.table_name)}{primary}{state}"
    first = str(exc).splitlines()[0] if str(exc) else ""
    code = getattr(exc, "sqlstate", None)
    if isinstance(code, str) and first:  # a server error from asyncpg: its fields, read by name
        where = _table(getattr(exc, "schema_name", None), getattr(exc, "table_name", None))
        return f"{where}{first} (SQLSTATE {code})"
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
