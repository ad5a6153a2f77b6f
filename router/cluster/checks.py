"""Whether a node can take part: the pre-flight checks of `pgmesh init`, pure rules on what was read.

Owns the checks, pure functions of each node's facts (`router.cluster.facts`): server version, the
settings logical replication and commit timestamps need, free slots and WAL senders, the role's
privileges, and that every replicated table exists on every node with the same columns, a key, and the
same primary key, unique constraints and indexes and replica identity (`router.cluster.keys`: compared by
shape, never by name), that tables with delta columns can have them, and that each custom resolver
decides alike whichever side is local (`router.conflicts.symmetry`), and a standby's failover
(`router.cluster.standbys`). The report (`InitReport`) renders one block per node, one line per check,
and what to do under each problem or warning. `check_cluster` reads every node and checks it; a node that
cannot be read is a failed check.

Must not: read a node itself (that is `router.cluster.facts`), write anything to a node (installing is
`router.cluster.install`'s), stream or apply changes, decide retry policy (that is
`router.errors.decide`), or ever put a DSN or a password into a message (psycopg errors go through
`describe`).
Identifiers are always quoted with `psycopg.sql.Identifier`.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import msgspec
import psycopg
from psycopg import sql

from router.cluster.clocks import ClockLevel, decides_by_time, level_of
from router.cluster.facts import (
    CHECK_LOCK_WAIT_S,
    NodeFacts,
    TableFacts,
    TableName,
    connect,
    read_node,
    replicated_tables,
)
from router.cluster.keys import IDENTITY_GONE, key_diff
from router.cluster.standbys import failover_finding
from router.config.model import Config, NodeConfig
from router.conflicts.resolve import ConflictType, load_custom
from router.conflicts.symmetry import asymmetry
from router.errors import ConfigError, PgmeshError, describe

# NodeFacts, TableName, connect and replicated_tables live in router.cluster.facts; named here too for the
# modules that import them with the checks
__all__ = [
    "Check",
    "InitReport",
    "NodeFacts",
    "TableName",
    "check_cluster",
    "connect",
    "replicated_tables",
]

logger = logging.getLogger(__name__)

MIN_VERSION_NUM: Final = 150000
OK_MARK: Final = "✓"
FAIL_MARK: Final = "✗"
WARN_MARK: Final = "!"
_RESTART: Final = "in postgresql.conf (or ALTER SYSTEM SET) and restart the server"
# Types a delta column may have (format_type names, without a typmod).
_DELTA_TYPES: Final = frozenset({"smallint", "integer", "bigint", "numeric", "real", "double precision"})


class Check(msgspec.Struct, frozen=True):
    """One pre-flight check on one node; `hint` says what to do when it failed or warns (`ok`: passes)."""

    node: str
    check: str
    ok: bool
    detail: str
    relation: str | None = None
    hint: str | None = None
    warn: bool = False


class InitReport(msgspec.Struct, frozen=True):
    """Every check on every node, and the replicated set (schema, table) found on the nodes."""

    checks: list[Check]
    tables: list[TableName] = msgspec.field(default_factory=list)
    cluster: str = ""
    counted: str = ""  # the title's count when `tables` is not the report's (init --check: each node's)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def problems(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def render(self) -> str:
        """A readable report: one block per node, one line per check, what to do under each problem."""
        names = ", ".join(f"{s}.{t}" for s, t in self.tables) or "none yet"
        title = f"cluster {self.cluster}: " if self.cluster else ""
        lines = [f"{title}{self.counted or f'{len(self.tables)} replicated tables ({names})'}"]
        nodes = list(dict.fromkeys(c.node for c in self.checks))
        width = max((len(c.check) for c in self.checks), default=0)
        for node in nodes:
            lines.append(f"node {node}")
            for c in (c for c in self.checks if c.node == node):
                what = f"table {c.relation}: {c.detail}" if c.relation else c.detail
                mark = FAIL_MARK if not c.ok else WARN_MARK if c.warn else OK_MARK
                lines.append(f"  {mark} {c.check:<{width}}  {what}")
                if (c.warn or not c.ok) and c.hint:
                    lines.append(f"    {'':<{width}}  -> {c.hint}")
        problems = self.problems
        if problems:
            where = ", ".join(dict.fromkeys(c.node for c in problems))
            lines.append(
                f"NOT READY: {len(problems)} problem(s) on node {where}; fix them and run init again"
            )
        else:
            lines.append("ready: every node passed every check")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Reading every node (router.cluster.facts): a node that cannot be read is a failed check


_MISSING_DATABASE: Final = re.compile(r'database "(.+?)" does not exist')  # the server's FATAL (3D000)


def _connect_hint(node: str, exc: BaseException) -> str:
    text = str(exc)
    missing = _MISSING_DATABASE.search(text)
    if getattr(exc, "sqlstate", None) == "3D000" or missing:  # (libpq gives no SQLSTATE for a refused start)
        name = f'"{missing.group(1)}" ' if missing else ""
        return (f"node {node} is running, but the database {name}named in its dsn does not exist there:"
                " fix dbname in the dsn, or create the database (CREATE DATABASE)")
    if "password" in text or "authentication" in text or "pg_hba" in text:
        return f"check the user and password in the dsn of node {node} and the server's pg_hba.conf"
    return f"check that node {node} is running and reachable at the host and port of its dsn"


async def _probe(config: Config, node: NodeConfig) -> NodeFacts | Check:
    """The node's facts, or a failed `connect` check saying why it could not be read."""
    try:
        conn = await connect(node)
    except PgmeshError as exc:
        return Check(node.name, "connect", False, exc.message, hint=exc.hint)
    except (psycopg.Error, OSError) as exc:
        return Check(node.name, "connect", False, describe(exc), hint=_connect_hint(node.name, exc))
    try:
        async with conn:
            return await read_node(conn, config)  # waits at most CHECK_LOCK_WAIT_S for a lock
    except psycopg.errors.LockNotAvailable as exc:
        hint = f"a session on node {node.name} holds a table exclusively for more than {CHECK_LOCK_WAIT_S} s"
        detail = f"reading the catalog waited too long: {describe(exc)}"
        return Check(node.name, "catalog", False, detail, hint=hint)
    except (psycopg.Error, OSError) as exc:
        hint = f"init installs: connect node {node.name} as a superuser (else see `pgmesh init --print-sql`)"
        return Check(node.name, "catalog", False, f"reading the catalog failed: {describe(exc)}", hint=hint)


