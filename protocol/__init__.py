"""pgmesh's sans-I/O protocol layer: bytes in, messages out.

This package decodes the streaming replication CopyData framing and PostgreSQL's pgoutput logical
decoding output (proto_version 1 to 4, as PostgreSQL 15-18 send it; no two-phase messages), keeps a
relation cache and assembles whole transactions. It never touches a socket, a clock or an event loop: it
imports only the standard library and msgspec, so the router, the tests and the benchmarks can all drive
it with plain bytes.

  replication.py   the streaming replication CopyData framing (both directions)
  copyframes.py    the backend messages of a replication socket read past libpq, split into frames
  pgoutput.py      the decoder of pgoutput's binary messages
  messages.py      those messages as frozen data
  relations.py     the relation cache: what each relation id means right now
  transactions.py  the assembler: messages in, whole committed transactions out
  changes.py       the kinds of change a transaction carries, and one `{change kind: handler}` table
  lsn.py           WAL positions and PostgreSQL timestamps
  frontend.py      the extended query protocol's frontend side: Parse/Bind/Execute/Close/Sync, results
  errors.py        the errors this layer raises
  native.py        whether the hot modules run compiled (mypyc, `deploy/compile.py`) or as these sources

The hot modules (`native.COMPILED`) are imported from a compiled build in `_native/` when one was built
from exactly these sources by this interpreter and `PGMESH_PURE_PYTHON` is not set (`compiled` says
which); otherwise, and always without a build, from the sources. Both behave the same: the unit tests
run both ways (`./dev test`).
"""

from __future__ import annotations

from pathlib import Path as _Path

from protocol.errors import (
    MalformedMessage,
    ProtocolError,
    TruncatedMessage,
    UnknownMessage,
    UnknownRelation,
    WrongState,
)
from protocol.lsn import LSN, format_lsn, parse_lsn
from protocol.native import native_dir as _native_dir

# Before any of `native.COMPILED` is imported (errors and lsn, above, are never compiled): a current
# build comes first on the package's path.
_NATIVE = _native_dir(_Path(__file__).parent)
if _NATIVE is not None:
    __path__.insert(0, _NATIVE)

compiled: bool = _NATIVE is not None
"""Whether the hot modules come from a compiled build (`protocol.native`)."""

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
