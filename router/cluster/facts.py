"""What a node tells `pgmesh init` about itself, read once: `NodeFacts` (settings, role, slots and WAL
senders in use, pgmesh's slot and publication if there, physical standbys, the clock, replication origins)
and `TableFacts` (each candidate table's columns, key and replica identity, its unique constraints and
indexes: `router.cluster.keys`). `router.cluster.checks` judges them with pure rules.
Also the admin session `pgmesh init` reads them over (`connect`), shared with `router.cluster.install`,
`router.cluster.grants` and `router.cluster.synchronous`, and `replicated_tables`.

Must not: write anything to a node (installing is `router.cluster.install`'s), judge what it read (that is
`router.cluster.checks`), or put a DSN or a password into a message.
Identifiers are always quoted with `psycopg.sql.Identifier`.
"""

from __future__ import annotations

from typing import Final

import msgspec
from psycopg import sql

from router.cluster.clocks import Sample, connection_query, measure
from router.cluster.keys import TableKeys, read_keys
from router.cluster.origins import origins_of_others
from router.cluster.standbys import StandbyFacts, read_standbys
from router.config.model import SYSTEM_SCHEMAS, Config, NodeConfig
from router.nodes.connect import Conn, Failure
from router.nodes.connect import connect as open_session

__all__ = [
    "APPLICATION_NAME",
    "CHECK_LOCK_WAIT_S",
    "NodeFacts",
    "TableFacts",
    "TableName",
    "connect",
    "read_node",
    "replicated_tables",
]

TableName = tuple[str, str]

CHECK_LOCK_WAIT_S: Final = 10  # the longest the checks wait for a lock on a table they read
APPLICATION_NAME: Final = "pgmesh init"
_SETTINGS: Final = (
    "server_version", "server_version_num", "wal_level", "track_commit_timestamp", "max_replication_slots",
    "max_active_replication_origins", "max_wal_senders", "output_plugin_libraries",
)

# Ordinary and partitioned tables outside the system schemas. Partitions are left out: a partitioned
# table stands for its partitions (the publication publishes via the partition root).
_TABLES_SQL: Final = """
SELECT n.nspname, c.relname, c.relpersistence::text, c.relreplident::text,
       EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary AND i.indimmediate),
       a.attname, format_type(a.atttypid, a.atttypmod)
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
  AND n.nspname <> ALL(%s) AND n.nspname NOT LIKE 'pg\\_%%'
ORDER BY n.nspname, c.relname, a.attnum
"""


class TableFacts(msgspec.Struct, frozen=True):
    persistence: str
    replident: str
    has_pk: bool
    columns: dict[str, str]
    keys: TableKeys = TableKeys()


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
    publication_all_tables: bool = False  # a publication of pgmesh's name exists FOR ALL TABLES
    standby: StandbyFacts = StandbyFacts()  # its physical standbys (router.cluster.standbys)
    clock: Sample | None = None  # the node's clock against this host's (router.cluster.clocks)
    origins_used: int = 0  # replication origins with progress here that are not pgmesh's


async def connect(node: NodeConfig) -> Conn:
    """An autocommit admin session; psycopg's errors go through (init's checks build their hint from
    them), a DSN that does not parse is reported without echoing it."""
    return await open_session(node, purpose=APPLICATION_NAME, admin=True, failure=Failure.AS_IS)


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
    keys = await read_keys(conn, sorted(SYSTEM_SCHEMAS))
    return {t: msgspec.structs.replace(f, keys=keys.get(t, TableKeys())) for t, f in found.items()}


async def replicated_tables(conn: Conn, config: Config) -> list[TableName]:
    """The tables of the connected node that `config` replicates, as sorted (schema, table) pairs."""
    return sorted(t for t in await _table_facts(conn) if config.replicates(*t))


async def read_node(conn: Conn, config: Config) -> NodeFacts:
    """What the node behind `conn` tells about itself and the tables `config` replicates. Waits at most
    CHECK_LOCK_WAIT_S for a lock (psycopg.errors.LockNotAvailable beyond)."""
    # reading keys takes ACCESS SHARE locks: a session holding a table exclusively must not make the
    # checks (init's, join's) wait on it without bound
    await conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(f"{CHECK_LOCK_WAIT_S}s")))
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
    cur = await conn.execute(
        "SELECT puballtables FROM pg_publication WHERE pubname = %s", [config.publication_name]
    )
    publication = await cur.fetchone()
    standby = await read_standbys(conn, config.slot_name)
    tables = {t: f for t, f in (await _table_facts(conn)).items() if config.replicates(*t)}
    clock = await measure(connection_query(conn))
    return NodeFacts(
        settings=settings,
        user=user,
        superuser=bool(superuser),
        slots_used=int(slots_used),
        origins_used=await origins_of_others(conn, config.pgmesh_origins()),
        own_slot=(own[0] or "", own[1], bool(own[2])) if own else None,
        publication_all_tables=bool(publication and publication[0]),
        standby=standby,
        database=database,
        walsenders=int(walsenders),
        tables=tables,
        clock=clock,
    )
