"""pgmesh's sans-I/O protocol layer: bytes in, messages out.

This package decodes the streaming replication CopyData framing and PostgreSQL's pgoutput logical
decoding output (proto_version 1 to 4, as PostgreSQL 15-18 send it; no two-phase messages), keeps a
relation cache and assembles whole transactions. It never touches a socket, a clock or an event loop: it
imports only the standard library and msgspec, so the router, the tests and the benchmarks can all drive
it with plain bytes.
"""

from __future__ import annotations

from protocol.errors import (
    MalformedMessage,
    ProtocolError,
    TruncatedMessage,
    UnknownMessage,
    UnknownRelation,
    WrongState,
)
from protocol.lsn import LSN, format_lsn, parse_lsn

__all__ = [
    "LSN",
    "MalformedMessage",
    "ProtocolError",
    "TruncatedMessage",
    "UnknownMessage",
    "UnknownRelation",
    "WrongState",
    "format_lsn",
    "parse_lsn",
]
