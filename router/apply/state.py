"""A link's state and counters: whether it is alive (`Liveness`, moved only by `LinkCondition.to`, along
the allowed `TRANSITIONS`), what holds it (`LinkHold`: a set beside it), what the operator sees
(`LinkState`, derived from the two by `shown`) and what it did (`LinkStats`, one struct per link that the
supervisor reads whole for `pgmesh status` and the metrics).

Only the applier moves its liveness; the watchers (the clock watch, the schema drift check, the
operator's pause through the supervisor) report a hold to it (`LinkCondition.add_hold` /
`drop_hold`) and never set a state.

`LinkView` lets the applier answer `applier.state` and `applier.last_error` as it always has; its
counters are read whole or one by one off `applier.stats`. Nothing writes through it.

Must not: do I/O, decide what a failure means (router.errors), or keep anything but the state, the
holds, the last error and the counters.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from typing import Final, NamedTuple

import msgspec

__all__ = [
    "RUNNING",
    "TRANSITIONS",
    "LinkCondition",
    "LinkHold",
    "LinkState",
    "LinkStats",
    "LinkView",
    "Liveness",
    "shown",
]

logger = logging.getLogger(__name__)


class Liveness(enum.Enum):
    """Where the applier's own loop is with its target."""

    CONNECTING = "connecting"  # (re)opening its target session; shown "down" until it runs
    STREAMING = "streaming"
    CATCHING_UP = "catching up"
    DOWN = "down"  # failed, retried after a backoff
    ERROR = "error"  # failed for good: stopped until `pgmesh resume`


class LinkHold(enum.Enum):
    """What holds a link that is otherwise able to run. The router's own hold (`POST /hold`, a join)
    is not one of them: it stops every link, and builds them again when released."""

    PAUSE = "pause"  # `pgmesh pause` (or paused on the target when the router started)
    DRIFT = "schema drift"  # the nodes' replicated tables differ (router.ddl.drift)
    CLOCK = "clock skew"  # a node's clock is beyond [clocks] max_offset_ms (router.service.clocks)


class LinkState(enum.Enum):
    """What `pgmesh status`, /status, the metrics and `applier.state` show: see `shown`."""

    STREAMING = "streaming"
    PAUSED = "paused"
    CATCHING_UP = "catching up"
    DOWN = "down"
    ERROR = "error"
    SCHEMA_DRIFT = "schema drift"  # held on schema drift
    CLOCK_SKEW = "clock skew"  # held on clock skew


_L = Liveness
RUNNING: Final = frozenset({_L.STREAMING, _L.CATCHING_UP})
# Where the liveness may go from each state. A link that connects runs (STREAMING or CATCHING_UP, which
# follow the backlog after each batch) or fails; a running one fails (DOWN: retried; ERROR: stopped). A
# link DOWN runs again only through CONNECTING, and one on an ERROR only once `pgmesh resume` sends it
# to CONNECTING: nothing runs straight out of DOWN or ERROR, and nothing reconnects while it runs.
TRANSITIONS: Final[Mapping[Liveness, frozenset[Liveness]]] = {
    _L.DOWN: frozenset({_L.DOWN, _L.CONNECTING, _L.ERROR}),
    _L.CONNECTING: frozenset({*RUNNING, _L.CONNECTING, _L.DOWN, _L.ERROR}),
    _L.STREAMING: frozenset({*RUNNING, _L.DOWN, _L.ERROR}),
    _L.CATCHING_UP: frozenset({*RUNNING, _L.DOWN, _L.ERROR}),
    _L.ERROR: frozenset({_L.ERROR, _L.CONNECTING}),
}

_S = LinkState
# What the operator sees, first match wins: an ERROR stays in view whatever holds the link (until it is
# resumed); then schema drift (re-checked while it lasts), the operator's pause, and clock skew, which
# shows only on a link that runs (one down or connecting shows "down").
_HOLDS_SHOWN: Final[tuple[tuple[LinkHold, LinkState, frozenset[Liveness]], ...]] = (
    (LinkHold.DRIFT, _S.SCHEMA_DRIFT, frozenset(Liveness)),
    (LinkHold.PAUSE, _S.PAUSED, frozenset(Liveness)),
    (LinkHold.CLOCK, _S.CLOCK_SKEW, RUNNING),
)
_LIVENESS_SHOWN: Final[Mapping[Liveness, LinkState]] = {
    _L.CONNECTING: _S.DOWN, _L.DOWN: _S.DOWN, _L.ERROR: _S.ERROR,
    _L.STREAMING: _S.STREAMING, _L.CATCHING_UP: _S.CATCHING_UP,
}


