"""The sections of `config.toml` (and its `[[nodes]]`) as msgspec types that carry their own constraints.

Owns each `[section]`'s keys, defaults and the bounds and vocabularies of single values (`Annotated[int,
msgspec.Meta(ge=...)]`, `Literal[...]`, patterns), so msgspec refuses a bad value at decode and its path
names the key. The vocabularies (resolvers, conflict types, modes) and the schemas that never replicate
are spelled once here; `ReplicationSection.replicates` says which tables do.

Must not: check one value against another (router.config.rules does), word an error (router.config.messages
does), import router.config.model (it imports this), or connect anywhere.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Annotated, Final, Literal, get_args

import msgspec

from router.conflicts.resolve import ConflictType, Resolver

__all__ = [
    "CONFLICT_TYPES",
    "DDL_MODES",
    "DEFAULT_SCHEMA",
    "JOIN_SCHEMA",
    "NAME_PATTERN",
    "ON_REFUSED",
    "PGMESH_SCHEMA",
    "RESOLVER_NAMES",
    "SEQUENCE_MODES",
    "SYNCHRONOUS_COMMIT",
    "SYSTEM_SCHEMAS",
    "AdminSection",
    "ClocksSection",
    "ClusterSection",
    "ConflictSection",
    "ConflictTypeName",
    "DdlSection",
    "HaSection",
    "LogSection",
    "Name",
    "NodeConfig",
    "ReplicationSection",
    "ResolverName",
    "SequencesSection",
    "SyncSection",
    "TableSection",
    "VerifySection",
    "duration_seconds",
    "split_table_name",
]

# The cluster's and the nodes' names: they end up in slot, publication and origin names.
NAME_PATTERN: Final = r"^[a-z][a-z0-9_]{0,29}$"
Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]

# replication.apply_synchronous_commit: PostgreSQL's values (its aliases true/false/yes/no/1/0 are left out)
SynchronousCommit = Literal["off", "local", "remote_write", "on", "remote_apply"]
SYNCHRONOUS_COMMIT: Final[tuple[str, ...]] = get_args(SynchronousCommit)
SequenceMode = Literal["snowflake", "step"]
SEQUENCE_MODES: Final[tuple[str, ...]] = get_args(SequenceMode)
DdlMode = Literal["replicated", "locked"]
DDL_MODES: Final[tuple[str, ...]] = get_args(DdlMode)
NewTableWithoutKey = Literal["full", "warn", "refuse"]
# a change the target refuses (router.errors.is_refused): "pause" the link, or "quarantine" the change
OnRefused = Literal["pause", "quarantine"]
ON_REFUSED: Final[tuple[str, ...]] = get_args(OnRefused)

# Resolver names a config may use; "custom" is spelled as the function itself ("module:function").
RESOLVER_NAMES: Final = tuple(r.value for r in Resolver if r is not Resolver.CUSTOM)
CONFLICT_TYPES: Final = tuple(t.value for t in ConflictType)
_CUSTOM: Final = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
ResolverName = Annotated[
    str, msgspec.Meta(pattern=rf"^(?:{'|'.join(map(re.escape, RESOLVER_NAMES))})\Z|^{_CUSTOM}")
]
ConflictTypeName = Annotated[str, msgspec.Meta(pattern=rf"^(?:{'|'.join(map(re.escape, CONFLICT_TYPES))})\Z")]

# Schemas that never replicate: the system's and pgmesh's own.
PGMESH_SCHEMA: Final = "pgmesh"
# the marker of a join in progress on the new node (router.ops.join)
JOIN_SCHEMA: Final = "pgmesh_join"
SYSTEM_SCHEMAS: Final = frozenset(
    {"pg_catalog", "information_schema", "pg_toast", PGMESH_SCHEMA, JOIN_SCHEMA}
)
DEFAULT_SCHEMA: Final = "public"
# `schema.table`, or a bare `table` (schema public): neither part empty, no second dot
TableName = Annotated[str, msgspec.Meta(pattern=r"^[^.]+(?:\.[^.]+)?\Z")]
# A duration: a number and its unit, e.g. "500ms", "30s", "10m", "2h", "7d" (`duration_seconds` reads it)
Duration = Annotated[str, msgspec.Meta(pattern=r"^[0-9]+(?:\.[0-9]+)?(?:ms|s|m|h|d)\Z")]
_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class ClusterSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: Name


class NodeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One `[[nodes]]` entry."""

    name: Name
    dsn: Annotated[str, msgspec.Meta(pattern=r"\S")]  # not blank
    # receives from every other node and sends to none (router.cluster.receive: local writes refused)
    receive_only: bool = False
    # a file holding the node's password alone (a mounted secret), read through a private .pgpass copy
    # named by the dsn's passfile (router.nodes.dsn.password_file_dsn)
    password_file: str = ""
    # overrides [replication] synchronous for commits on this node (docs/synchronous.md)
    synchronous: int | None = None  # between 0 and the other nodes (router.config.rules)
    # a receive-only node's part of the data (router.cluster.partial): these tables, rows, columns only
    tables: list[str] | None = None
    rows: dict[str, str] = msgspec.field(default_factory=dict)
    columns: dict[str, list[str]] = msgspec.field(default_factory=dict)


