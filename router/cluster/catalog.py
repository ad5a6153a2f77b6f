"""What pgmesh installs on a node, and how it checks that a node can take part.

Owns the pre-flight checks of `pgmesh init` (server version, the settings logical replication and
commit timestamps need, free slots and WAL senders, the role's privileges, and that every replicated
table exists on every node with the same columns and a key, and that tables with delta columns can
have them), and the objects pgmesh keeps on each node: the `pgmesh` schema with its `links` table, the
publication, the logical slot, one replication origin per other node, and (through
`router.conflicts.catalog`) the conflict history, tombstones, their trigger and the applier's guards.
Installing is idempotent; `uninstall` removes all of it from one node.

Must not: stream or apply changes, decide retry policy (that is `router.errors.decide`), create or alter
user tables (beyond the tombstone trigger), or ever put a DSN or a password into a message (psycopg
errors go through `describe`).
Identifiers are always quoted with `psycopg.sql.Identifier`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import msgspec
import psycopg
from psycopg import sql

from router.config import PGMESH_SCHEMA, SYSTEM_SCHEMAS, Config, NodeConfig
from router.conflicts.catalog import install_conflict_catalog
from router.ddl.capture import install_ddl_capture
from router.errors import ConfigError, PgmeshError, SlotError, describe

__all__ = [
    "Check",
    "InitReport",
    "check_cluster",
    "init_cluster",
    "install",
    "replicated_tables",
    "uninstall",
]

logger = logging.getLogger(__name__)

Conn = psycopg.AsyncConnection[Any]
TableName = tuple[str, str]

MIN_VERSION_NUM: Final = 150000
CONNECT_TIMEOUT_S: Final = 10
APPLICATION_NAME: Final = "pgmesh init"
OK_MARK: Final = "✓"
FAIL_MARK: Final = "✗"
_SETTINGS: Final = (
    "server_version",
    "server_version_num",
    "wal_level",
    "track_commit_timestamp",
    "max_replication_slots",
    "max_wal_senders",
    "output_plugin_libraries",
)
_RESTART: Final = "in postgresql.conf (or ALTER SYSTEM SET) and restart the server"
# Types a delta column may have (format_type names, without a typmod).
_DELTA_TYPES: Final = frozenset({"smallint", "integer", "bigint", "numeric", "real", "double precision"})

# Ordinary and partitioned tables outside the system schemas. Partitions are left out: a partitioned
# table stands for its partitions (the publication publishes via the partition root).
_TABLES_SQL: Final = """
SELECT n.nspname, c.relname, c.relpersistence::text, c.relreplident::text,
       EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary),
       a.attname, format_type(a.atttypid, a.atttypmod)
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
  AND n.nspname <> ALL(%s) AND n.nspname NOT LIKE 'pg\\_%%'