# ---------------------------------------------------------------------------------------------------------
# Checks on one node's settings and role (pure)


def _check_connect(f: NodeFacts, config: Config) -> Check:
    return Check("", "connect", True, f"database {f.database} as user {f.user}")


def _check_version(f: NodeFacts, config: Config) -> Check:
    num = int(f.settings.get("server_version_num", "0"))
    ok = num >= MIN_VERSION_NUM
    detail = f"{f.settings.get('server_version', num)}" + ("" if ok else " is older than 15")
    return Check("", "version", ok, detail, hint=None if ok else "upgrade the node to PostgreSQL 15 or later")


def _check_wal_level(f: NodeFacts, config: Config) -> Check:
    level = f.settings.get("wal_level", "?")
    ok = level == "logical"
    detail = "logical" if ok else f"is {level}, logical decoding needs logical"
    return Check("", "wal_level", ok, detail, hint=None if ok else f"set wal_level = logical {_RESTART}")


def _check_commit_ts(f: NodeFacts, config: Config) -> Check:
    value = f.settings.get("track_commit_timestamp", "?")
    ok = value == "on"
    detail = "on" if ok else f"is {value}; conflict resolution needs each row's commit time"
    hint = None if ok else f"set track_commit_timestamp = on {_RESTART}"
    return Check("", "track_commit_timestamp", ok, detail, hint=hint)


def _check_clock(f: NodeFacts, config: Config) -> Check | None:
    """The node's clock against this host's (the router's, when init runs where the router will)."""
    if f.clock is None:
        return None
    bounds = config.clocks
    level = level_of(f.clock.offset, bounds)
    detail = (f"{f.clock.offset * 1000 + 0.0:+.1f} ms from this host's clock"
              f" (round trip {f.clock.round_trip * 1000:.1f} ms)")
    if level is ClockLevel.OK:
        return Check("", "clock", True, detail)
    if level is ClockLevel.WARN:
        return Check("", "clock", True, f"{detail}, beyond [clocks] warn_offset_ms = {bounds.warn_offset_ms}")
    if not decides_by_time(config):
        return Check("", "clock", True, f"{detail}; no resolver decides by commit times")
    detail += f", beyond [clocks] max_offset_ms = {bounds.max_offset_ms}"
    hint = ("sync the node's clock with this host's (NTP, chrony); until then the router holds the links into"
            " and out of the node that decide conflicts by commit times")
    return Check("", "clock", False, detail, hint=hint)


