"""What an applier sees of the node clocks: its target's offset from the router's clock (its
future-commit guard) and whether the link is held for clock skew; `NoClock` when nothing measures them.

The service's clock watch (router.service.clocks) measures the nodes and hands each applier its
`LinkClockView`; the applier alone moves its own state (it waits here and reports the hold to its
`LinkCondition`).

Must not: measure anything, or import the service that does.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["LinkClockView", "NoClock"]


class LinkClockView(Protocol):
    """One link's view of the clocks."""

    def offset(self) -> float:
        """Seconds the target's clock is ahead of the router's (router clock + offset = target clock)."""
        ...

    def skewed(self) -> str | None:
        """Why the link must not apply now (its source's or target's clock is too far off), or None."""
        ...

    async def measured(self) -> None:
        """Return once the clocks have been measured (no commit time is applied before that)."""
        ...

    async def next_round(self) -> None:
        """Return after the next measurement."""
        ...


class NoClock:
    """No clock watch (tests, tools): offset 0, never held."""

    __slots__ = ()

    def offset(self) -> float:
        return 0.0

    def skewed(self) -> str | None:
        return None

    async def measured(self) -> None:
        return None

    async def next_round(self) -> None:  # never awaited: never held
        return None