ORDER BY n.nspname, c.relname, a.attnum
"""


class Check(msgspec.Struct, frozen=True):
    """One pre-flight check on one node; `hint` says what to do when it failed."""

    node: str
    check: str
    ok: bool
    detail: str
    relation: str | None = None
    hint: str | None = None


class InitReport(msgspec.Struct, frozen=True):
    """Every check on every node, and the replicated set (schema, table) found on the nodes."""

    checks: list[Check]
    tables: list[TableName] = msgspec.field(default_factory=list)
    cluster: str = ""

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
        lines = [f"{title}{len(self.tables)} replicated tables ({names})"]
        nodes = list(dict.fromkeys(c.node for c in self.checks))
        width = max((len(c.check) for c in self.checks), default=0)
        for node in nodes:
            lines.append(f"node {node}")
            for c in (c for c in self.checks if c.node == node):
                what = f"table {c.relation}: {c.detail}" if c.relation else c.detail
                lines.append(f"  {OK_MARK if c.ok else FAIL_MARK} {c.check:<{width}}  {what}")
                if not c.ok and c.hint:
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


class TableFacts(msgspec.Struct, frozen=True):
    persistence: str
    replident: str
    has_pk: bool
    columns: dict[str, str]


class NodeFacts(msgspec.Struct, frozen=True):
    """What one node told us, read once; the checks are pure functions of these."""

    settings: dict[str, str]
    user: str
    superuser: bool
    slots_used: int
    own_slot: tuple[str, str, bool] | None  # (plugin, database, active)
    database: str
    walsenders: int
    tables: dict[TableName, TableFacts]


# ---------------------------------------------------------------------------------------------------------
# Connecting


async def _connect(node: NodeConfig) -> Conn:
    """An autocommit admin connection; a DSN that does not parse is reported without echoing it."""
    try:
        return await psycopg.AsyncConnection.connect(
            node.dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S, application_name=APPLICATION_NAME
        )
    except psycopg.ProgrammingError:
        raise PgmeshError(
            "the dsn is not a valid libpq connection string", node=node.name, hint="fix its dsn in the config"
        ) from None


def _connect_hint(node: str, exc: BaseException) -> str:
    text = str(exc)
    if "password" in text or "authentication" in text or "pg_hba" in text:
        return f"check the user and password in the dsn of node {node} and the server's pg_hba.conf"
    return f"check that node {node} is running and reachable at the host and port of its dsn"


# ---------------------------------------------------------------------------------------------------------
# Reading a node


async def _table_facts(conn: Conn) -> dict[TableName, TableFacts]:
    """Every candidate table of the node with its columns (name -> type), key and replica identity."""
    found: dict[TableName, TableFacts] = {}
    cur = await conn.execute(_TABLES_SQL, [sorted(SYSTEM_SCHEMAS)])
    for schema, table, persistence, replident, has_pk, column, type_ in await cur.fetchall():
        facts = found.get((schema, table))
        if facts is None:
            facts = found[(schema, table)] = TableFacts(persistence, replident, has_pk, {})
        if column is not None:
            facts.columns[column] = type_
    return found


async def replicated_tables(conn: Conn, config: Config) -> list[TableName]:
    """The tables of the connected node that `config` replicates, as sorted (schema, table) pairs."""
    return sorted(t for t in await _table_facts(conn) if config.replicates(*t))


async def _read_node(conn: Conn, config: Config) -> NodeFacts:
    cur = await conn.execute("SELECT name, setting FROM pg_settings WHERE name = ANY(%s)", [list(_SETTINGS)])
    settings: dict[str, str] = {name: value for name, value in await cur.fetchall()}
    cur = await conn.execute(
        "SELECT current_user, (SELECT rolsuper FROM pg_roles WHERE rolname = current_user),"
        " current_database(), (SELECT count(*) FROM pg_replication_slots),"
        " (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender')"
    )
    row = await cur.fetchone()
    assert row is not None
    user, superuser, database, slots_used, walsenders = row
    cur = await conn.execute(
        "SELECT plugin, coalesce(database, ''), active FROM pg_replication_slots WHERE slot_name = %s",
        [config.slot_name],
    )
    own = await cur.fetchone()
    tables = {t: f for t, f in (await _table_facts(conn)).items() if config.replicates(*t)}
    return NodeFacts(
        settings=settings,
        user=user,
        superuser=bool(superuser),
        slots_used=int(slots_used),
        own_slot=(own[0] or "", own[1], bool(own[2])) if own else None,
        database=database,
        walsenders=int(walsenders),
        tables=tables,
    )


async def _probe(config: Config, node: NodeConfig) -> NodeFacts | Check:
    """The node's facts, or a failed `connect` check saying why it could not be read."""
    try:
        conn = await _connect(node)
    except PgmeshError as exc:
        return Check(node.name, "connect", False, exc.message, hint=exc.hint)
    except (psycopg.Error, OSError) as exc:
        return Check(node.name, "connect", False, describe(exc), hint=_connect_hint(node.name, exc))
    try:
        async with conn:
            return await _read_node(conn, config)
    except (psycopg.Error, OSError) as exc:
        hint = f"check that the dsn of node {node.name} connects as a superuser to the right database"
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


def _check_slots(f: NodeFacts, config: Config) -> Check:
    total = int(f.settings.get("max_replication_slots", "0"))
    needed = 0 if f.own_slot else 1
    free = total - f.slots_used
    if f.own_slot and (f.own_slot[0] != "pgoutput" or f.own_slot[1] != f.database):
        plugin, db, _ = f.own_slot
        detail = f"slot {config.slot_name} exists for plugin {plugin!r} in database {db!r}"
        fix = f"drop it (SELECT pg_drop_replication_slot('{config.slot_name}')) or rename the cluster"
        return Check("", "replication_slots", False, detail, hint=fix)
    ok = free >= needed
    detail = f"{f.slots_used} of {total} in use, pgmesh needs {needed} more"
    hint = None if ok else f"raise max_replication_slots to at least {f.slots_used + needed} {_RESTART}"
    return Check("", "replication_slots", ok, detail, hint=hint)


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
    detail = (
        f"{f.user} is not a superuser; on PostgreSQL 15 the applier's session_replication_role = replica"
        " and replication origins are superuser-only"
    )
    return Check(
        "", "superuser", False, detail, hint=f"connect as a superuser, or ALTER ROLE {f.user} SUPERUSER"
    )


