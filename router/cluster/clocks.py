"""Node clocks measured: each node's clock offset from the router's (or this host's), and how it
compares with `[clocks]`; the checks (`pgmesh init`, `status` without a router) and the router's clock
watch (router.service.clocks, which hands the appliers their guard and their hold) use it.

Last-update-wins converges only if no remote change is applied on a target before the *target's* clock
has passed the change's commit time (docs/conflicts.md, "Why all nodes reach the same state", condition
1). The router's clock is not the target's when the router runs on another host, so the router measures
each node: `SELECT clock_timestamp()`, timed by the router's clock; the node's offset is its time minus
the midpoint of send and receive (`sample`), off by at most half the round trip, so of a few tries the
one with the shortest round trip is kept (`best`). Each offset is judged against `[clocks]`
(`ClockLevel`, `level_of`) and shown as a `NodeClock`.

Must not: change any clock, write to a node, keep a connection, or know about links (the router's
`ClockWatch` in router.service.clocks does).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final

import msgspec
import psycopg

from router.config.model import ClocksSection, Config
from router.conflicts.resolve import Resolver

__all__ = [
    "CLOCK_SQL",
    "ClockLevel",
    "NodeClock",
    "Sample",
    "best",
    "connection_query",
    "decides_by_time",
    "level_of",
    "measure",
    "node_clock",
    "sample",
]

# seconds since the Unix epoch, a float: a timestamptz would come back in the node's DateStyle, which a
# client cannot always read (psycopg: ISO only)
CLOCK_SQL: Final = "SELECT pg_catalog.date_part('epoch', pg_catalog.clock_timestamp())"
TRIES: Final = 5  # measurements per refresh; the one with the shortest round trip is kept
# Resolvers that compare commit times: a skewed clock can make them pick the wrong version.
TIME_RESOLVERS: Final = frozenset(
    {Resolver.LAST_UPDATE_WINS, Resolver.FIRST_UPDATE_WINS, Resolver.NODE_PRIORITY}
)

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