def _check_slots(f: NodeFacts, config: Config) -> Check:
    total = int(f.settings.get("max_replication_slots", "0"))
    needed, free = (0 if f.own_slot else 1), total - f.slots_used
    if f.own_slot and (f.own_slot[0] != "pgoutput" or f.own_slot[1] != f.database):
        plugin, db, _ = f.own_slot
        detail = f"slot {config.slot_name} exists for plugin {plugin!r} in database {db!r}"
        fix = f"drop it (SELECT pg_drop_replication_slot('{config.slot_name}')) or rename the cluster"
        return Check("", "replication_slots", False, detail, hint=fix)
    ok = free >= needed
    detail = f"{f.slots_used} of {total} in use, pgmesh needs {needed} more"
    hint = None if ok else f"raise max_replication_slots to at least {f.slots_used + needed} {_RESTART}"
    return Check("", "replication_slots", ok, detail, hint=hint)


def _check_origins(f: NodeFacts, config: Config) -> Check:
    """Room for pgmesh's origins: an origin with progress holds one of the node's states until dropped."""
    new = "max_active_replication_origins"  # 18+; `max_replication_slots` sizes them before
    name = new if new in f.settings else "max_replication_slots"
    total, needed = int(f.settings.get(name, "0")), config.origins_per_node()
    ok = total - f.origins_used >= needed
    detail = f"{f.origins_used} of {total} held by other origins, pgmesh needs {needed}"
    hint = None if ok else f"raise {name} to at least {f.origins_used + needed} {_RESTART}"
    return Check("", "replication_origins", ok, detail, hint=hint)


def _check_walsenders(f: NodeFacts, config: Config) -> Check:
    total = int(f.settings.get("max_wal_senders", "0"))
    needed = 0 if f.own_slot and f.own_slot[2] else 1
    ok = total - f.walsenders >= needed
    detail = f"{f.walsenders} of {total} in use, pgmesh needs {needed} more"
    hint = None if ok else f"raise max_wal_senders to at least {f.walsenders + needed} {_RESTART}"
    return Check("", "wal_senders", ok, detail, hint=hint)


def _check_superuser(f: NodeFacts, config: Config) -> Check:
    if f.superuser:
        return Check("", "superuser", True, f"{f.user} is a superuser")
    detail = (f"{f.user} is not a superuser: installing (event triggers) needs one; `pgmesh run` needs only"
              " grants (REPLICATION, origin functions, SET on session_replication_role: docs/security.md)")
    hint = "run init as a superuser, or have a DBA run the script of `pgmesh init --print-sql`, then --check"
    return Check("", "superuser", False, detail, hint=hint)


def _check_plugin(f: NodeFacts, config: Config) -> Check | None:
    allowed = f.settings.get("output_plugin_libraries")
    if allowed is None:
        return None
    names = {part.strip() for part in allowed.split(",")}
    ok = "pgoutput" in names
    detail = f"output_plugin_libraries = {allowed!r}" + ("" if ok else " does not allow pgoutput")
    hint = None if ok else f"add pgoutput to output_plugin_libraries {_RESTART}"
    return Check("", "output_plugin_libraries", ok, detail, hint=hint)


def _check_publication(f: NodeFacts, config: Config) -> Check | None:
    if not f.publication_all_tables:
        return None
    name = config.publication_name
    detail = f"publication {name} exists FOR ALL TABLES; pgmesh did not create it"
    hint = f"drop it (DROP PUBLICATION {sql.Identifier(name).as_string()}) or rename the cluster"
    return Check("", "publication", False, detail, hint=hint)


def _check_failover(f: NodeFacts, config: Config) -> Check | None:
    """With a physical standby: whether pgmesh's slot survives its promotion (router.cluster.standbys)."""
    found = failover_finding(f.standby, config.slot_name)
    return None if found is None else Check("", "failover", **msgspec.structs.asdict(found))


_NODE_CHECKS: Final[Sequence[Callable[[NodeFacts, Config], Check | None]]] = (
    _check_connect, _check_version, _check_wal_level, _check_commit_ts, _check_clock, _check_slots,
    _check_origins, _check_walsenders, _check_superuser, _check_plugin, _check_publication, _check_failover,
)


def _node_checks(name: str, facts: NodeFacts, config: Config) -> list[Check]:
    found = (check(facts, config) for check in _NODE_CHECKS)
    return [msgspec.structs.replace(c, node=name) for c in found if c is not None]


# ---------------------------------------------------------------------------------------------------------
# Checks on the replicated tables across nodes (pure)


def _qualified(table: TableName) -> str:
    return f"{table[0]}.{table[1]}"


def _sql_name(table: TableName) -> str:
    return sql.Identifier(*table).as_string()