def _check_plugin(f: NodeFacts, config: Config) -> Check | None:
    allowed = f.settings.get("output_plugin_libraries")
    if allowed is None:
        return None
    names = {part.strip() for part in allowed.split(",")}
    ok = "pgoutput" in names
    detail = f"output_plugin_libraries = {allowed!r}" + ("" if ok else " does not allow pgoutput")
    hint = None if ok else f"add pgoutput to output_plugin_libraries {_RESTART}"
    return Check("", "output_plugin_libraries", ok, detail, hint=hint)


_NODE_CHECKS: Final[Sequence[Callable[[NodeFacts, Config], Check | None]]] = (
    _check_connect,
    _check_version,
    _check_wal_level,
    _check_commit_ts,
    _check_slots,
    _check_walsenders,
    _check_superuser,
    _check_plugin,
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


def _key_problem(facts: TableFacts) -> str | None:
    """Why rows of the table cannot be identified on the other nodes, or None when they can."""
    if facts.replident == "n":
        return "has REPLICA IDENTITY NOTHING: its updates and deletes cannot be replicated"
    if facts.replident == "d" and not facts.has_pk:
        return "has no primary key and no REPLICA IDENTITY FULL: its rows cannot be matched on other nodes"
    return None


def _table_problems(name: str, table: TableName, facts: Mapping[str, NodeFacts]) -> list[Check]:
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
    if holders[0] != name:
        diff = _column_diff(mine.columns, facts[holders[0]].tables[table].columns, holders[0])
        if diff:
            found.append(("; ".join(diff), "make the column names and types the same on every node"))
    if mine.persistence == "u":
        fix = f"ALTER TABLE {_sql_name(table)} SET LOGGED, or {exclude}"
        found.append(("is UNLOGGED: unlogged tables cannot be published", fix))
    problem = _key_problem(mine)
    if problem:
        found.append((problem, f"add a primary key, or ALTER TABLE {_sql_name(table)} REPLICA IDENTITY FULL"))
    return [Check(name, "table", False, detail, qualified, hint) for detail, hint in found]


def _table_checks(facts: Mapping[str, NodeFacts]) -> list[Check]:
    """Every replicated table seen on any node must be on every node, alike, with a key."""
    wanted = sorted({t for f in facts.values() for t in f.tables})
    checks: list[Check] = []
    for name in facts:
        problems = [p for table in wanted for p in _table_problems(name, table, facts)]
        if not problems:
            detail = f"{len(wanted)} replicated tables, alike on every node, each with a key"
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
    checks += _table_checks(facts) + _delta_checks(config, facts)
    checks = sorted(checks, key=lambda c: order[c.node])
    tables = sorted({t for f in facts.values() for t in f.tables})
    report = InitReport(checks, tables, config.cluster.name)
    logger.info("init checks for cluster %s: %d problem(s)", config.cluster.name, len(report.problems))
    return report


# ---------------------------------------------------------------------------------------------------------
# Installing


_LINKS_DDL: Final = sql.SQL(
    "CREATE TABLE IF NOT EXISTS {}.links (source text PRIMARY KEY, paused boolean NOT NULL DEFAULT false,"
    " reason text, updated timestamptz NOT NULL DEFAULT now())"
)


async def _ensure_schema(conn: Conn) -> list[str]:
    cur = await conn.execute(
        "SELECT to_regnamespace(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL",
        [PGMESH_SCHEMA, f"{PGMESH_SCHEMA}.links"],
    )
    row = await cur.fetchone()
    assert row is not None
    schema = sql.Identifier(PGMESH_SCHEMA)
    await conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(schema))
    await conn.execute(_LINKS_DDL.format(schema))
    done = [] if row[0] else [f"created schema {PGMESH_SCHEMA}"]
    return done + ([] if row[1] else [f"created table {PGMESH_SCHEMA}.links"])


async def _ensure_links(conn: Conn, config: Config, me: str) -> list[str]:
    others = [n for n in config.node_names if n != me]
    query = sql.SQL(
        "INSERT INTO {}.links (source) SELECT unnest(%s::text[])"
        " ON CONFLICT (source) DO NOTHING RETURNING source"
    ).format(sql.Identifier(PGMESH_SCHEMA))
    cur = await conn.execute(query, [others])
    added = sorted(r[0] for r in await cur.fetchall())
    return [f"added link rows for source {', '.join(added)}"] if added else []


