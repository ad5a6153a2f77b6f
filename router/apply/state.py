"""A link's state and counters: where it is (`LinkState`, moved only by `LinkCondition.move`, along the
allowed `TRANSITIONS`) and what it did (`LinkStats`, one struct per link that the supervisor reads whole
for `pgmesh status` and the metrics).

`LinkView` lets the applier answer `applier.state` and `applier.last_error` as it always has; its
counters are read whole or one by one off `applier.stats`. Nothing writes through it.

Must not: do I/O, decide what a failure means (router.errors), or keep anything but the state, the
last error and the counters.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from typing import Final

import msgspec

__all__ = ["TRANSITIONS", "LinkCondition", "LinkState", "LinkStats", "LinkView"]

logger = logging.getLogger(__name__)


class LinkState(enum.Enum):
    STREAMING = "streaming"
    PAUSED = "paused"
    CATCHING_UP = "catching up"
    DOWN = "down"
    ERROR = "error"
    SCHEMA_DRIFT = "schema drift"  # the nodes' replicated tables differ (router.ddl.drift): held
    CLOCK_SKEW = "clock skew"  # a node's clock is beyond [clocks] max_offset_ms (router.cluster.clocks): held


_S = LinkState
_RUNNING: Final = frozenset({_S.STREAMING, _S.CATCHING_UP})
# Where a link may go from each state. Every state may fail (DOWN: retried; ERROR: held until
# `pgmesh resume`). The operator may pause a link in any state but ERROR: a link held on an error stays
# in ERROR, its error in view, until it is resumed (pausing it only keeps it held after that).
# STREAMING <-> CATCHING_UP follow the backlog after each batch. A link runs again (STREAMING or
# CATCHING_UP) from DOWN, PAUSED or ERROR when it (re)connects, and from PAUSED also at once when it is
# resumed while connected. SCHEMA_DRIFT holds a link whose source or target has a replicated table whose
# columns differ from the other nodes' (router.ddl.drift), from any state but ERROR (an ERROR link moves
# there when it is resumed while the drift lasts), and runs it again once the schemas agree. CLOCK_SKEW
# holds a running link that decides by commit times while its source's or target's clock is too far from
# the router's (router.cluster.clocks), and runs it again (STREAMING) once it is back under the bound.
_ANY: Final = frozenset({*_RUNNING, _S.DOWN, _S.ERROR, _S.PAUSED, _S.SCHEMA_DRIFT, _S.CLOCK_SKEW})
TRANSITIONS: Final[Mapping[LinkState, frozenset[LinkState]]] = {
    _S.DOWN: _ANY,
    _S.STREAMING: _ANY,
    _S.CATCHING_UP: _ANY,
    _S.PAUSED: _ANY,
    _S.SCHEMA_DRIFT: _ANY,
    _S.CLOCK_SKEW: _ANY,
    _S.ERROR: frozenset({*_RUNNING, _S.DOWN, _S.ERROR, _S.SCHEMA_DRIFT}),
}

# How a move into each state is logged: level, what the link does, what comes after the error.
_LOG: Final[Mapping[LinkState, tuple[int, str, str]]] = {
    _S.DOWN: (logging.WARNING, "is down", "; retrying"),
    _S.ERROR: (logging.ERROR, "paused", " (fix it, then `pgmesh resume`)"),
    _S.PAUSED: (logging.INFO, "paused", ""),
    # router.ddl.drift logs the drift once, naming node, table and column (not once per link)
    _S.SCHEMA_DRIFT: (logging.DEBUG, "holds on schema drift", ""),
    # router.cluster.clocks logs the skew once per node (not once per link)
    _S.CLOCK_SKEW: (logging.DEBUG, "holds on clock skew", ""),
    _S.STREAMING: (logging.DEBUG, "streaming", ""),
    _S.CATCHING_UP: (logging.DEBUG, "catching up", ""),
}


class LinkCondition:
    """Where one link is (`state`) and the error that stopped it last (`last_error`)."""

    __slots__ = ("last_error", "name", "state")

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = LinkState.DOWN
        self.last_error: str | None = None

    def move(self, state: LinkState, error: str | None = None, *, keep_error: bool = False) -> None:
        """The one way to change the state: checks the transition, records `error` (or keeps the last
        one with `keep_error`) and logs the change once."""
        if state not in TRANSITIONS[self.state]:
            raise RuntimeError(f"link {self.name}: no move from {self.state.value} to {state.value}")
        if keep_error:
            error = self.last_error
        moved = state is not self.state
        if not moved and error == self.last_error:
            return
        self.state, self.last_error = state, error
        if moved or error is not None:  # an error cleared (`pgmesh resume`) is no news
            level, what, after = _LOG[state]
            logger.log(level, "link %s %s%s%s", self.name, what, f": {error}" if error else "", after)


class LinkStats(msgspec.Struct):
    """What one link did since the router started (read whole: `Router.status`, the metrics)."""

    applied_transactions: int = 0
    applied_rows: int = 0
    last_commit_time: int | None = None  # source commit time of the last applied transaction
    retries: int = 0
    errors: int = 0  # failures that paused the link
    skipped: int = 0  # transactions the target had already (resent after a restart)
    conflicts: int = 0
    ddl_applied: int = 0
    copied_transactions: int = 0  # large transactions applied in parts (COPY where possible)
    copied_rows: int = 0
    scripts_ahead: int = 0  # scripts built while the previous batch ran, then sent (for the bench)
    parallel_batches: int = 0
    parallel_transactions: int = 0
    early_transactions: int = 0  # large transactions whose apply began before their commit arrived
    abandoned_transactions: int = 0  # of those, lost by the source before the commit (sent again)
    early_streams: int = 0  # streamed transactions a side session began before their commit
    early_streams_committed: int = 0  # of those, committed there in their place in commit order
    early_streams_dropped: int = 0  # of those, rolled back (then applied the normal way, or aborted)


class LinkView:
    """A link's state, read on the applier (its counters: `applier.stats`)."""

    stats: LinkStats
    condition: LinkCondition

    @property
    def state(self) -> LinkState:
        return self.condition.state

    @property
    def last_error(self) -> str | None:
        return self.condition.last_error

    @property
    def last_commit_time(self) -> int | None:
        return self.stats.last_commit_time