def _column_diff(mine: Mapping[str, str], theirs: Mapping[str, str], other: str) -> list[str]:
    """Order-insensitive differences of (name -> type) between this node and node `other`."""
    out: list[str] = []
    for column in sorted(mine.keys() | theirs.keys()):
        here, there = mine.get(column), theirs.get(column)
        if here == there:
            continue
        if here is None:
            out.append(f"column {column} ({there}) is missing here")
        elif there is None:
            out.append(f"column {column} ({here}) does not exist on node {other}")
        else:
            out.append(f"column {column} is {here} here but {there} on node {other}")
    return out


_KEYS_HINT: Final = (
    "make the keys alike on every node, or rows one node accepts another refuses or matches differently"
    " (index names may differ; columns, expressions, WHERE, NULLS NOT DISTINCT, DEFERRABLE may not)"
)


def without_key(facts: TableFacts) -> bool:
    """Whether the table has no usable replica identity: DEFAULT without an immediate primary key (a
    deferrable one is no replica identity to PostgreSQL)."""
    return facts.replident == "d" and not facts.has_pk


def _key_problem(facts: TableFacts, keyless: str) -> str | None:
    """Why rows of the table cannot be identified on the other nodes, or None when they can. Under
    `new_table_without_key = "full"` (`keyless`) a table without a key is not a problem: install makes it
    REPLICA IDENTITY FULL, as the DDL capture does with one created later."""
    if facts.replident == "n":
        return "has REPLICA IDENTITY NOTHING: its updates and deletes cannot be replicated"
    if without_key(facts) and keyless != "full":
        return ("has no primary key (or only a deferrable one) and no REPLICA IDENTITY FULL: its rows"
                " cannot be matched on other nodes")
    if facts.replident == "i" and facts.keys.identity == IDENTITY_GONE:
        return "has REPLICA IDENTITY USING INDEX, but that index is gone: its rows cannot be matched"
    return None


def _table_problems(name: str, table: TableName, facts: Mapping[str, NodeFacts], keyless: str) -> list[Check]:
    """What is wrong with `table` on node `name`, compared with the first node that has it."""
    qualified = _qualified(table)
    exclude = f'list "{qualified}" under [replication] exclude'
    holders = [n for n, f in facts.items() if table in f.tables]
    mine = facts[name].tables.get(table)
    if mine is None:
        fix = f"create it on node {name} with the same columns as on node {holders[0]}, or {exclude}"
        return [
            Check(name, "table", False, f"missing here (exists on node {', '.join(holders)})", qualified, fix)
        ]
    found: list[tuple[str, str]] = []  # (what is wrong, what to do)
    checks: list[Check] = []
    if holders[0] != name:
        first = facts[holders[0]].tables[table]
        diff = _column_diff(mine.columns, first.columns, holders[0])
        if diff:
            found.append(("; ".join(diff), "make the column names and types the same on every node"))
        diff = key_diff(mine.keys, first.keys, holders[0])
        if diff:
            checks.append(Check(name, "keys", False, "; ".join(diff), qualified, _KEYS_HINT))
    if mine.persistence == "u":
        fix = f"ALTER TABLE {_sql_name(table)} SET LOGGED, or {exclude}"
        found.append(("is UNLOGGED: unlogged tables cannot be published", fix))
    problem = _key_problem(mine, keyless)
    if not mine.columns:
        fix = f"give it columns and a primary key, or {exclude}"
        found.append(("has no columns: its rows cannot be told apart, matched or keyed on other nodes", fix))
    elif problem:
        found.append((problem, f"add a primary key, or ALTER TABLE {_sql_name(table)} REPLICA IDENTITY FULL"))
    return [Check(name, "table", False, detail, qualified, hint) for detail, hint in found] + checks


def _table_checks(facts: Mapping[str, NodeFacts], keyless: str) -> list[Check]:
    """Every replicated table seen on any node must be on every node, alike, with a key (or made
    REPLICA IDENTITY FULL by install, under `new_table_without_key = "full"`)."""
    wanted = sorted({t for f in facts.values() for t in f.tables})
    checks: list[Check] = []
    for name in facts:
        problems = [p for table in wanted for p in _table_problems(name, table, facts, keyless)]
        if not problems:
            detail = f"{len(wanted)} replicated tables, alike on every node (columns, keys), each with a key"
            bare = sum(without_key(facts[name].tables[t]) for t in wanted)
            if bare:
                detail += f" or made REPLICA IDENTITY FULL by init ({bare} without a key)"
            if not wanted:
                detail = "no replicated tables yet (the publication starts empty)"
            problems = [Check(name, "tables", True, detail)]
        checks.extend(problems)
    return checks