def _table_list(tables: Iterable[TableName]) -> sql.Composed:
    return sql.SQL(", ").join(sql.Identifier(*t) for t in tables)


async def _publication_tables(conn: Conn, name: str) -> set[TableName]:
    cur = await conn.execute(
        "SELECT n.nspname, c.relname FROM pg_publication p"
        " JOIN pg_publication_rel r ON r.prpubid = p.oid JOIN pg_class c ON c.oid = r.prrelid"
        " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE p.pubname = %s",
        [name],
    )
    return {(s, t) for s, t in await cur.fetchall()}


async def _ensure_publication(conn: Conn, config: Config, tables: Sequence[TableName]) -> list[str]:
    name = config.publication_name
    pub = sql.Identifier(name)
    cur = await conn.execute("SELECT puballtables, pubviaroot FROM pg_publication WHERE pubname = %s", [name])
    row = await cur.fetchone()
    if row is None:
        target = sql.SQL(" FOR TABLE {}").format(_table_list(tables)) if tables else sql.SQL("")
        create = sql.SQL("CREATE PUBLICATION {}{} WITH (publish_via_partition_root = true)")
        await conn.execute(create.format(pub, target))
        return [f"created publication {name} for {len(tables)} tables"]
    if row[0]:
        raise PgmeshError(
            f"publication {name} exists FOR ALL TABLES; pgmesh did not create it",
            hint=f"drop it (DROP PUBLICATION {pub.as_string()}) and run init again",
        )
    done: list[str] = []
    if not row[1]:
        await conn.execute(
            sql.SQL("ALTER PUBLICATION {} SET (publish_via_partition_root = true)").format(pub)
        )
        done.append(f"set publish_via_partition_root on publication {name}")
    current = await _publication_tables(conn, name)
    if current != set(tables):
        verb, listed = ("SET", tables) if tables else ("DROP", sorted(current))
        query = sql.SQL("ALTER PUBLICATION {} {} TABLE {}").format(pub, sql.SQL(verb), _table_list(listed))
        await conn.execute(query)
        added, dropped = len(set(tables) - current), len(current - set(tables))
        done.append(f"publication {name}: added {added} tables, removed {dropped}")
    return done


async def _ensure_slot(conn: Conn, config: Config, node: str) -> list[str]:
    name = config.slot_name
    cur = await conn.execute(
        "SELECT plugin, database, current_database() FROM pg_replication_slots WHERE slot_name = %s", [name]
    )
    row = await cur.fetchone()
    if row is not None:
        if row[0] != "pgoutput" or row[1] != row[2]:
            raise SlotError(
                f"slot {name} exists for plugin {row[0]!r} in database {row[1]!r}",
                node=node,
                hint=f"drop it (SELECT pg_drop_replication_slot('{name}')) or rename the cluster",
            )
        return []
    await conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", [name])
    return [f"created logical slot {name} (pgoutput)"]


async def _ensure_origins(conn: Conn, config: Config, me: str) -> list[str]:
    wanted = [config.origin_name(n) for n in config.node_names if n != me]
    cur = await conn.execute("SELECT roname FROM pg_replication_origin WHERE roname = ANY(%s)", [wanted])
    have = {r[0] for r in await cur.fetchall()}
    missing = [o for o in wanted if o not in have]
    for origin in missing:
        await conn.execute("SELECT pg_replication_origin_create(%s)", [origin])
    return [f"created replication origins {', '.join(missing)}"] if missing else []


async def _install_node(config: Config, node: NodeConfig, tables: Sequence[TableName]) -> list[str]:
    try:
        async with await _connect(node) as conn:
            async with conn.transaction():
                await conn.execute("SET LOCAL pgmesh.ddl_local = on")  # pgmesh's own DDL is not replicated
                done = await _ensure_schema(conn)
                done += await _ensure_links(conn, config, node.name)
                done += await _ensure_publication(conn, config, tables)
                done += await install_conflict_catalog(conn, tables)
                done += await install_ddl_capture(conn, config, tables)
            # A logical slot cannot be created in a transaction that has written anything.
            done += await _ensure_slot(conn, config, node.name)
            done += await _ensure_origins(conn, config, node.name)
    except psycopg.Error as exc:
        raise PgmeshError(f"install failed: {describe(exc)}", node=node.name, sqlstate=exc.sqlstate) from None
    except PgmeshError as exc:
        if exc.node is None:
            exc = PgmeshError(exc.message, node=node.name, sqlstate=exc.sqlstate, hint=exc.hint)
        raise exc from None
    if done:
        return [f"node {node.name}: {line}" for line in done]
    others = len(config.nodes) - 1
    return [
        f"node {node.name}: already installed, nothing changed (schema {PGMESH_SCHEMA}, {others} links,"
        f" publication {config.publication_name} with {len(tables)} tables, slot {config.slot_name},"
        f" {others} origins, conflict history, tombstone triggers on {len(tables)} tables)"
    ]


