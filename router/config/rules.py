"""The checks of `config.toml` that weigh one value against another, run once msgspec has decoded it.

Owns what the types in router.config.sections and router.config.model cannot say alone: bounds that
depend on the number of nodes, names that must be distinct or name a configured node, pairs of keys
(log cap and segment, clock warn and max, ha lease and margin, ddl mode and replicate_ddl), and resolver
settings that need node_priority or can leave nodes apart. Each rule raises a `ConfigError` "key:
message"; router.config.messages adds the file and line. `RULES` runs in order, the first broken wins.

Must not: import router.config.model (it imports this; `Checked` is what the rules read of its Config),
decode anything, or connect anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final, Protocol

from router.config import parts
from router.config.sections import (
    AdminSection,
    ClocksSection,
    ConflictSection,
    DdlSection,
    HaSection,
    LogSection,
    ReplicationSection,
    SequencesSection,
    TableSection,
)
from router.conflicts.resolve import Resolver
from router.errors import ConfigError

__all__ = ["RULES", "Checked", "check", "resolvers_in_effect"]


class Node(parts.NodeConfig, Protocol):
    """What the rules read of router.config.model.NodeConfig."""

    @property
    def synchronous(self) -> int | None: ...


class Checked(Protocol):
    """What the rules read of router.config.model.Config."""

    @property
    def nodes(self) -> Sequence[Node]: ...
    @property
    def replication(self) -> ReplicationSection: ...
    @property
    def admin(self) -> AdminSection: ...
    @property
    def conflicts(self) -> ConflictSection: ...
    @property
    def tables(self) -> Sequence[TableSection]: ...
    @property
    def sequences(self) -> SequencesSection: ...
    @property
    def clocks(self) -> ClocksSection: ...
    @property
    def ddl(self) -> DdlSection: ...
    @property
    def log(self) -> LogSection: ...
    @property
    def ha(self) -> HaSection: ...
    @property
    def node_names(self) -> list[str]: ...
    def replicates(self, schema: str, table: str) -> bool: ...
    def divergent_resolvers(self) -> list[str]: ...


def _bad(message: str, key: str) -> ConfigError:
    return ConfigError(f"{key}: {message}")


def _nodes(config: Checked) -> None:
    if all(node.receive_only for node in config.nodes):
        raise _bad("every node is receive_only: at least one must send", "nodes")
    seen: set[str] = set()
    for i, node in enumerate(config.nodes):
        if node.name in seen:
            raise _bad(f"node name {node.name!r} appears twice", f"nodes[{i}].name")
        seen.add(node.name)
        k = config.replication.synchronous if node.synchronous is None else node.synchronous
        key = "replication.synchronous" if node.synchronous is None else f"nodes[{i}].synchronous"
        if not 0 <= k < len(config.nodes):
            most = len(config.nodes) - 1
            raise _bad(f"must be between 0 and {most} (the other nodes); node {node.name}: {k}", key)
        if k and node.receive_only:
            raise _bad(f"node {node.name} is receive_only: nothing leaves it, nothing to wait for", key)
        if problem := parts.part_problem(node):
            raise _bad(problem[0], f"nodes[{i}].{problem[1]}")


def _log(config: Checked) -> None:
    if config.log.segment_mb * 2 > config.log.cap_mb:
        raise _bad("must be at least two segments (log.segment_mb)", "log.cap_mb")


def _ddl(config: Checked) -> None:
    if config.ddl.mode == "locked" and not config.replication.replicate_ddl:
        raise _bad("locked needs [replication] replicate_ddl = true (it locks replicated DDL)", "ddl.mode")


def _admin(config: Checked) -> None:
    _host, sep, port = config.admin.listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise _bad(f"{config.admin.listen!r} is not HOST:PORT", "admin.listen")


def _clocks(config: Checked) -> None:
    clocks = config.clocks
    if clocks.max_offset_ms < clocks.warn_offset_ms:
        raise _bad(f"must be >= warn_offset_ms ({clocks.warn_offset_ms})", "clocks.max_offset_ms")


def _ha(config: Checked) -> None:
    ha = config.ha
    if ha.margin_s < 0 or ha.lease_s * (1 - ha.drift) / (1 + ha.drift) - ha.margin_s < ha.lease_s / 2:
        raise _bad(f"must leave the holder at least half the lease ({ha.lease_s:g} s)", "ha.margin_s")


def _conflicts(config: Checked) -> None:
    section = config.conflicts
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


def _tables(config: Checked) -> None:
    seen: dict[tuple[str, str], int] = {}
    for i, entry in enumerate(config.tables):
        key = f"tables[{i}]"
        schema, table = entry.qualified
        qualified = f"{schema}.{table}"
        if (schema, table) in seen:
            first = seen[(schema, table)]
            raise ConfigError(f"{key}.name: table {qualified} is listed twice (also tables[{first}])")
        seen[(schema, table)] = i
        if not config.replicates(schema, table):
            raise ConfigError(f"{key}.name: {qualified} is not replicated (see [replication] tables/exclude)")
        columns = entry.delta_columns
        if any(not c for c in columns) or len(set(columns)) != len(columns):
            raise ConfigError(f"{key}.delta_columns: column names must be non-empty and distinct")


def _resolvers(config: Checked) -> None:
    if not config.conflicts.node_priority:
        for key, value in resolvers_in_effect(config.conflicts, config.tables):
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


def _sequences(config: Checked) -> None:
    # Node ids are 0..n-1 for a cluster that never lost a node; `pgmesh sequences convert` checks the
    # ids actually assigned.
    step = config.sequences.step
    least = max(2, len(config.nodes))
    if step < least:
        raise ConfigError(
            f"sequences.step: {step} is too small; it must be greater than every node id"
            f" (at least {least} for {len(config.nodes)} nodes)"
        )


# In the order they run: the first broken rule is the one reported.
RULES: Final[tuple[Callable[[Checked], None], ...]] = (
    _nodes, _log, _ddl, _admin, _clocks, _ha, _conflicts, _tables, _resolvers, _sequences,
)


def check(config: Checked) -> None:
    """Raise the `ConfigError` ("key: message") of the first rule `config` breaks."""
    for rule in RULES:
        rule(config)


def resolvers_in_effect(section: ConflictSection, tables: Sequence[TableSection]) -> list[tuple[str, str]]:
    """Every (key, resolver) the config sets, in file order."""
    found = [("conflicts.resolver", section.resolver)]
    found += [(f"conflicts.types.{t}", v) for t, v in section.types.items()]
    for i, entry in enumerate(tables):
        if entry.resolver is not None:
            found.append((f"tables[{i}].resolver", entry.resolver))
        found += [(f"tables[{i}].types.{t}", v) for t, v in entry.types.items()]
    return found