def _delta_problems(
    table: TableName, facts: TableFacts | None, columns: Sequence[str]
) -> list[tuple[str, str]]:
    """Why `table` on one node cannot have these delta columns, each with its fix (empty when it can)."""
    if facts is None:
        return [("is not a replicated table on this node", f"create {_qualified(table)} here")]
    found: list[tuple[str, str]] = []
    if facts.replident != "f":
        fix = f"ALTER TABLE {_sql_name(table)} REPLICA IDENTITY FULL"
        found.append(("is not REPLICA IDENTITY FULL (delta columns need the old row)", fix))
    numeric = "int2/int4/int8/numeric/float4/float8"
    for column in columns:
        type_ = facts.columns.get(column)
        if type_ is None:
            found.append((f"has no column {column}", f"add {column} ({numeric})"))
        elif type_.partition("(")[0] not in _DELTA_TYPES:
            found.append((f"column {column} is {type_}, not a numeric type", f"make {column} {numeric}"))
    return found


def _delta_checks(config: Config, facts: Mapping[str, NodeFacts]) -> list[Check]:
    """Every [[tables]] entry with delta_columns, on every node: REPLICA IDENTITY FULL, numeric columns."""
    checks: list[Check] = []
    entries = [e for e in config.tables if e.delta_columns]
    for name, node in facts.items():
        for entry in entries:
            table = entry.qualified
            columns = ", ".join(entry.delta_columns)
            found = _delta_problems(table, node.tables.get(table), entry.delta_columns)
            if not found:
                detail = f"delta columns {columns}: numeric, REPLICA IDENTITY FULL"
                checks.append(Check(name, "delta_columns", True, detail, _qualified(table)))
                continue
            detail = f"delta columns {columns}: " + "; ".join(problem for problem, _ in found)
            hint = "; ".join(fix for _, fix in found) + "; or drop delta_columns from the config"
            checks.append(Check(name, "delta_columns", False, detail, _qualified(table), hint))
    return checks


def _resolver_checks(config: Config, facts: Mapping[str, NodeFacts]) -> list[Check]:
    """Each custom resolver in effect on a replicated table, run on generated pairs in both orders
    (router.conflicts.symmetry): one that ends two nodes apart is refused. Reported under the first node
    read (the router, not a node, runs it), once per table."""
    if not facts:
        return []
    name, node = next(iter(facts.items()))
    checks: list[Check] = []
    for table in sorted(t for t in node.tables if config.replicates(*t)):
        policies = {kind: config.policy(*table, kind.value) for kind in ConflictType}
        specs = sorted({p.custom for p in policies.values() if p.custom is not None})
        if not specs:
            continue
        spec = ", ".join(specs)
        try:
            loaded = {s: load_custom(s) for s in specs}
        except ConfigError as exc:
            hint = "install the module where the router runs (on its PYTHONPATH), or fix the name"
            checks.append(Check(name, "resolver", False, exc.message, _qualified(table), hint))
            continue
        resolvers = {k: (p, loaded.get(p.custom or "")) for k, p in policies.items()}
        why = asymmetry(resolvers, node.tables[table].columns)
        if why is None:
            detail = f"custom resolver {spec}: the same outcome whichever side is local"
            checks.append(Check(name, "resolver", True, detail, _qualified(table)))
            continue
        hint = "make it a deterministic choice between the two versions that ignores which is local"
        detail = f"custom resolver {spec} can leave nodes apart: {why}"
        checks.append(Check(name, "resolver", False, detail, _qualified(table), hint))
    return checks


async def check_cluster(config: Config) -> InitReport:
    """Read every node concurrently and check it; a node that cannot be reached is a failed check."""
    results = await asyncio.gather(*(_probe(config, node) for node in config.nodes))
    checks: list[Check] = []
    facts: dict[str, NodeFacts] = {}
    for node, result in zip(config.nodes, results, strict=True):
        if isinstance(result, Check):
            checks.append(result)
        else:
            facts[node.name] = result
            checks.extend(_node_checks(node.name, result, config))
    order = {name: i for i, name in enumerate(config.node_names)}
    checks += _table_checks(facts, config.replication.new_table_without_key) + _delta_checks(config, facts)
    checks += _resolver_checks(config, facts)
    checks = sorted(checks, key=lambda c: order[c.node])
    tables = sorted({t for f in facts.values() for t in f.tables})
    report = InitReport(checks, tables, config.cluster.name)
    logger.info("init checks for cluster %s: %d problem(s)", config.cluster.name, len(report.problems))
    return report
