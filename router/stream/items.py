"""What a replication source takes and hands out besides transactions: its options (`SourceOptions`),
the announcement of a streamed transaction before its commit (`EarlyStream`), IDENTIFY_SYSTEM's answer
(`SystemInfo`), and the `publication_names` option's quoting.

Must not: open a connection or read a stream (router.stream.connection and router.stream.source do).
"""

from __future__ import annotations

from typing import Final

import msgspec

from protocol.transactions import Transaction
from router.stream.spool import SpillFile

__all__ = ["ORIGIN_NONE_SINCE", "EarlyStream", "SourceOptions", "SystemInfo", "publication_list"]

ORIGIN_NONE_SINCE: Final = 160000  # server_version_num from which pgoutput takes `origin 'none'`


class SourceOptions(msgspec.Struct, frozen=True):
    """How a source talks to its node. Times in seconds."""

    proto_version: int = 2
    streaming: bool = True
    binary: bool = True
    messages: bool = True
    status_interval: float = 10.0
    receive_timeout: float = 60.0
    backoff_initial: float = 0.2
    backoff_max: float = 10.0
    connect_timeout: float = 10.0
    advance_when_idle: bool = True
    skip_echo_rows: bool = False  # do not decode the rows of transactions that carry an origin
    # PostgreSQL 16+: ask pgoutput for `origin 'none'`, so that the walsender neither decodes nor sends
    # what carries a replication origin (pgmesh's applied transactions: echoes); 15 has no such option
    origin_none: bool = False
    application_name: str = "pgmesh"
    spill_bytes: int = 0  # an open transaction's payload kept in memory before the rest spills (0: never)
    # hand a plain transaction out at its first spill, before its commit arrives (appliers start on it)
    early_spilled: bool = False
    # announce a streamed transaction at its first spill (an EarlyStream item), before it commits
    early_streamed: bool = False


class EarlyStream(msgspec.Struct, frozen=True, gc=False):
    """A streamed transaction still in progress on the source, announced at its first spill.

    `txn` is it as far as it came (`TransactionAssembler.open_stream`: no commit LSN or time yet;
    `txn.relations` keeps growing); `spill` (`txn.spill`) is its spill file, growing
    (`SpillFile.live`): read it with `read_frames` and wait on `changed`. It may still abort (the
    file is then `abandoned`). If it commits, its Transaction comes out of `stream()` in commit order
    as usual, with this same file, which then also has `final` set. Whoever keeps the file for later
    `acquire`s it (and releases it).
    """

    txn: Transaction

    @property
    def spill(self) -> SpillFile:
        handle = self.txn.spill
        assert isinstance(handle, SpillFile)  # set at the announcement (ReplicationSource._spill)
        return handle


class SystemInfo(msgspec.Struct, frozen=True):
    system_id: str
    timeline: int
    xlogpos: int
    dbname: str | None


def publication_list(names: tuple[str, ...] | list[str]) -> str:
    """`publication_names` option value: a quoted literal holding a list of quoted identifiers."""
    idents = ",".join('"' + n.replace('"', '""') + '"' for n in names)
    return "'" + idents.replace("'", "''") + "'"