async def install(config: Config, report: InitReport) -> list[str]:
    """Install pgmesh's objects on every node (idempotent); returns one line per thing done."""
    if not report.ok:
        raise ConfigError("refusing to install: the nodes are not ready\n" + report.render())
    results = await asyncio.gather(
        *(_install_node(config, node, report.tables) for node in config.nodes), return_exceptions=True
    )
    lines: list[str] = []
    failures: list[str] = []
    for result in results:
        if isinstance(result, Exception):
            failures.append(describe(result))
        elif isinstance(result, BaseException):
            raise result
        else:
            lines.extend(result)
    if failures:
        raise PgmeshError("install did not finish: " + "; ".join(failures))
    from router.sequences.ids import install_sequences  # node ids and snowflake functions, once all are in

    lines += await install_sequences(config)
    for line in lines:
        logger.info("%s", line)
    return lines


async def init_cluster(config: Config) -> tuple[InitReport, list[str]]:
    """Check every node, then install; raises ConfigError with the report when a check failed."""
    report = await check_cluster(config)
    return report, await install(config, report)


# ---------------------------------------------------------------------------------------------------------
# Uninstalling one node


async def _drop_slot(conn: Conn, config: Config, node: str) -> list[str]:
    name = config.slot_name
    cur = await conn.execute(
        "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s AND database = current_database()",
        [name],
    )
    row = await cur.fetchone()
    if row is None:
        return []
    if row[0] is not None:
        raise SlotError(
            f"slot {name} is in use by process {row[0]}; nothing was removed",
            node=node,
            hint="stop the router (or whatever streams from the slot) first",
        )
    await conn.execute("SELECT pg_drop_replication_slot(%s)", [name])
    return [f"dropped slot {name}"]


async def _drop_origins(conn: Conn, config: Config) -> list[str]:
    names = [config.origin_name(n) for n in config.node_names]
    names += [config.early_origin_name(n) for n in config.node_names]
    cur = await conn.execute("SELECT roname FROM pg_replication_origin WHERE roname = ANY(%s)", [names])
    found = sorted(r[0] for r in await cur.fetchall())
    for origin in found:
        await conn.execute("SELECT pg_replication_origin_drop(%s)", [origin])
    return [f"dropped replication origins {', '.join(found)}"] if found else []


async def _drop_publication_and_schema(conn: Conn, config: Config) -> list[str]:
    pub = config.publication_name
    cur = await conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = %s), to_regnamespace(%s) IS NOT NULL",
        [pub, PGMESH_SCHEMA],
    )
    row = await cur.fetchone()
    assert row is not None
    done: list[str] = []
    if row[0]:
        await conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(pub)))
        done.append(f"dropped publication {pub}")
    if row[1]:
        await conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(PGMESH_SCHEMA)))
        done.append(f"dropped schema {PGMESH_SCHEMA}")
    return done


async def uninstall(config: Config, node: str) -> list[str]:
    """Remove pgmesh's slot, origins, publication and schema from one node (idempotent).

    Refuses (SlotError, nothing removed) while something streams from the node's slot.
    """
    target = config.node(node)
    try:
        async with await _connect(target) as conn:
            done = await _drop_slot(conn, config, node)
            await conn.execute("SET pgmesh.ddl_local = on")  # removing pgmesh is not replicated
            for name in ("pgmesh_ddl_capture", "pgmesh_ddl_refuse", "pgmesh_ddl_dropped"):
                await conn.execute(sql.SQL("DROP EVENT TRIGGER IF EXISTS {}").format(sql.Identifier(name)))
            done += await _drop_origins(conn, config)
            done += await _drop_publication_and_schema(conn, config)
    except psycopg.Error as exc:
        raise PgmeshError(f"uninstall failed: {describe(exc)}", node=node, sqlstate=exc.sqlstate) from None
    lines = [f"node {node}: {line}" for line in done] or [f"node {node}: nothing of pgmesh left to remove"]
    for line in lines:
        logger.info("%s", line)
    return lines
