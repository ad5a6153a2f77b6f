"""`config.toml`: the cluster's configuration, decoded and validated with msgspec.

Owns the file format, its defaults, and the names pgmesh derives from it (slot, publication and origin
names), and which conflict policy applies to a (table, conflict type). A wrong key, type or value is one
`ConfigError` line naming the key and its line in the file. The config is passed to whoever needs it;
nothing here is global, nothing here connects anywhere, and a custom resolver ("module:function") is
only named here, never imported (the applier loads it).
"""

from __future__ import annotations

import fnmatch
import os
import re
import tomllib
from pathlib import Path
from typing import Final

import msgspec

from router.config.lines import line_of
from router.config.parts import part_problem
from router.conflicts.resolve import ConflictType, Policy, Resolver, can_diverge
from router.errors import ConfigError

__all__ = [
    "AdminSection",
    "ClocksSection",
    "ClusterSection",
    "Config",
    "ConflictSection",
    "DdlSection",
    "NodeConfig",
    "ReplicationSection",
    "SequencesSection",
    "TableSection",
    "load_config",
    "parse_config",
    "split_table_name",
]

NAME_RE: Final = re.compile(r"^[a-z][a-z0-9_]{0,29}$")
PGMESH_SCHEMA: Final = "pgmesh"
# replication.apply_synchronous_commit: PostgreSQL's values (its aliases true/false/yes/no/1/0 are left out)
SYNCHRONOUS_COMMIT: Final = ("off", "local", "remote_write", "on", "remote_apply")
# the marker of a join in progress on the new node (router.ops.join)
JOIN_SCHEMA: Final = "pgmesh_join"
SYSTEM_SCHEMAS: Final = frozenset(
    {"pg_catalog", "information_schema", "pg_toast", PGMESH_SCHEMA, JOIN_SCHEMA}
)
DEFAULT_SCHEMA: Final = "public"
# Resolver names a config may use; "custom" is spelled as the function itself ("module:function").
RESOLVER_NAMES: Final = tuple(r.value for r in Resolver if r is not Resolver.CUSTOM)
CONFLICT_TYPES: Final = tuple(t.value for t in ConflictType)
SEQUENCE_MODES: Final = ("snowflake", "step")
DDL_MODES: Final = ("replicated", "locked")
_CUSTOM_RE: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


class ClusterSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str


class NodeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    dsn: str
    # receives from every other node and sends to none (router.cluster.receive: local writes refused)
    receive_only: bool = False
    # a file holding the node's password alone (a mounted secret), read through a private .pgpass copy
    # named by the dsn's passfile (router.nodes.dsn.password_file_dsn)
    password_file: str = ""
    # overrides [replication] synchronous for commits on this node (docs/synchronous.md)
    synchronous: int | None = None
    # a receive-only node's part of the data (router.cluster.partial): these tables, rows, columns only
    tables: list[str] | None = None
    rows: dict[str, str] = msgspec.field(default_factory=dict)
    columns: dict[str, list[str]] = msgspec.field(default_factory=dict)


class ReplicationSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which tables replicate, and how the appliers behave."""

    tables: list[str] = msgspec.field(default_factory=lambda: ["*.*"])
    exclude: list[str] = msgspec.field(default_factory=list)
    apply_delay_ms: int = 0
    queue_max_transactions: int = 10_000
    queue_max_mb: int = 64  # per link: MB of transactions' payload held in memory (the rest waits in the log)
    # Sessions per link applying independent transactions at once, committed in source order.
    apply_lanes: int = 1
    # The appliers' sessions' synchronous_commit. "off" (as the native apply worker) loses nothing: a
    # source's slot is confirmed only up to what the target has flushed. "on", "remote_write",
    # "remote_apply" make each applied transaction wait for its flush (and for the target's synchronous
    # standbys, when it has some) before the next one; "local" ignores the standbys.
    apply_synchronous_commit: str = "off"
    # A commit on a node returns only once this many other nodes have durably applied it (0: asynchronous).
    # Stock synchronous replication: the node's synchronous_standby_names names the router's replication
    # connection (`Config.standby_name`), set by `pgmesh init`; docs/synchronous.md
    synchronous: int = 0
    status_interval_ms: int = 1_000
    # A node that does not answer the router's progress query within this long is taken for cut off:
    # its links show "down" and the router drops its sessions to it (router.service.supervisor)
    node_timeout_ms: int = 10_000
    replicate_ddl: bool = True  # capture DDL with an event trigger and run it on the other nodes
    # a table without a key: "full" (REPLICA IDENTITY FULL, replicated), "warn" (a new one left local,
    # with a warning) or "refuse" (an error)
    new_table_without_key: str = "full"
    # Per open transaction: MB of change payload (as received) kept in memory before the rest spills to
    # disk; 0: never. Inserts are held as the server's bytes (about 2x that in the router); updates and
    # deletes decoded (about 9x for rows of a few narrow columns).
    spill_mb: int = 8  # payload bytes; about 2x (inserts) to 9x (decoded rows) that in memory
    spool_dir: str = ""  # where spilled transactions go ("": the system's temporary directory)
    # Start applying a transaction that spills before its commit arrives: one the server decoded after
    # its commit is handed out at its first spill; one it streams while still in progress is applied on
    # a second session per link from its first spill and committed in its place in commit order.
    early_apply: bool = True


class AdminSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    listen: str = "127.0.0.1:8787"  # beyond loopback only with TLS and the token (docs/admin.md)
    # the token POST requests need (router.service.admintoken): "" = admin.token in the state directory
    token_file: str = ""
    socket: str = ""  # a Unix socket made 0600 for the router's user: its POSTs need no token ("": none)
    tls_cert: str = ""  # PEM certificate and key: HTTPS on listen (both or neither; checked at start)
    tls_key: str = ""
    header_timeout_ms: int = 10_000  # a request must arrive whole within this after connecting


class SequencesSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`[sequences]`: how `pgmesh sequences convert` makes ids unique across nodes (docs/sequences.md)."""

    mode: str = "snowflake"  # "snowflake" (bigint ids: time, node id, counter) or "step"
    step: int = 100  # step mode: each node's values are node_id mod step, so step > every node id


class DdlSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`[ddl]`: how DDL may run (docs/ddl.md). "replicated": DDL run on any node is replayed on the others;
    "locked": the nodes refuse DDL on replicated objects unless it comes through `pgmesh ddl` (drain, run
    on one node, wait until replayed everywhere). Installed on the nodes by `pgmesh init`."""

    mode: str = "replicated"


class ClocksSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`[clocks]`: how far a node's clock may be from the router's (router.cluster.clocks, docs/conflicts.md
    "Clocks"). Beyond warn_offset_ms the router logs a warning; beyond max_offset_ms `pgmesh init` fails
    and the links into and out of the node that decide conflicts by commit times hold until it is back
    under."""

    warn_offset_ms: int = 50
    max_offset_ms: int = 500


class ConflictSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`[conflicts]`: the cluster-wide resolver, and per conflict type overrides in `[conflicts.types]`."""

    resolver: str = Resolver.LAST_UPDATE_WINS.value
    node_priority: list[str] = msgspec.field(default_factory=list)  # first listed wins
    window_ms: int = 0  # node_priority: versions within one window are ordered by rank (only 0 for now)
    types: dict[str, str] = msgspec.field(default_factory=dict)  # conflict type -> resolver
    allow_divergence: bool = False  # accept keep_local / apply_remote / first_update_wins (status says so)
    # Tombstone pruning (router.conflicts.pruning): the margin behind the links' safe times, and how often
    tombstone_margin_ms: int = 60_000
    tombstone_prune_interval_ms: int = 10_000


class TableSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One `[[tables]]` entry: a table's own resolver, per-type overrides and delta columns."""

    name: str  # schema.table; a bare name means schema public
    resolver: str | None = None
    delta_columns: list[str] = msgspec.field(default_factory=list)
    types: dict[str, str] = msgspec.field(default_factory=dict)

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
    cap_mb: int = 10_240  # per source; when reached, links that fall behind re-read the source (WAL kept)
    segment_mb: int = 64
    fsync_ms: int = 20  # group fsync: appends wait at most this long to be made durable together
    # with every link of a source behind (no other link to keep moving for), a link whose queue is full
    # and that applies nothing for this long goes to the log (its source moves on, its slot is confirmed)
    hold_s: int = 10


class HaSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`[ha]`: standby routers; one at a time applies, holding a lease on a majority (docs/ha.md)."""

    enabled: bool = False
    name: str = ""  # this router's name in the lease ("": the host name); the process adds a suffix
    lease_s: float = 10.0  # how long a lease lasts unrenewed; renewed every lease_s / 3
    drift: float = 0.01  # bound on how far two clocks' rates differ (1%)
    margin_s: float = 1.0  # the holder stops this long before its lease could expire anywhere


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    cluster: ClusterSection
    nodes: list[NodeConfig]
    replication: ReplicationSection = msgspec.field(default_factory=ReplicationSection)
    admin: AdminSection = msgspec.field(default_factory=AdminSection)
    conflicts: ConflictSection = msgspec.field(default_factory=ConflictSection)
    tables: list[TableSection] = msgspec.field(default_factory=list)
    sequences: SequencesSection = msgspec.field(default_factory=SequencesSection)
    clocks: ClocksSection = msgspec.field(default_factory=ClocksSection)
    ddl: DdlSection = msgspec.field(default_factory=DdlSection)
    sync: SyncSection = msgspec.field(default_factory=lambda: SyncSection())
    log: LogSection = msgspec.field(default_factory=LogSection)
    ha: HaSection = msgspec.field(default_factory=HaSection)

    # Names pgmesh installs on the nodes, derived from the cluster name.
    @property
    def slot_name(self) -> str:
        return f"pgmesh_{self.cluster.name}"

    @property
    def publication_name(self) -> str:
        return f"pgmesh_{self.cluster.name}"

    @property
    def standby_name(self) -> str:
        """The application_name of the router's replication connections: what a node's
        synchronous_standby_names names for `synchronous` > 0 (docs/synchronous.md)."""
        return f"pgmesh_{self.cluster.name}"

    def synchronous(self, node: str) -> int:
        """How many other nodes a commit on `node` waits for ([[nodes]] synchronous, else [replication])."""
        own = self.node(node).synchronous
        return self.replication.synchronous if own is None else own

    def apply_synchronous_commit(self, target: str) -> str:
        """The appliers' synchronous_commit on `target`. With `synchronous` > 0 anywhere, every applied
        commit is durable when it returns (the links' positions move at once: "off" becomes "local"), and
        on a target with `synchronous` > 0 it never waits for that node's synchronous standbys ("local"):
        the router is one of them, and would wait for itself."""
        mode = self.replication.apply_synchronous_commit
        if not any(self.synchronous(n) for n in self.node_names):
            return mode
        return "local" if mode == "off" or self.synchronous(target) > 0 else mode

    def origin_name(self, source: str) -> str:
        """The replication origin, on a target, for changes coming from `source`."""
        return f"pgmesh_{self.cluster.name}_{source}"

    def early_origin_name(self, source: str) -> str:
        """The origin a target's side session writes `source`'s streamed transaction under before its
        commit (router.apply.side): the target's walsender then marks that transaction as an echo from its
        first streamed row. Not under `origin_name("")`'s prefix: no progress is kept under it."""
        return f"pgmeshearly_{self.cluster.name}_{source}"

    def recorder_origin_name(self) -> str:
        """The origin a node's tombstone recorder (router.apply.recorder) writes under on that node:
        its writes are then echoes in the node's stream. Not under `origin_name("")`'s prefix."""
        return f"pgmeshrec_{self.cluster.name}"

    def pgmesh_origins(self) -> list[str]:
        """Every replication origin pgmesh may keep progress for on a node (each node's, its own
        unused; their early twins with early_apply; the tombstone recorder's)."""
        early = [self.early_origin_name(n) for n in self.node_names] if self.replication.early_apply else []
        return [self.origin_name(n) for n in self.node_names] + early + [self.recorder_origin_name()]

    def origins_per_node(self) -> int:
        """How many of `pgmesh_origins` one node may hold progress for (not its own names)."""
        return len(self.pgmesh_origins()) - (2 if self.replication.early_apply else 1)

    def node(self, name: str) -> NodeConfig:
        for node in self.nodes:
            if node.name == name:
                return node
        known = ", ".join(n.name for n in self.nodes)
        raise ConfigError(f"no node named {name!r} in the config (nodes: {known})")

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def replicates(self, schema: str, table: str) -> bool:
        """Whether `schema.table` is in the replicated set."""
        if schema in SYSTEM_SCHEMAS or schema.startswith("pg_"):
            return False
        qualified = f"{schema}.{table}"
        rep = self.replication
        if not any(_match(p, qualified) for p in rep.tables):
            return False
        return not any(_match(p, qualified) for p in rep.exclude)

    def log_directory(self, node: str) -> Path:
        """Where the router keeps `node`'s log."""
        base = self.log.directory or os.environ.get("PGMESH_STATE_DIR") or os.path.join(
            os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "pgmesh"
        )
        return Path(base) / self.cluster.name / node

    @property
    def admin_host_port(self) -> tuple[str, int]:
        host, _, port = self.admin.listen.rpartition(":")
        return host or "127.0.0.1", int(port)

    def table(self, schema: str, table: str) -> TableSection | None:
        """The `[[tables]]` entry for `schema.table`, if there is one."""
        for entry in self.tables:
            if entry.qualified == (schema, table):
                return entry
        return None

    def policy(self, schema: str, table: str, conflict: str) -> Policy:
        """The resolver for one conflict type on one table.

        Precedence: the table's `[tables.types]` entry, the table's `resolver`, `[conflicts.types]`,
        then `[conflicts] resolver`. node_priority and window_ms always come from `[conflicts]`.
        """
        kind = ConflictType(conflict).value
        entry = self.table(schema, table)
        name = self.conflicts.types.get(kind, self.conflicts.resolver)
        if entry is not None:
            name = entry.types.get(kind, entry.resolver or name)
        custom = name if ":" in name else None
        return Policy(
            resolver=Resolver.CUSTOM if custom else Resolver(name),
            node_priority=tuple(self.conflicts.node_priority),
            window_us=self.conflicts.window_ms * 1000,
            custom=custom,
        )

    def divergent_resolvers(self) -> list[str]:
        """Every resolver setting that can leave nodes with different rows, as `key = resolver (where)`
        (empty for a cluster that converges; non-empty only with `allow_divergence = true`)."""
        found = []
        for key, value in _resolvers_in_effect(self):
            if value not in RESOLVER_NAMES:
                continue
            kind = key.rpartition(".types.")[2] if ".types." in key else None
            if not can_diverge(Resolver(value), ConflictType(kind) if kind else None):
                continue
            index = key.partition("[")[2].partition("]")[0]
            where = self.tables[int(index)].name if key.startswith("tables[") else "every table"
            found.append(f"{key} = {value} ({where})")
        return found

    def delta_columns(self, schema: str, table: str) -> tuple[str, ...]:
        """The table's delta columns (changes add up instead of overwriting); () for none."""
        entry = self.table(schema, table)
        return tuple(entry.delta_columns) if entry is not None else ()


def split_table_name(name: str) -> tuple[str, str]:
    """`"schema.table"` -> (schema, table); a bare `"table"` means schema public."""
    schema, sep, table = name.partition(".")
    return (schema, table) if sep else (DEFAULT_SCHEMA, name)


def _match(pattern: str, qualified: str) -> bool:
    return fnmatch.fnmatchcase(qualified, pattern if "." in pattern else f"*.{pattern}")


def _validate(config: Config) -> None:
    def bad(message: str, key: str) -> ConfigError:
        return ConfigError(f"{key}: {message}")

    if not NAME_RE.match(config.cluster.name):
        raise bad("use lower-case letters, digits and _ (start with a letter, at most 30)", "cluster.name")
    if len(config.nodes) < 2:
        raise bad("a cluster needs at least two [[nodes]]", "nodes")
    if all(node.receive_only for node in config.nodes):
        raise bad("every node is receive_only: at least one must send", "nodes")
    seen: set[str] = set()
    for i, node in enumerate(config.nodes):
        if not NAME_RE.match(node.name):
            raise bad(f"node name {node.name!r}: use lower-case letters, digits and _", f"nodes[{i}].name")
        if node.name in seen:
            raise bad(f"node name {node.name!r} appears twice", f"nodes[{i}].name")
        seen.add(node.name)
        if not node.dsn.strip():
            raise bad("empty dsn", f"nodes[{i}].dsn")
        k = config.replication.synchronous if node.synchronous is None else node.synchronous
        key = "replication.synchronous" if node.synchronous is None else f"nodes[{i}].synchronous"
        if not 0 <= k < len(config.nodes):
            most = len(config.nodes) - 1
            raise bad(f"must be between 0 and {most} (the other nodes); node {node.name}: {k}", key)
        if k and node.receive_only:
            raise bad(f"node {node.name} is receive_only: nothing leaves it, nothing to wait for", key)
        if problem := part_problem(node):
            raise bad(problem[0], f"nodes[{i}].{problem[1]}")
    rep = config.replication
    if rep.apply_delay_ms < 0:
        raise bad("must be >= 0", "replication.apply_delay_ms")
    if not 1 <= rep.apply_lanes <= 16:
        raise bad("must be between 1 and 16", "replication.apply_lanes")
    if rep.apply_synchronous_commit not in SYNCHRONOUS_COMMIT:
        raise bad(f"must be one of {', '.join(SYNCHRONOUS_COMMIT)}", "replication.apply_synchronous_commit")
    if rep.queue_max_transactions < 1:
        raise bad("must be >= 1", "replication.queue_max_transactions")
    if rep.queue_max_mb < 1:
        raise bad("must be >= 1", "replication.queue_max_mb")
    if rep.status_interval_ms < 10:
        raise bad("must be >= 10", "replication.status_interval_ms")
    if rep.node_timeout_ms < 100:
        raise bad("must be >= 100", "replication.node_timeout_ms")
    log = config.log
    for field, value, low in (("cap_mb", log.cap_mb, 2), ("segment_mb", log.segment_mb, 1),
                              ("hold_s", log.hold_s, 0), ("fsync_ms", log.fsync_ms, 0)):
        if value < low:
            raise bad(f"must be >= {low}", f"log.{field}")
    if log.segment_mb * 2 > log.cap_mb:
        raise bad("must be at least two segments (log.segment_mb)", "log.cap_mb")
    if rep.spill_mb < 0:
        raise bad("must be >= 0 (0: never spill to disk)", "replication.spill_mb")
    if not rep.tables:
        raise bad("must list at least one pattern", "replication.tables")
    if rep.new_table_without_key not in ("full", "warn", "refuse"):
        choice = rep.new_table_without_key
        raise bad(f"{choice!r} is not full, warn or refuse", "replication.new_table_without_key")
    if config.ddl.mode not in DDL_MODES:
        raise bad(f"{config.ddl.mode!r} is not one of {', '.join(DDL_MODES)}", "ddl.mode")
    if config.ddl.mode == "locked" and not rep.replicate_ddl:
        raise bad("locked needs [replication] replicate_ddl = true (it locks replicated DDL)", "ddl.mode")
    _host, sep, port = config.admin.listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise bad(f"{config.admin.listen!r} is not HOST:PORT", "admin.listen")
    clocks = config.clocks
    if clocks.warn_offset_ms < 1:
        raise bad("must be >= 1", "clocks.warn_offset_ms")
    if clocks.max_offset_ms < clocks.warn_offset_ms:
        raise bad(f"must be >= warn_offset_ms ({clocks.warn_offset_ms})", "clocks.max_offset_ms")
    ha = config.ha
    if not 0 <= ha.drift < 0.5:
        raise bad("must be >= 0 and < 0.5", "ha.drift")
    if ha.margin_s < 0 or ha.lease_s * (1 - ha.drift) / (1 + ha.drift) - ha.margin_s < ha.lease_s / 2:
        raise bad(f"must leave the holder at least half the lease ({ha.lease_s:g} s)", "ha.margin_s")
    _validate_conflicts(config)
    _validate_tables(config)
    _validate_sequences(config)


def _check_resolver(value: str, key: str) -> None:
    if value in RESOLVER_NAMES or (":" in value and _CUSTOM_RE.match(value)):
        return
    if ":" in value:
        raise ConfigError(f"{key}: custom resolver {value!r}: expected 'module:function'")
    raise ConfigError(
        f"{key}: unknown resolver {value!r}; use one of {', '.join(RESOLVER_NAMES)} or 'module:function'"
    )


def _check_types(types: dict[str, str], key: str) -> None:
    for conflict, value in types.items():
        if conflict not in CONFLICT_TYPES:
            known = ", ".join(CONFLICT_TYPES)
            raise ConfigError(f"{key}.{conflict}: unknown conflict type {conflict!r}; use one of {known}")
        _check_resolver(value, f"{key}.{conflict}")


def _resolvers_in_effect(config: Config) -> list[tuple[str, str]]:
    """Every (key, resolver) the config sets, in file order."""
    section = config.conflicts
    found = [("conflicts.resolver", section.resolver)]
    found += [(f"conflicts.types.{t}", v) for t, v in section.types.items()]
    for i, entry in enumerate(config.tables):
        if entry.resolver is not None:
            found.append((f"tables[{i}].resolver", entry.resolver))
        found += [(f"tables[{i}].types.{t}", v) for t, v in entry.types.items()]
    return found


def _validate_conflicts(config: Config) -> None:
    section = config.conflicts
    _check_resolver(section.resolver, "conflicts.resolver")
    _check_types(section.types, "conflicts.types")
    if section.window_ms < 0:
        raise ConfigError("conflicts.window_ms: must be >= 0")
    if section.tombstone_margin_ms < 0:
        raise ConfigError("conflicts.tombstone_margin_ms: must be >= 0")
    if section.tombstone_prune_interval_ms < 10:
        raise ConfigError("conflicts.tombstone_prune_interval_ms: must be >= 10")
    if section.window_ms > 0:
        raise ConfigError(
            "conflicts.window_ms: node_priority's hold for a time window is not built, so a window can"
            " leave nodes apart; use window_ms = 0"
        )
    nodes = set(config.node_names)
    seen: set[str] = set()
    for name in section.node_priority:
        if name not in nodes:
            known = ", ".join(config.node_names)
            raise ConfigError(f"conflicts.node_priority: {name!r} is not a configured node (nodes: {known})")
        if name in seen:
            raise ConfigError(f"conflicts.node_priority: {name!r} is listed twice")
        seen.add(name)


def _validate_tables(config: Config) -> None:
    seen: dict[tuple[str, str], int] = {}
    for i, entry in enumerate(config.tables):
        key = f"tables[{i}]"
        schema, table = entry.qualified
        if not schema or not table or "." in table:
            raise ConfigError(f"{key}.name: {entry.name!r} is not schema.table (or a bare table name)")
        qualified = f"{schema}.{table}"
        if (schema, table) in seen:
            first = seen[(schema, table)]
            raise ConfigError(f"{key}.name: table {qualified} is listed twice (also tables[{first}])")
        seen[(schema, table)] = i
        if not config.replicates(schema, table):
            raise ConfigError(f"{key}.name: {qualified} is not replicated (see [replication] tables/exclude)")
        if entry.resolver is not None:
            _check_resolver(entry.resolver, f"{key}.resolver")
        _check_types(entry.types, f"{key}.types")
        columns = entry.delta_columns
        if any(not c for c in columns) or len(set(columns)) != len(columns):
            raise ConfigError(f"{key}.delta_columns: column names must be non-empty and distinct")
    if not config.conflicts.node_priority:
        for key, value in _resolvers_in_effect(config):
            if value == Resolver.NODE_PRIORITY:
                raise ConfigError(f'{key}: node_priority needs [conflicts] node_priority = ["node", ...]')
    if not config.conflicts.allow_divergence:
        for setting in config.divergent_resolvers():
            key, _, rest = setting.partition(" = ")
            raise ConfigError(
                f"{key}: {rest} can leave nodes with different rows for ever (docs/conflicts.md,"
                " Resolvers); use last_update_wins or node_priority, or accept that with [conflicts]"
                " allow_divergence = true"
            )


def _validate_sequences(config: Config) -> None:
    section = config.sequences
    if section.mode not in SEQUENCE_MODES:
        raise ConfigError(f"sequences.mode: {section.mode!r} is not one of {', '.join(SEQUENCE_MODES)}")
    # Node ids are 0..n-1 for a cluster that never lost a node; `pgmesh sequences convert` checks the
    # ids actually assigned.
    least = max(2, len(config.nodes))
    if section.step < least:
        raise ConfigError(
            f"sequences.step: {section.step} is too small; it must be greater than every node id"
            f" (at least {least} for {len(config.nodes)} nodes)"
        )


def parse_config(text: str, *, source: str = "config.toml") -> Config:
    """Decode and validate the text of a config file."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    try:
        config = msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        message = str(exc)
        path = message.rpartition(" - at `")[2].rstrip("`") if " - at `" in message else ""
        key = path.removeprefix("$.") or "?"
        line = line_of(text, path)
        where = f"{source}:{line}" if line else source
        detail = message.partition(" - at `")[0]
        if detail.startswith("Object contains unknown field"):
            unknown = detail.split("`")[1] if "`" in detail else "?"
            line = line_of(text, f"{path}.{unknown}" if path else unknown)
            where = f"{source}:{line}" if line else source
            scope = f" in [{key}]" if key != "?" else ""
            raise ConfigError(f"{where}: unknown key {unknown!r}{scope}") from None
        raise ConfigError(f"{where}: {key}: {detail}") from None
    try:
        _validate(config)
    except ConfigError as exc:
        key = exc.message.partition(":")[0]
        line = line_of(text, "$." + key)
        where = f"{source}:{line}" if line else source
        raise ConfigError(f"{where}: {exc.message}") from None
    if any(node.password_file for node in config.nodes):
        from router.nodes.dsn import password_file_dsn  # reads the files: a missing one is a ConfigError

        nodes = [msgspec.structs.replace(n, dsn=password_file_dsn(n.dsn, n.password_file, n.name))
                 if n.password_file else n for n in config.nodes]
        config = msgspec.structs.replace(config, nodes=nodes)
    return config


def load_config(path: str | Path) -> Config:
    """Read, decode and validate `config.toml`."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {file}: {exc.strerror}") from None
    return parse_config(text, source=str(file))
