"""pgmesh's sans-I/O protocol layer: bytes in, messages out.

This package decodes the streaming replication CopyData framing and PostgreSQL's pgoutput logical
decoding output (proto_version 1 to 4, as PostgreSQL 15-18 send it; no two-phase messages), keeps a
relation cache and assembles whole transactions. It never touches a socket, a clock or an event loop: it
imports only the standard library and msgspec, so the router, the tests and the benchmarks can all drive
it with plain bytes.

  replication.py   the streaming replication CopyData framing (both directions)
  pgoutput.py      the decoder of pgoutput's binary messages
  messages.py      those messages as frozen data
  relations.py     the relation cache: what each relation id means right now
  transactions.py  the assembler: messages in, whole committed transactions out
  changes.py       the kinds of change a transaction carries, and one `{change kind: handler}` table
  lsn.py           WAL positions and PostgreSQL timestamps
  frontend.py      the extended query protocol's frontend side: Parse/Bind/Execute/Close/Sync, results
  errors.py        the errors this layer raises
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
