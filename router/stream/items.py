"""What a replication source takes and hands out besides transactions: its options (`SourceOptions`),
what they come to on one server (`StreamSettings`, chosen by `negotiate` from its version), the
announcement of a streamed transaction before its commit (`EarlyStream`), IDENTIFY_SYSTEM's answer
(`SystemInfo`), the `publication_names` option's quoting, and the prefix of the logical message a DDL
command travels in (`DDL_PREFIX`: the fan-out hands a transaction carrying one on; its format is
router.ddl.messages').

Must not: open a connection or read a stream (router.stream.connection and router.stream.source do).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal

import msgspec

from protocol.transactions import Transaction
from router.stream.spool import SpillFile

__all__ = [
    "DDL_PREFIX", "ORIGIN_NONE_SINCE", "PROTO_4_SINCE", "EarlyStream", "SourceOptions", "StreamSettings",
    "SystemInfo", "binary_formats_match", "highest_proto_version", "negotiate", "publication_list",
]

ORIGIN_NONE_SINCE: Final = 160000  # server_version_num from which pgoutput takes `origin 'none'`
PROTO_4_SINCE: Final = 160000  # ... and proto_version 4 (streaming 'parallel')
DDL_PREFIX: Final = "pgmesh.ddl"  # a DDL command's logical message (`Transaction.prefixes` tells who has one)


class SourceOptions(msgspec.Struct, frozen=True):
    """How a source talks to its node. Times in seconds. What they come to on one server: `negotiate`."""

    proto_version: int = 0  # 0: the highest the server speaks that the decoder reads (highest_proto_version)
    streaming: bool = True
    # With proto_version 4 (16+): streaming 'parallel' rather than 'on'. pgoutput's only use of the mode is
    # Stream Abort, which then also carries the abort's LSN and time; when it opens stream blocks and what
    # they hold are the same (PostgreSQL 18 captures of both: tests/unit/protocol/test_proto_v4.py). The
    # router gains little from it (a streamed transaction is dropped, or rolled back where it was started
    # early, at its Stream Abort either way); the decoder reads the fields and the StreamAbort keeps them.
    parallel_streaming: bool = True
    binary: bool = True  # asked for; sent only where the formats match (`binary_formats_match`)
    # server_version_num of every node this source's changes are applied to (empty: none named, as for a
    # capture or a bench: `binary` as asked)
    target_versions: tuple[int, ...] = ()
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
    # the node waits for this connection's feedback (synchronous_standby_names names it: docs/synchronous.md):
    # a keepalive that moves the server's WAL end (one follows each commit the walsender skips) is answered
    # at once, so that a commit with nothing for the router does not wait for the status timer
    synchronous: bool = False


StreamingMode = Literal["off", "on", "parallel"]


class StreamSettings(msgspec.Struct, frozen=True):
    """What START_REPLICATION asks of one server (`negotiate`): its pgoutput options."""

    proto_version: int
    streaming: StreamingMode
    binary: bool
    messages: bool
    origin_none: bool

    @property
    def abort_info(self) -> bool:
        """Stream Abort carries the abort's LSN and time (pgoutput writes them only under 'parallel')."""
        return self.streaming == "parallel"

    def option_list(self, publications: tuple[str, ...] | list[str]) -> str:
        """The parenthesised option list of START_REPLICATION ... LOGICAL."""
        opts = [f"proto_version '{int(self.proto_version)}'"]
        opts.append(f"publication_names {publication_list(publications)}")
        if self.origin_none:
            opts.append("origin 'none'")
        if self.binary:
            opts.append("binary 'true'")
        if self.messages:
            opts.append("messages 'true'")
        if self.streaming != "off":
            opts.append(f"streaming '{'true' if self.streaming == 'on' else 'parallel'}'")
        return f"({', '.join(opts)})"


def highest_proto_version(server_version: int) -> int:
    """The highest pgoutput proto_version `server_version` speaks that pgmesh reads: 4 on 16+, 2 on 15.

    15 also speaks 3, which only adds the two-phase messages, sent with `two_phase 'on'` alone: pgmesh
    never asks for it (a prepared transaction arrives whole at COMMIT PREPARED), so 3 would change
    nothing on 15 and 2 stays. 4 adds streaming 'parallel'; what else 16-18 send is as in 2.
    """
    return 4 if server_version >= PROTO_4_SINCE else 2


def binary_formats_match(source_version: int, target_versions: Iterable[int]) -> bool:
    """Whether a value in its type's binary send format from `source_version` is known to be read back
    alike by every target: only when all run the source's major version.

    Built-in types' send/recv formats are stable across 15-18, but an extension's or a user's type is
    not guaranteed to be: a mesh of mixed majors gets text (output and input functions) for that source.
    No targets: nothing to match (True).
    """
    major = source_version // 10000
    return all(v // 10000 == major for v in target_versions)


def negotiate(options: SourceOptions, server_version: int) -> StreamSettings:
    """The pgoutput options to ask a server of `server_version` (server_version_num) for.

    proto_version as asked, else the highest both sides speak; streaming 'parallel' when asked for and
    proto_version 4 allows it, else 'on' (2+) or off; binary only where `binary_formats_match`;
    `origin 'none'` on 16+ only (15 rejects the option).
    """
    proto = options.proto_version or highest_proto_version(server_version)
    streaming: StreamingMode = "off"
    if options.streaming and proto >= 2:
        streaming = "parallel" if options.parallel_streaming and proto >= 4 else "on"
    return StreamSettings(
        proto_version=proto,
        streaming=streaming,
        binary=options.binary and binary_formats_match(server_version, options.target_versions),
        messages=options.messages,
        origin_none=options.origin_none and server_version >= ORIGIN_NONE_SINCE,
    )


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
