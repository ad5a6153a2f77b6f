"""The checks of `config.toml` that weigh one value against another, run once msgspec has decoded it.

Owns what the types in router.config.sections and router.config.model cannot say alone: bounds that
depend on the number of nodes, names that must be distinct or name a configured node, pairs of keys
(log cap and segment, clock warn and max, ha lease and margin, ddl mode and replicate_ddl), and resolver
settings that need node_priority or can leave nodes apart (`divergent_resolvers`, which status shows too).
A broken rule raises a `ConfigError` "key: message"; router.config.messages adds the file and line.

Each rule is handed the sections it reads, never the whole config. Must not: import router.config.model
(it imports this), decode anything, or connect anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.config.parts import part_problem
from router.config.sections import (
    RESOLVER_NAMES,
    AdminSection,
    ClocksSection,
    ConflictSection,
    DdlSection,
    HaSection,
    LogSection,
    NodeConfig,
    ReplicationSection,
    SequencesSection,
    TableSection,
)
from router.conflicts.resolve import ConflictType, Resolver, can_diverge
from router.errors import ConfigError

__all__ = ["check", "divergent_resolvers", "resolvers_in_effect"]


def _bad(message: str, key: str) -> ConfigError:
    return ConfigError(f"{key}: {message}")


def _nodes(nodes: Sequence[NodeConfig], replication: ReplicationSection) -> None:
    if all(node.receive_only for node in nodes):
        raise _bad("every node is receive_only: at least one must send", "nodes")
    seen: set[str] = set()
    for i, node in enumerate(nodes):
        if node.name in seen:
            raise _bad(f"node name {node.name!r} appears twice", f"nodes[{i}].name")
        seen.add(node.name)
        k = replication.synchronous if node.synchronous is None else node.synchronous
        key = "replication.synchronous" if node.synchronous is None else f"nodes[{i}].synchronous"
        if not 0 <= k < len(nodes):
            most = len(nodes) - 1
            raise _bad(f"must be between 0 and {most} (the other nodes); node {node.name}: {k}", key)
        if k and node.receive_only:
            raise _bad(f"node {node.name} is receive_only: nothing leaves it, nothing to wait for", key)
        if problem := part_problem(node):
            raise _bad(problem[0], f"nodes[{i}].{problem[1]}")


def _log(log: LogSection) -> None:
    if log.segment_mb * 2 > log.cap_mb:
        raise _bad("must be at least two segments (log.segment_mb)", "log.cap_mb")


def _ddl(ddl: DdlSection, replication: ReplicationSection) -> None:
    if ddl.mode == "locked" and not replication.replicate_ddl:
        raise _bad("locked needs [replication] replicate_ddl = true (it locks replicated DDL)", "ddl.mode")


def _admin(admin: AdminSection) -> None:
    _host, sep, port = admin.listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise _bad(f"{admin.listen!r} is not HOST:PORT", "admin.listen")


def _clocks(clocks: ClocksSection) -> None:
    if clocks.max_offset_ms < clocks.warn_offset_ms:
        raise _bad(f"must be >= warn_offset_ms ({clocks.warn_offset_ms})", "clocks.max_offset_ms")


def _ha(ha: HaSection) -> None:
    if ha.margin_s < 0 or ha.lease_s * (1 - ha.drift) / (1 + ha.drift) - ha.margin_s < ha.lease_s / 2:
        raise _bad(f"must leave the holder at least half the lease ({ha.lease_s:g} s)", "ha.margin_s")


def _conflicts(section: ConflictSection, nodes: Sequence[NodeConfig]) -> None:
    if section.keep_s < 1:
        raise ConfigError(f"conflicts.keep: {section.keep!r} is too short: at least 1s (e.g. '7d')")
    if section.window_ms > 0:
        raise ConfigError(
            "conflicts.window_ms: node_priority's hold for a time window is not built, so a window can"
            " leave nodes apart; use window_ms = 0"
        )
    names = [node.name for node in nodes]
    seen: set[str] = set()
    for name in section.node_priority:
        if name not in names:
            known = ", ".join(names)
            raise ConfigError(f"conflicts.node_priority: {name!r} is not a configured node (nodes: {known})")
        if name in seen:
            raise ConfigError(f"conflicts.node_priority: {name!r} is listed twice")
        seen.add(name)


def _tables(tables: Sequence[TableSection], replication: ReplicationSection) -> None:
    seen: dict[tuple[str, str], int] = {}
    for i, entry in enumerate(tables):
        key = f"tables[{i}]"
        schema, table = entry.qualified
        qualified = f"{schema}.{table}"
        if (schema, table) in seen:
            first = seen[(schema, table)]
            raise ConfigError(f"{key}.name: table {qualified} is listed twice (also tables[{first}])")
        seen[(schema, table)] = i
        if not replication.replicates(schema, table):
            raise ConfigError(f"{key}.name: {qualified} is not replicated (see [replication] tables/exclude)")
        columns = entry.delta_columns
        if any(not c for c in columns) or len(set(columns)) != len(columns):
            raise ConfigError(f"{key}.delta_columns: column names must be non-empty and distinct")


def _resolvers(section: ConflictSection, tables: Sequence[TableSection]) -> None:
    if not section.node_priority:
        for key, value in resolvers_in_effect(section, tables):
            if value == Resolver.NODE_PRIORITY:
                raise ConfigError(f'{key}: node_priority needs [conflicts] node_priority = ["node", ...]')
    if not section.allow_divergence:
        for setting in divergent_resolvers(section, tables):
            key, _, rest = setting.partition(" = ")
            raise ConfigError(
                f"{key}: {rest} can leave nodes with different rows for ever (docs/conflicts.md,"
                " Resolvers); use last_update_wins or node_priority, or accept that with [conflicts]"
                " allow_divergence = true"
            )


def _sequences(sequences: SequencesSection, nodes: Sequence[NodeConfig]) -> None:
    # Node ids are 0..n-1 for a cluster that never lost a node; `pgmesh sequences convert` checks the
    # ids actually assigned.
    step = sequences.step
    least = max(2, len(nodes))
    if step < least:
        raise ConfigError(
            f"sequences.step: {step} is too small; it must be greater than every node id"
            f" (at least {least} for {len(nodes)} nodes)"
        )


def check(
    *,
    nodes: Sequence[NodeConfig],
    replication: ReplicationSection,
    admin: AdminSection,
    conflicts: ConflictSection,
    tables: Sequence[TableSection],
    sequences: SequencesSection,
    clocks: ClocksSection,
    ddl: DdlSection,
    log: LogSection,
    ha: HaSection,
) -> None:
    """Raise the `ConfigError` ("key: message") of the first rule the decoded sections break, in this
    order (the order of the file's usual sections)."""
    _nodes(nodes, replication)
    _log(log)
    _ddl(ddl, replication)
    _admin(admin)
    _clocks(clocks)
    _ha(ha)
    _conflicts(conflicts, nodes)
    _tables(tables, replication)
    _resolvers(conflicts, tables)
    _sequences(sequences, nodes)


def resolvers_in_effect(section: ConflictSection, tables: Sequence[TableSection]) -> list[tuple[str, str]]:
    """Every (key, resolver) the config sets, in file order."""
    found = [("conflicts.resolver", section.resolver)]
    found += [(f"conflicts.types.{t}", v) for t, v in section.types.items()]
    for i, entry in enumerate(tables):
        if entry.resolver is not None:
            found.append((f"tables[{i}].resolver", entry.resolver))
        found += [(f"tables[{i}].types.{t}", v) for t, v in entry.types.items()]
    return found


def divergent_resolvers(section: ConflictSection, tables: Sequence[TableSection]) -> list[str]:
    """Every resolver setting that can leave nodes with different rows, as `key = resolver (where)`."""
    found = []
    for key, value in resolvers_in_effect(section, tables):
        if value not in RESOLVER_NAMES:
            continue
        kind = key.rpartition(".types.")[2] if ".types." in key else None
        if not can_diverge(Resolver(value), ConflictType(kind) if kind else None):
            continue
        index = key.partition("[")[2].partition("]")[0]
        where = tables[int(index)].name if key.startswith("tables[") else "every table"
        found.append(f"{key} = {value} ({where})")
    return found
