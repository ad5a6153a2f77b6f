"""Errors raised by the protocol layer.

Every failure to decode or assemble replication input surfaces as a `ProtocolError` (or a subclass) that
carries the WAL position of the offending message, so the router can name the node and LSN when it
reports it. Nothing in `protocol/` may let another exception type escape on bad input.
"""

from __future__ import annotations

__all__ = [
    "MalformedMessage",
    "ProtocolError",
    "TruncatedMessage",
    "UnknownMessage",
    "UnknownRelation",
    "WrongState",
]


def _lsn_text(lsn: int | None) -> str:
    if lsn is None:
        return "unknown LSN"
    return f"LSN {(lsn >> 32) & 0xFFFFFFFF:X}/{lsn & 0xFFFFFFFF:X}"


class ProtocolError(Exception):
    """Replication input that pgmesh cannot decode or that breaks the protocol's rules."""

    def __init__(self, detail: str, *, lsn: int | None = None, tag: str | None = None) -> None:
        self.detail = detail
        self.lsn = lsn
        self.tag = tag
        where = _lsn_text(lsn)
        if tag is not None:
            where += f", message {tag!r}"
        super().__init__(f"{detail} ({where})")


class TruncatedMessage(ProtocolError):
    """The message ended before all of its fields were read."""


class MalformedMessage(ProtocolError):
    """A field holds a value the protocol does not allow (bad kind byte, negative length, trailing bytes)."""


class UnknownMessage(ProtocolError):
    """A message tag that this decoder does not know (for example a newer protocol version's)."""


class WrongState(ProtocolError):
    """A message that is valid alone but not at this point of the stream (Commit without Begin, ...)."""


class UnknownRelation(ProtocolError):
    """A row change names a relation id for which no Relation message has been seen."""

    def __init__(self, relid: int, *, lsn: int | None = None, tag: str | None = None) -> None:
        self.relid = relid
        super().__init__(f"change for relation id {relid} before its Relation message", lsn=lsn, tag=tag)