class Shown(NamedTuple):
    state: LinkState
    error: str | None
    why: Liveness | LinkHold  # what put it there (how a move into it is logged)


def shown(liveness: Liveness, error: str | None, holds: Mapping[LinkHold, str | None]) -> Shown:
    """The state and last error the operator sees, from the liveness (and its error) and the holds (and
    their reasons)."""
    if liveness is not _L.ERROR:
        for hold, state, under in _HOLDS_SHOWN:
            if hold in holds and liveness in under:
                return Shown(state, holds[hold], hold)
    return Shown(_LIVENESS_SHOWN[liveness], error, liveness)


# How a move into each shown state is logged, by what put it there: level, what the link does, what
# comes after the error; None: not logged (a link connecting shows "down" but is no news).
_LOG: Final[Mapping[Liveness | LinkHold, tuple[int, str, str] | None]] = {
    _L.DOWN: (logging.WARNING, "is down", "; retrying"),
    _L.ERROR: (logging.ERROR, "paused", " (fix it, then `pgmesh resume`)"),
    _L.CONNECTING: None,
    _L.STREAMING: (logging.DEBUG, "streaming", ""),
    _L.CATCHING_UP: (logging.DEBUG, "catching up", ""),
    LinkHold.PAUSE: (logging.INFO, "paused", ""),
    # router.ddl.drift logs the drift once, naming node, table and column (not once per link)
    LinkHold.DRIFT: (logging.DEBUG, "holds on schema drift", ""),
    # router.service.clocks logs the skew once per node (not once per link)
    LinkHold.CLOCK: (logging.DEBUG, "holds on clock skew", ""),
}


class LinkCondition:
    """One link's liveness (with the error that moved it last) and its holds (each with its reason); what
    the operator sees of them is `state` and `last_error`."""

    __slots__ = ("_shown", "error", "holds", "liveness", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.liveness = Liveness.DOWN
        self.error: str | None = None
        self.holds: dict[LinkHold, str | None] = {}
        self._shown = shown(self.liveness, self.error, self.holds)

    @property
    def state(self) -> LinkState:
        return self._shown.state

    @property
    def last_error(self) -> str | None:
        return self._shown.error

    def shows(self, why: Liveness | LinkHold) -> bool:
        """Whether what the operator sees comes from `why` (a hold shown, or the liveness)."""
        return self._shown.why is why

    def to(self, liveness: Liveness, error: str | None = None, *, keep_error: bool = False) -> None:
        """The one way to change the liveness: checks the transition, records `error` (or keeps the last
        one with `keep_error`) and logs what the operator sees change, once."""
        if liveness not in TRANSITIONS[self.liveness]:
            raise RuntimeError(f"link {self.name}: no move from {self.liveness.value} to {liveness.value}")
        self.liveness, self.error = liveness, self.error if keep_error else error
        self._show()

    def add_hold(self, hold: LinkHold, reason: str | None = None) -> None:
        """A watcher (or the operator) holds the link, saying why (None: nothing to add)."""
        self.holds[hold] = reason
        self._show()

    def drop_hold(self, hold: LinkHold) -> None:
        if self.holds.pop(hold, False) is not False:
            self._show()

    def _show(self) -> None:
        was, now = self._shown, shown(self.liveness, self.error, self.holds)
        self._shown = now
        moved = now.state is not was.state
        if not moved and now.error == was.error:
            return
        log = _LOG[now.why]
        if log is not None and (moved or now.error is not None):  # an error cleared is no news
            level, what, after = log
            logger.log(level, "link %s %s%s%s", self.name, what, f": {now.error}" if now.error else "", after)


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
