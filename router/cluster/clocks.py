"""Node clocks: each node's clock offset from the router's, measured, judged against `[clocks]`, and
handed to the appliers (their future-commit guard and their hold).

Last-update-wins converges only if no remote change is applied on a target before the *target's* clock
has passed the change's commit time (docs/conflicts.md, "Why all nodes reach the same state", condition
1). The router's clock is not the target's when the router runs on another host, so the router measures
each node: `SELECT clock_timestamp()`, timed by the router's clock; the node's offset is its time minus
the midpoint of send and receive (`sample`), off by at most half the round trip, so of a few tries the
one with the shortest round trip is kept (`best`). `ClockWatch` does that for every node every
`refresh_s` on a short connection of its own, judges each offset against `[clocks]` (`ClockLevel`), logs
one line when a node's level changes (never at every refresh), and hands each link a `LinkClock`: the
target's offset (the applier waits until router clock + offset has passed a commit time) and whether the
link is held (it decides by commit times, and its source or target is beyond `max_offset_ms`). A held
link shows state "clock skew" with the node, the offset and the bound, and runs again by itself once the
offsets are back under the bound.

Must not: change any clock, write to a node, decide anything about a link but the clock hold, or keep a
connection open between refreshes.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Final

import msgspec
import psycopg

from router.apply.state import LinkCondition, LinkState
from router.config.model import ClocksSection, Config
from router.conflicts.resolve import Resolver
from router.errors import describe

__all__ = [
    "CLOCK_SQL",
    "ClockLevel",
    "ClockWatch",
    "LinkClock",
    "NodeClock",
    "Sample",
    "best",
    "decides_by_time",
    "level_of",
    "measure",
    "sample",
]

logger = logging.getLogger(__name__)

# seconds since the Unix epoch, a float: a timestamptz would come back in the node's DateStyle, which a
# client cannot always read (psycopg: ISO only)
CLOCK_SQL: Final = "SELECT pg_catalog.date_part('epoch', pg_catalog.clock_timestamp())"
TRIES: Final = 5  # measurements per refresh; the one with the shortest round trip is kept
REFRESH_S: Final = 10.0
TIMEOUT_S: Final = 5.0  # connecting and measuring one node
# Resolvers that compare commit times: a skewed clock can make them pick the wrong version.
TIME_RESOLVERS: Final = frozenset(
    {Resolver.LAST_UPDATE_WINS, Resolver.FIRST_UPDATE_WINS, Resolver.NODE_PRIORITY}
)
_SHOWN: Final = frozenset({LinkState.STREAMING, LinkState.CATCHING_UP, LinkState.CLOCK_SKEW})

# A query on one node: sql -> rows.
Query = Callable[[str], Awaitable[list[tuple[Any, ...]]]]


class Sample(msgspec.Struct, frozen=True):
    """One measurement of a node's clock against the router's."""

    offset: float  # seconds the node's clock is ahead of the router's (negative: behind)
    round_trip: float  # seconds from send to receive; the offset is off by at most half of it


def sample(sent: float, server: float, received: float) -> Sample:
    """The node read `server` (its clock) between `sent` and `received` (the router's clock): it is
    assumed to have read it halfway."""
    return Sample(server - (sent + received) / 2, received - sent)


def best(samples: Iterable[Sample]) -> Sample | None:
    """The sample with the shortest round trip (the tightest bound on its error); None for none."""
    return min(samples, key=lambda s: s.round_trip, default=None)


async def measure(query: Query, clock: Callable[[], float] = time.time, tries: int = TRIES) -> Sample:
    """`tries` measurements of the node behind `query`; the one with the shortest round trip."""
    found = []
    for _ in range(tries):
        sent = clock()
        rows = await query(CLOCK_SQL)
        received = clock()
        found.append(sample(sent, float(rows[0][0]), received))
    chosen = best(found)
    assert chosen is not None  # tries >= 1
    return chosen


def connection_query(conn: psycopg.AsyncConnection[Any]) -> Query:
    """`Query` on an open connection (`pgmesh init`'s, `status`'s without a router)."""

    async def query(sql: str) -> list[tuple[Any, ...]]:
        cur = await conn.execute(sql)
        return await cur.fetchall()

    return query


def decides_by_time(config: Config) -> bool:
    """Whether any resolver the config sets compares commit times (a custom one is not judged)."""
    section = config.conflicts
    names = [section.resolver, *section.types.values()]
    for entry in config.tables:
        names += [*([entry.resolver] if entry.resolver else []), *entry.types.values()]
    return any(name in TIME_RESOLVERS for name in names)


class ClockLevel(enum.Enum):
    UNKNOWN = "unknown"  # not measured yet (a node that never answered)
    OK = "ok"
    WARN = "warn"  # beyond warn_offset_ms: logged
    OVER = "over"  # beyond max_offset_ms: the links that decide by commit times hold


def level_of(offset: float, bounds: ClocksSection) -> ClockLevel:
    """How an offset (seconds) compares with the bounds (milliseconds)."""
    ms = abs(offset) * 1000
    if ms > bounds.max_offset_ms:
        return ClockLevel.OVER
    return ClockLevel.WARN if ms > bounds.warn_offset_ms else ClockLevel.OK


def _ms(seconds: float) -> str:
    return f"{seconds * 1000 + 0.0:+.1f} ms"  # + 0.0: no "-0.0"


class NodeClock(msgspec.Struct, frozen=True):
    """One node's clock as `pgmesh status` shows it."""

    node: str
    level: str  # ClockLevel's value
    offset_ms: float | None = None  # ahead of the router's clock (negative: behind)
    round_trip_ms: float | None = None
    bound_ms: int | None = None  # the bound it is beyond (warn or over), else None
    error: str | None = None  # the last refresh failed (the offset shown is the one before)

    def describe(self) -> str:
        if self.offset_ms is None:
            return f"not measured{': ' + self.error if self.error else ''}"
        text = f"{self.offset_ms + 0.0:+.1f} ms from the router's (round trip {self.round_trip_ms:.1f} ms)"
        if self.level == ClockLevel.OVER.value:
            text += (f", beyond [clocks] max_offset_ms = {self.bound_ms}: links deciding by commit times"
                     " into and out of it hold")
        elif self.level == ClockLevel.WARN.value:
            text += f", beyond [clocks] warn_offset_ms = {self.bound_ms}"
        return text + (f" (last refresh failed: {self.error})" if self.error else "")


def node_clock(node: str, found: Sample | None, bounds: ClocksSection, error: str | None = None) -> NodeClock:
    if found is None:
        return NodeClock(node, ClockLevel.UNKNOWN.value, error=error)
    level = level_of(found.offset, bounds)
    bound = {ClockLevel.OVER: bounds.max_offset_ms, ClockLevel.WARN: bounds.warn_offset_ms}.get(level)
    return NodeClock(node, level.value, round(found.offset * 1000, 3), round(found.round_trip * 1000, 3),
                     bound, error)


class ClockWatch:
    """Every node's clock offset, refreshed every `refresh_s`; the links' `LinkClock`s read it."""

    __slots__ = ("_dsns", "_links", "_round", "bounds", "errors", "levels", "refresh_s", "rounds", "samples",
                 "time_based")

    def __init__(self, config: Config, *, dsns: Mapping[str, str] | None = None) -> None:
        self.bounds = config.clocks
        self.time_based = decides_by_time(config)
        self._dsns = dict(dsns if dsns is not None else {n.name: n.dsn for n in config.nodes})
        self.refresh_s = REFRESH_S
        self.samples: dict[str, Sample] = {}
        self.levels: dict[str, ClockLevel] = dict.fromkeys(self._dsns, ClockLevel.UNKNOWN)
        self.errors: dict[str, str] = {}
        self._links: dict[tuple[str, str], LinkClock] = {}
        self._round = asyncio.Event()  # set (and replaced) after each refresh
        self.rounds = 0  # refreshes done

    def link(self, source: str, target: str) -> LinkClock:
        """The `LinkClock` of source -> target (one per link)."""
        key = (source, target)
        if key not in self._links:
            self._links[key] = LinkClock(self, source, target)
        return self._links[key]

    def offset(self, node: str) -> float:
        """Seconds `node`'s clock is ahead of the router's; 0 while unknown."""
        found = self.samples.get(node)
        return found.offset if found is not None else 0.0

    def over(self, node: str) -> str | None:
        """Why links deciding by commit times must not run through `node`, or None."""
        found = self.samples.get(node)
        if found is None or self.levels.get(node) is not ClockLevel.OVER:
            return None
        return (f"the clock of node {node} is {_ms(found.offset)} from the router's, beyond [clocks]"
                f" max_offset_ms = {self.bounds.max_offset_ms}: commit times cannot decide conflicts there;"
                " held until it is back under the bound (sync its clock)")

    def record(self, node: str, found: Sample | None, error: str | None = None) -> None:
        """One refresh of `node`: a sample, or the error that kept it from one (the last sample stays)."""
        if found is None:
            if error is not None and self.errors.get(node) is None:
                logger.warning("clock of node %s: cannot measure it: %s", node, error)
            self.errors[node] = error or "no answer"
            return
        self.errors.pop(node, None)
        self.samples[node] = found
        level, was = level_of(found.offset, self.bounds), self.levels.get(node, ClockLevel.UNKNOWN)
        self.levels[node] = level
        if level is was:
            return
        offset, trip = _ms(found.offset), f"round trip {found.round_trip * 1000:.1f} ms"
        if level is ClockLevel.OVER:
            logger.error("clock of node %s is %s from the router's (%s), beyond [clocks] max_offset_ms = %d:"
                         " %s", node, offset, trip, self.bounds.max_offset_ms,
                         "links deciding by commit times into and out of it hold until it is back under"
                         if self.time_based else "no resolver decides by commit times")
        elif level is ClockLevel.WARN:
            logger.warning("clock of node %s is %s from the router's (%s), beyond [clocks] warn_offset_ms ="
                           " %d: sync it", node, offset, trip, self.bounds.warn_offset_ms)
        elif was is not ClockLevel.UNKNOWN:
            logger.info("clock of node %s is %s from the router's (%s), within [clocks] warn_offset_ms"
                        " = %d again", node, offset, trip, self.bounds.warn_offset_ms)

    async def _measure(self, node: str) -> None:
        try:
            async with asyncio.timeout(TIMEOUT_S):
                conn = await psycopg.AsyncConnection.connect(
                    self._dsns[node], autocommit=True, application_name="pgmesh-clock",
                    connect_timeout=int(TIMEOUT_S),
                )
                async with conn:
                    found = await measure(connection_query(conn))
        except (psycopg.Error, OSError, TimeoutError) as exc:
            self.record(node, None, describe(exc) if not isinstance(exc, TimeoutError) else "timed out")
            return
        self.record(node, found)

    async def refresh(self) -> None:
        """Measure every node once, then show and wake the links."""
        await asyncio.gather(*(self._measure(node) for node in self._dsns))
        for link in self._links.values():
            link.show()
        self.rounds += 1
        done, self._round = self._round, asyncio.Event()
        done.set()

    async def next_round(self) -> None:
        await self._round.wait()

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.refresh_s)

    def report(self) -> list[NodeClock]:
        return [node_clock(n, self.samples.get(n), self.bounds, self.errors.get(n)) for n in self._dsns]

    def problems(self) -> list[str]:
        """For the health check: every node beyond the hard bound."""
        return [f"clock skew: {reason}" for n in self._dsns if (reason := self.over(n)) is not None]

    def export(self, gauge: Any) -> None:
        """Set `pgmesh_clock_offset_seconds{node}` (router.service.metrics) for every measured node."""
        for node, found in self.samples.items():
            gauge.labels(node=node).set(found.offset)