ApplyTransport = Literal["pipeline", "script"]


class ReplicationSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which tables replicate, and how the appliers behave."""

    tables: Annotated[list[str], msgspec.Meta(min_length=1)] = msgspec.field(default_factory=lambda: ["*.*"])
    exclude: list[str] = msgspec.field(default_factory=list)
    apply_delay_ms: Annotated[int, msgspec.Meta(ge=0)] = 0
    queue_max_transactions: Annotated[int, msgspec.Meta(ge=1)] = 10_000
    # per link: MB of transactions' payload held in memory (the rest waits in the log)
    queue_max_mb: Annotated[int, msgspec.Meta(ge=1)] = 64
    # Sessions per link applying independent transactions at once, committed in source order.
    apply_lanes: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    # The appliers' sessions' synchronous_commit. "off" (as the native apply worker) loses nothing: a
    # source's slot is confirmed only up to what the target has flushed. "on", "remote_write",
    # "remote_apply" make each applied transaction wait for its flush (and for the target's synchronous
    # standbys, when it has some) before the next one; "local" ignores the standbys.
    apply_synchronous_commit: SynchronousCommit = "off"
    # A commit on a node returns only once this many other nodes have durably applied it (0: asynchronous).
    # Stock synchronous replication: the node's synchronous_standby_names names the router's replication
    # connection (`Config.standby_name`), set by `pgmesh init`; docs/synchronous.md. Its bounds depend on
    # the number of nodes (router.config.rules).
    synchronous: int = 0
    status_interval_ms: Annotated[int, msgspec.Meta(ge=10)] = 1_000
    # A node that does not answer the router's progress query within this long is taken for cut off:
    # its links show "down" and the router drops its sessions to it (router.service.supervisor)
    node_timeout_ms: Annotated[int, msgspec.Meta(ge=100)] = 10_000
    replicate_ddl: bool = True  # capture DDL with an event trigger and run it on the other nodes
    # a table without a key: "full" (REPLICA IDENTITY FULL, replicated), "warn" (a new one left local,
    # with a warning) or "refuse" (an error)
    new_table_without_key: NewTableWithoutKey = "full"
    # Per open transaction: MB of change payload (as received) kept in memory before the rest spills to
    # disk; 0: never. Inserts are held as the server's bytes (about 2x that in the router); updates and
    # deletes decoded (about 9x for rows of a few narrow columns).
    spill_mb: Annotated[int, msgspec.Meta(ge=0)] = 8  # payload bytes; about 2x (inserts) to 9x (decoded rows)
    spool_dir: str = ""  # where spilled transactions go ("": the system's temporary directory)
    # Start applying a transaction that spills before its commit arrives: one the server decoded after
    # its commit is handed out at its first spill; one it streams while still in progress is applied on
    # a second session per link from its first spill and committed in its place in commit order.
    early_apply: bool = True
    # A change the target refuses (a CHECK, foreign key or trigger there, a value its type rejects:
    # router.errors.is_refused): "pause" holds the link until `pgmesh resume`; "quarantine" sets the
    # change aside in pgmesh.quarantine on the target, with the later changes of its key, and the link
    # streams on (docs/conflicts.md "Quarantine"). `[[tables]] on_refused` overrides it per table.
    on_refused: OnRefused = "pause"
    # How the appliers send small transactions: "script" (SQL text by the simple query protocol) or
    # "pipeline" (the extended protocol, pipelined, each statement prepared once and bound to
    # the tuple's own bytes, one Sync a batch: router.apply.pipe; faster on multi-statement transactions,
    # slower on one-row inserts, so not yet the default: docs/config.md).
    # Large transactions, DDL, conflicts and parallel lanes go the script way either way.
    apply_transport: ApplyTransport = "script"

    def replicates(self, schema: str, table: str) -> bool:
        """Whether `schema.table` replicates: matched by `tables`, not by `exclude`, not a system schema."""
        if schema in SYSTEM_SCHEMAS or schema.startswith("pg_"):
            return False
        qualified = f"{schema}.{table}"
        if not any(_match(p, qualified) for p in self.tables):
            return False
        return not any(_match(p, qualified) for p in self.exclude)


class AdminSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # HOST:PORT (router.config.rules checks the port); beyond loopback only with TLS and the token
    # (docs/admin.md)
    listen: str = "127.0.0.1:8787"
    # the token POST requests need (router.service.admintoken): "" = admin.token in the state directory
    token_file: str = ""
    socket: str = ""  # a Unix socket made 0600 for the router's user: its POSTs need no token ("": none)
    tls_cert: str = ""  # PEM certificate and key: HTTPS on listen (both or neither; checked at start)
    tls_key: str = ""
    # a request must arrive whole within this after connecting (checked at start: router.service.admin)
    header_timeout_ms: int = 10_000


class SequencesSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`[sequences]`: how `pgmesh sequences convert` makes ids unique across nodes (docs/sequences.md)."""

    mode: SequenceMode = "snowflake"  # "snowflake" (bigint ids: time, node id, counter) or "step"
    # step mode: each node's values are node_id mod step, so step > every node id (router.config.rules)
    step: int = 100


class DdlSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`[ddl]`: how DDL may run (docs/ddl.md). "replicated": DDL run on any node is replayed on the others;
    "locked": the nodes refuse DDL on replicated objects unless it comes through `pgmesh ddl` (drain, run
    on one node, wait until replayed everywhere). Installed on the nodes by `pgmesh init`."""

    mode: DdlMode = "replicated"


class ClocksSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`[clocks]`: how far a node's clock may be from the router's (router.cluster.clocks, docs/conflicts.md
    "Clocks"). Beyond warn_offset_ms the router logs a warning; beyond max_offset_ms `pgmesh init` fails
    and the links into and out of the node that decide conflicts by commit times hold until it is back
    under."""

    warn_offset_ms: Annotated[int, msgspec.Meta(ge=1)] = 50
    max_offset_ms: int = 500  # at least warn_offset_ms (router.config.rules)


class ConflictSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`[conflicts]`: the cluster-wide resolver, and per conflict type overrides in `[conflicts.types]`."""

    resolver: ResolverName = Resolver.LAST_UPDATE_WINS.value
    node_priority: list[str] = msgspec.field(default_factory=list)  # first listed wins
    # node_priority: versions within one window are ordered by rank (only 0 for now: router.config.rules)
    window_ms: Annotated[int, msgspec.Meta(ge=0)] = 0
    # conflict type -> resolver
    types: dict[ConflictTypeName, ResolverName] = msgspec.field(default_factory=dict)
    allow_divergence: bool = False  # accept keep_local / apply_remote / first_update_wins (status says so)
    # Tombstone pruning (router.conflicts.pruning): the margin behind the links' safe times, and how often
    tombstone_margin_ms: Annotated[int, msgspec.Meta(ge=0)] = 60_000
    tombstone_prune_interval_ms: Annotated[int, msgspec.Meta(ge=10)] = 10_000
    # ... and how long a tombstone stays at least, past the horizon: what tells `pgmesh repair` and
    # continuous verification's auto_repair a deletion from a lost row ("0s": pruned at the horizon)
    tombstone_keep: Duration = "1h"
    # Bounded history (router.conflicts.history, docs/conflicts.md "How long the history is kept"):
    # conflict_history rows and resolved (not pending) quarantine entries older than `keep` are pruned on
    # every node (at least 1s); and no node keeps more than `keep_rows` conflict_history rows, the oldest
    # pruned first even when younger than keep (0: no cap; pending quarantine entries are never pruned)
    keep: Duration = "7d"
    keep_rows: Annotated[int, msgspec.Meta(ge=0)] = 10_000_000

    @property
    def keep_s(self) -> float:
        """`keep` in seconds."""
        return duration_seconds(self.keep)

    @property
    def tombstone_keep_s(self) -> float:
        """`tombstone_keep` in seconds."""
        return duration_seconds(self.tombstone_keep)


class TableSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One `[[tables]]` entry: a table's own resolver, per-type overrides and delta columns."""

    name: TableName  # schema.table; a bare name means schema public
    resolver: ResolverName | None = None
    delta_columns: list[str] = msgspec.field(default_factory=list)  # non-empty, distinct (rules)
    types: dict[ConflictTypeName, ResolverName] = msgspec.field(default_factory=dict)
    on_refused: OnRefused | None = None  # overrides [replication] on_refused for this table

    @property
    def qualified(self) -> tuple[str, str]:
        """(schema, table) of `name`."""
        return split_table_name(self.name)


class SyncSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`[sync]`: the initial copy of `pgmesh join` (a PySpark batch)."""

    spark_master: str = "local[*]"  # any Spark master URL; local[*] needs no Spark cluster
    partitions_per_table: int = 0  # 0: from each table's size
    spark_conf: dict[str, str] = msgspec.field(default_factory=dict)  # e.g. "spark.driver.memory" = "2g"


class LogSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`[log]`: the router's log of each source (router.stream.log.store, docs/scale.md)."""

    enabled: bool = True
    # "": $PGMESH_STATE_DIR, else $XDG_STATE_HOME/pgmesh, else ~/.local/state/pgmesh; then /<cluster>/<node>
    directory: str = ""
    # per source; when reached, links that fall behind re-read the source (WAL kept); at least two
    # segments (router.config.rules)
    cap_mb: Annotated[int, msgspec.Meta(ge=2)] = 10_240
    segment_mb: Annotated[int, msgspec.Meta(ge=1)] = 64
    # group fsync: appends wait at most this long to be made durable together
    fsync_ms: Annotated[int, msgspec.Meta(ge=0)] = 20
    # with every link of a source behind (no other link to keep moving for), a link whose queue is full
    # and that applies nothing for this long goes to the log (its source moves on, its slot is confirmed)
    hold_s: Annotated[int, msgspec.Meta(ge=0)] = 10


class HaSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`[ha]`: standby routers; one at a time applies, holding a lease on a majority (docs/ha.md)."""

    enabled: bool = False
    name: str = ""  # this router's name in the lease ("": the host name); the process adds a suffix
    lease_s: float = 10.0  # how long a lease lasts unrenewed; renewed every lease_s / 3
    drift: Annotated[float, msgspec.Meta(ge=0, lt=0.5)] = 0.01  # bound on two clocks' rates (1%)
    # the holder stops this long before its lease could expire anywhere (bounds: router.config.rules)
    margin_s: float = 1.0


class VerifySection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`[verify]`: continuous verification (router.service.verify, docs/verify.md). The active router compares
    the replicated tables across nodes every `interval` (a pass starts at most that long after the last
    one started, and at least 1 s), range by range at most `rows_per_second` rows (per node) a second,
    and reports the rows that differ (`pgmesh status`, pgmesh_divergent_rows). Absent: off."""

    interval: Duration = "10m"
    tables: list[TableName] = msgspec.field(default_factory=list)  # []: every replicated table
    rows_per_second: Annotated[int, msgspec.Meta(ge=1)] = 50_000
    # tables whose divergent keys a pass repairs at once (router.cluster.compare.fix: the conflict path's
    # versions decide), when compared on full nodes and they have a key; [] (default): none
    auto_repair: list[TableName] = msgspec.field(default_factory=list)

    @property
    def interval_s(self) -> float:
        return max(1.0, duration_seconds(self.interval))


def duration_seconds(text: str) -> float:
    """A `Duration`'s seconds: "10m" -> 600.0."""
    number = text.rstrip("mshd")
    return float(number) * _UNITS[text[len(number):]]


def split_table_name(name: str) -> tuple[str, str]:
    """`"schema.table"` -> (schema, table); a bare `"table"` means schema public."""
    schema, sep, table = name.partition(".")
    return (schema, table) if sep else (DEFAULT_SCHEMA, name)


def _match(pattern: str, qualified: str) -> bool:
    return fnmatch.fnmatchcase(qualified, pattern if "." in pattern else f"*.{pattern}")
