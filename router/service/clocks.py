"""The router's clock watch: every node's clock offset from the router's, measured every `refresh_s`
on a short connection of its own (router.cluster.clocks measures), judged against `[clocks]`, logged once
when a node's level changes (never at every refresh), and handed to each link as a `LinkClock`.

Last-update-wins converges only if no remote change is applied on a target before the *target's* clock
has passed the change's commit time (docs/conflicts.md, "Why all nodes reach the same state", condition
1). A `LinkClock` is what an applier sees of that (router.apply.clock's `LinkClockView`): the target's
offset (the applier waits until router clock + offset has passed a commit time) and whether the link is
held (it decides by commit times, and its source or target is beyond `max_offset_ms`). The applier waits
out the hold itself; at each refresh the watch also reports the hold to an idle link's condition
(`LinkCondition.add_hold` / `drop_hold`). A held link shows state "clock skew" with the node, the offset
and the bound, and runs again by itself once the offsets are back under the bound.

Must not: change any clock, write to a node, set a link's state (it reports the clock hold), decide
anything about a link but that hold, or keep a connection open between refreshes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Final

import psycopg

from router.apply.state import LinkCondition, LinkHold
from router.cluster.clocks import (
    ClockLevel,
    NodeClock,
    Sample,
    connection_query,
    decides_by_time,
    level_of,
    measure,
    node_clock,
)
from router.config.model import Config
from router.errors import describe

__all__ = ["REFRESH_S", "TIMEOUT_S", "ClockWatch", "LinkClock"]

logger = logging.getLogger(__name__)

REFRESH_S: Final = 10.0
TIMEOUT_S: Final = 5.0  # connecting and measuring one node


def _ms(seconds: float) -> str:
    return f"{seconds * 1000 + 0.0:+.1f} ms"  # + 0.0: no "-0.0"


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
    """One link's view of the clocks, handed to its applier (a `router.apply.clock.LinkClockView`): the
    target's offset (its future-commit guard) and the clock hold. Without a watch: offset 0, never held."""

    __slots__ = ("_condition", "_watch", "source", "target")

    def __init__(self, watch: ClockWatch | None, source: str, target: str) -> None:
        self._watch = watch
        self.source = source
        self.target = target
        self._condition: LinkCondition | None = None

    def offset(self) -> float:
        """Seconds the target's clock is ahead of the router's (router clock + offset = target clock)."""
        return self._watch.offset(self.target) if self._watch is not None else 0.0

    def skewed(self) -> str | None:
        """Why the link must not apply now (its source's or target's clock beyond the bound), or None."""
        watch = self._watch
        if watch is None or not watch.time_based:
            return None
        return watch.over(self.target) or watch.over(self.source)

    async def measured(self) -> None:
        if self._watch is not None and not self._watch.rounds:
            await self._watch.next_round()

    async def next_round(self) -> None:
        if self._watch is not None:
            await self._watch.next_round()

    def report_to(self, condition: LinkCondition) -> None:
        """The link's condition, told of the clock hold (and of its end) at each refresh, idle or not."""
        self._condition = condition
        self.show()

    def show(self) -> None:
        condition = self._condition
        if condition is None:
            return
        reason = self.skewed()
        if reason is not None:
            condition.add_hold(LinkHold.CLOCK, reason)
        else:
            condition.drop_hold(LinkHold.CLOCK)
