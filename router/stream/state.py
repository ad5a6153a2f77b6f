"""What a replication source is doing and what it did: its state and its counters.

`SourceState` is the state the admin `/status` and the metrics show (the enum's values are that text);
`TRANSITIONS` says, as data, which state may follow which; `Lifecycle` holds one source's state and last
error and is the one place that changes them (`Lifecycle.to`: checks the move against the table, logs it
once, records the error). `SourceStats` holds the counters of one source and of its fan-out, read whole
by the supervisor and the metrics (one counter is read off the owner's `stats`: `source.stats.spills`).

Must not: do I/O, decide when a state changes (the connection, the source and the supervisor do), or
reset a counter (they only grow while the router runs).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from typing import Final

import msgspec

from router.errors import SourceError

__all__ = ["TRANSITIONS", "Lifecycle", "SourceState", "SourceStats"]

logger = logging.getLogger(__name__)


class SourceState(enum.StrEnum):
    """A source's state; the value is the text `/status` shows (and a plain string compares equal)."""

    IDLE = "idle"  # made, never connected
    CONNECTING = "connecting"  # opening its replication connection (or it is open, not streaming yet)
    STREAMING = "streaming"  # START_REPLICATION answered: the stream flows
    RECONNECTING = "reconnecting"  # the connection was lost; waiting out the backoff before the next
    FAILED = "failed"  # stopped on an error that retrying does not fix (`stream()` raised it)
    STOPPED = "stopped"  # closed by its owner
    ERROR = "error"  # the router saw its fan-out stop on an error and retries it later


_S = SourceState
_ANY_CAUSE: Final = frozenset({_S.STOPPED, _S.ERROR, _S.CONNECTING})  # close, the router, a new connection

# Which state may follow which (a state may always be set again: nothing happens then). A close from
# another task can come while the reader is still between two steps: after STOPPED, the reader may
# still finish starting, lose its connection or fail.
TRANSITIONS: Final[Mapping[SourceState, frozenset[SourceState]]] = {
    _S.IDLE: _ANY_CAUSE,
    _S.CONNECTING: _ANY_CAUSE | {_S.STREAMING, _S.RECONNECTING, _S.FAILED},
    _S.STREAMING: _ANY_CAUSE | {_S.RECONNECTING, _S.FAILED},
    _S.RECONNECTING: _ANY_CAUSE,
    _S.FAILED: frozenset({_S.CONNECTING, _S.ERROR}),  # a close keeps it failed
    _S.STOPPED: _ANY_CAUSE | {_S.STREAMING, _S.RECONNECTING, _S.FAILED},
    _S.ERROR: _ANY_CAUSE,
}

# How loudly each arrival is logged.
_LEVEL: Final[Mapping[SourceState, int]] = {
    _S.IDLE: logging.DEBUG,
    _S.CONNECTING: logging.DEBUG,
    _S.STREAMING: logging.INFO,
    _S.RECONNECTING: logging.WARNING,
    _S.FAILED: logging.ERROR,
    _S.STOPPED: logging.DEBUG,
    _S.ERROR: logging.ERROR,
}


class Lifecycle:
    """One source's state and last error; `to()` is the only way to change them."""

    __slots__ = ("last_error", "node", "state")

    def __init__(self, node: str) -> None:
        self.node = node
        self.state = SourceState.IDLE
        self.last_error: str | None = None  # kept after the source recovers: /status shows the last one

    def to(self, new: SourceState, *, error: str | None = None, detail: str = "") -> None:
        """Move to `new` (checked against TRANSITIONS), recording `error` and logging the move once.

        Setting the state it is in again only records `error`.
        """
        old = self.state
        if new is not old and new not in TRANSITIONS[old]:
            raise SourceError(f"source state cannot go from {old.value} to {new.value}", node=self.node)
        if error is not None:
            self.last_error = error
        if new is old:
            return
        self.state = new
        level = _LEVEL[new]
        if logger.isEnabledFor(level):
            text = "; ".join(part for part in (error, detail) if part)
            logger.log(level, "node %s: source %s -> %s%s", self.node, old.value, new.value,
                       f": {text}" if text else "")


class SourceStats(msgspec.Struct, gc=False):
    """The counters of one source and of its fan-out; they only grow."""

    # the replication connection (router.stream.connection)
    reconnects: int = 0  # connections opened again after a loss
    bytes_received: int = 0  # CopyData bytes read off the stream
    status_updates_sent: int = 0
    # the source (router.stream.source)
    transactions_out: int = 0  # transactions handed out
    echo_rows_skipped: int = 0  # row messages of echoes passed over undecoded (`skip_echo_rows`)
    raw_inserts: int = 0  # inserts passed on undecoded (RawInsert)
    spills: int = 0  # Spill pieces written to the spool
    spilled_changes: int = 0
    spill_peak_bytes: int = 0  # the most payload one transaction held in memory before it spilled
    early_transactions: int = 0  # transactions handed out at their first spill, before their commit
    early_streams: int = 0  # streamed transactions announced at their first spill (EarlyStream)
    # the fan-out (router.stream.fanout)
    transactions: int = 0  # transactions fanned out to the links
    echoes: int = 0  # transactions that carried a replication origin, so went nowhere
    applied_notes: int = 0  # pgmesh.applied messages (16+: what appliers committed here, instead of echoes)
