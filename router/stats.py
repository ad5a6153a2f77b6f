"""Reading one counter off its owner: `owner.<name>` is `owner.stats.<name>`, read-only.

The counters of a link (`router.apply.state.LinkStats`) and of a source (`router.stream.state.SourceStats`)
live in one struct each, which the supervisor and the metrics read whole. `StatView` lets callers that
want a single counter (tests, the bench, the operator's status) read it on the owner as before.

Must not: hold a counter itself, or let a write through (a value set on the owner would hide the
counter in the struct: it raises).
"""

from __future__ import annotations

from typing import Any, Protocol, overload

__all__ = ["StatView"]


class _HasStats(Protocol):
    @property
    def stats(self) -> Any: ...


class StatView:
    """A class attribute naming one field of the owner's `stats` struct."""

    __slots__ = ("name",)

    def __init__(self) -> None:
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> StatView: ...

    @overload
    def __get__(self, obj: _HasStats, owner: type | None = None) -> int: ...

    def __get__(self, obj: _HasStats | None, owner: type | None = None) -> int | StatView:
        if obj is None:
            return self  # on the class: the view itself
        value: int = getattr(obj.stats, self.name)
        return value

    def __set__(self, obj: _HasStats, value: int) -> None:
        raise AttributeError(f"{self.name} is counted in the owner's stats (stats.{self.name})")
