"""`config.toml`: the cluster's configuration, decoded and validated with msgspec.

Owns the whole (`Config`: the `[[nodes]]` and the sections of router.config.sections), the names pgmesh
derives from it (slot, publication and origin names), which conflict policy applies to a (table, conflict
type), and `parse_config` / `load_config`: TOML text -> msgspec (which refuses what the types declare) ->
router.config.rules (what weighs one value against another) -> a `Config`, or one `ConfigError` line
naming the key and its line in the file (router.config.messages). Callers import the sections' names from
here too. The config is passed to whoever needs it; nothing here is global, nothing here connects
anywhere, and a custom resolver ("module:function") is only named here, never imported (the applier
loads it).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated

import msgspec

from router.config.messages import decode_error, rule_error
from router.config.rules import check, divergent_resolvers
from router.config.sections import (
    CONFLICT_TYPES,
    DDL_MODES,
    DEFAULT_SCHEMA,
    JOIN_SCHEMA,
    PGMESH_SCHEMA,
    RESOLVER_NAMES,
    SEQUENCE_MODES,
    SYNCHRONOUS_COMMIT,
    SYSTEM_SCHEMAS,
    AdminSection,
    ClocksSection,
    ClusterSection,
    ConflictSection,
    DdlSection,
    HaSection,
    LogSection,
    NodeConfig,
    ReplicationSection,
    SequencesSection,
    SyncSection,
    TableSection,
    VerifySection,
    split_table_name,
)
from router.conflicts.resolve import ConflictType, Policy, Resolver
from router.errors import ConfigError

# The sections' names are re-exported: callers import them from here.
__all__ = [
    "CONFLICT_TYPES",
    "DDL_MODES",
    "DEFAULT_SCHEMA",
    "JOIN_SCHEMA",
    "PGMESH_SCHEMA",
    "RESOLVER_NAMES",
    "SEQUENCE_MODES",
    "SYNCHRONOUS_COMMIT",
    "SYSTEM_SCHEMAS",
    "AdminSection",
    "ClocksSection",
    "ClusterSection",
    "Config",
    "ConflictSection",
    "DdlSection",
    "HaSection",
    "LogSection",
    "NodeConfig",
    "ReplicationSection",
    "SequencesSection",
    "SyncSection",
    "TableSection",
    "VerifySection",
    "load_config",
    "parse_config",
    "split_table_name",
]


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    cluster: ClusterSection
    nodes: Annotated[list[NodeConfig], msgspec.Meta(min_length=2)]
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
    verify: VerifySection | None = None  # continuous verification (router.service.verify); absent: off

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
        return self.replication.replicates(schema, table)

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
        return divergent_resolvers(self.conflicts, self.tables)

    def on_refused(self, schema: str, table: str) -> str:
        """What a change of `schema.table` the target refuses does: "pause" or "quarantine" (the table's
        `on_refused`, else `[replication] on_refused`)."""
        entry = self.table(schema, table)
        if entry is not None and entry.on_refused is not None:
            return entry.on_refused
        return self.replication.on_refused

    def quarantines(self) -> bool:
        """Whether any table may quarantine a refused change."""
        return self.replication.on_refused == "quarantine" or any(
            t.on_refused == "quarantine" for t in self.tables)

    def delta_columns(self, schema: str, table: str) -> tuple[str, ...]:
        """The table's delta columns (changes add up instead of overwriting); () for none."""
        entry = self.table(schema, table)
        return tuple(entry.delta_columns) if entry is not None else ()


def parse_config(text: str, *, source: str = "config.toml") -> Config:
    """Decode and validate the text of a config file."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    try:
        config = msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        raise decode_error(exc, raw, text, source) from None
    try:
        check(
            nodes=config.nodes, replication=config.replication, admin=config.admin,
            conflicts=config.conflicts, tables=config.tables, sequences=config.sequences,
            clocks=config.clocks, ddl=config.ddl, log=config.log, ha=config.ha,
        )
    except ConfigError as exc:
        raise rule_error(exc, text, source) from None
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