class LinkClock:
    """One link's view of the clocks, handed to its applier: the target's offset (its future-commit
    guard) and the hold. Without a watch (tests, tools): offset 0, never held."""

    __slots__ = ("_condition", "_watch", "source", "target")

    def __init__(self, watch: ClockWatch | None, source: str, target: str) -> None:
        self._watch = watch
        self.source = source
        self.target = target
        self._condition: LinkCondition | None = None

    def offset(self) -> float:
        """Seconds the target's clock is ahead of the router's (router clock + offset = target clock)."""
        return self._watch.offset(self.target) if self._watch is not None else 0.0

    def held(self) -> str | None:
        """Why the link must not apply now (its source's or target's clock beyond the bound), or None."""
        watch = self._watch
        if watch is None or not watch.time_based:
            return None
        return watch.over(self.target) or watch.over(self.source)

    def show_on(self, condition: LinkCondition) -> None:
        """The link's condition, moved to "clock skew" (and back) at each refresh while it is idle."""
        self._condition = condition
        self.show()

    def show(self) -> None:
        condition = self._condition
        if condition is None:
            return
        reason = self.held()
        if reason is not None and condition.state in _SHOWN:
            condition.move(LinkState.CLOCK_SKEW, reason)
        elif reason is None and condition.state is LinkState.CLOCK_SKEW:
            condition.move(LinkState.STREAMING, None)

    async def hold(self, condition: LinkCondition) -> bool:
        """Wait while the link is held, showing why on `condition`; True if it waited."""
        waited = False
        if self._watch is not None and not self._watch.rounds:
            await self._watch.next_round()  # no commit time is applied before the first measurement
        while self._watch is not None and (reason := self.held()) is not None:
            waited = True
            if condition.state in _SHOWN:
                condition.move(LinkState.CLOCK_SKEW, reason)
            await self._watch.next_round()
        if waited and condition.state is LinkState.CLOCK_SKEW:
            condition.move(LinkState.STREAMING, None)
        return waited
