"""What pgmesh installs on a node: install (idempotent) and uninstall.

Owns the objects pgmesh keeps on each node: the `pgmesh` schema with its `links` table, the
publication, the logical slot, one replication origin per other node, and (through
`router.conflicts.catalog`, `router.ddl.capture` and `router.sequences.ids`) the conflict history,
tombstones, their trigger, the applier's guards, the DDL capture, node ids and the snowflake
functions. `install` runs only on a report of `router.cluster.checks` that passed; `init_cluster` is
both. Installing is idempotent and all or nothing across the nodes: the catalog objects are staged on
every node in transactions committed together, then the slots are created, then node ids; a failure
anywhere removes exactly what this install created, on every node (never what was there before), so no
node is left half installed and no slot holds WAL for nothing. `uninstall` removes all of it from one
node.

Must not: check whether a node can take part (that is `router.cluster.checks`), stream or apply
changes, decide retry policy (that is `router.errors.decide`), create or alter user tables (beyond the
tombstone trigger), or ever put a DSN or a password into a message (psycopg errors go through
`describe`). Identifiers are always quoted with `psycopg.sql.Identifier`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Final

import psycopg
from psycopg import sql

from router.cluster.checks import InitReport, TableName, check_cluster, connect
from router.cluster.members import read_parted, without_parted
from router.cluster.partial import ensure_partial
from router.cluster.receive import ensure_receive_only
from router.config.model import PGMESH_SCHEMA, Config, NodeConfig
from router.conflicts.catalog import install_conflict_catalog
from router.ddl.capture import install_ddl_capture
from router.errors import ConfigError, PgmeshError, SlotError, describe
from router.nodes.connect import Conn
from router.nodes.sqlfiles import statements
from router.stream.slots import FAILOVER_SLOTS_SINCE

__all__ = ["init_cluster", "install", "script_node", "uninstall"]

logger = logging.getLogger(__name__)

# How long installing waits for a lock (a user table's, for its trigger) before it gives up, undone.
LOCK_TIMEOUT_S: Final = 10
# The session-level advisory lock every node's install connection holds on its database.
_INSTALL_LOCK: Final = 0x70676D657368  # "pgmesh"


# ---------------------------------------------------------------------------------------------------------
# Installing


_LINKS_DDL: Final = sql.SQL(
    "CREATE TABLE IF NOT EXISTS {}.links (source text PRIMARY KEY, paused boolean NOT NULL DEFAULT false,"
    " reason text, updated timestamptz NOT NULL DEFAULT now(), applied pg_lsn, skip_lsn pg_lsn)"
)
# `applied`: the applied mark (router.progress.applied), empty until an applier first connects on 16+ (it
# starts
# it from the origin there); an installation from before the mark gains the column, empty. `skip_lsn`: the
# transaction `pgmesh skip` leaves out (router.apply.skip), likewise.
_LINKS_MARK: Final = sql.SQL("ALTER TABLE {}.links ADD COLUMN IF NOT EXISTS applied pg_lsn,"
                             " ADD COLUMN IF NOT EXISTS skip_lsn pg_lsn")

_DDL_AS_OWNER: Final = tuple(sql.SQL(text) for text in statements(__name__, "ddl_as_owner.sql"))


async def _ensure_schema(conn: Conn) -> list[str]:
    cur = await conn.execute(
        "SELECT to_regnamespace(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL",
        [PGMESH_SCHEMA, f"{PGMESH_SCHEMA}.links"],
    )
    row = await cur.fetchone()
    assert row is not None
    schema = sql.Identifier(PGMESH_SCHEMA)
    await conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(schema))
    # every role may reach its functions (the triggers and defaults the application's own statements call:
    # DDL capture, tombstones, snowflake ids); its tables keep their own privileges (docs/security.md)
    await conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO PUBLIC").format(schema))
    await conn.execute(_LINKS_DDL.format(schema))
    await conn.execute(_LINKS_MARK.format(schema))
    for statement in _DDL_AS_OWNER:  # superusers' DDL replayed by a router without superuser (its file)
        await conn.execute(statement.format(schema=schema))
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


async def _ensure_slot(conn: Conn, config: Config, node: str, fresh: bool = False) -> list[str]:
    """pgmesh's slot on the node; `fresh`: this install created pgmesh's schema there, so a slot of that
    name is an earlier installation's, whose position is stale (the router would send on what it kept)."""
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
        if fresh:
            raise SlotError(
                f"slot {name} is left from an earlier installation (pgmesh's schema was not there): its"
                " position is stale, and the router would send on every change it kept since then",
                node=node,
                hint=f"drop it on node {node} (SELECT pg_drop_replication_slot('{name}')) and run init again",
            )
        return []
    if conn.info.server_version >= FAILOVER_SLOTS_SINCE:  # follows a failover to a physical standby
        create = "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', failover => true)"
        await conn.execute(create, [name])
        return [f"created logical slot {name} (pgoutput, failover: docs/failover.md)"]
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


class _Created:
    """What this install created on one node, so that a failure anywhere can remove exactly that again.

    Objects that were there before (an earlier init, another tool's slot) are never recorded, so never
    removed: undoing a second init leaves the first one's installation as it was."""

    __slots__ = ("before", "committed", "event_triggers", "identities", "origins", "publication", "schema",
                 "slot")

    def __init__(self) -> None:
        self.committed = False  # the catalog transaction committed (else rolling back undid it)
        self.schema = False
        self.publication = False
        self.event_triggers: list[str] = []
        self.origins: list[str] = []
        self.slot = False
        self.identities: list[int] = []  # tables (oids) made REPLICA IDENTITY FULL
        self.before: list[tuple[str, str]] = []  # pgmesh's objects there already: (what, how to remove it)

    @property
    def anything(self) -> bool:
        return self.slot or (self.committed and bool(
            self.schema or self.publication or self.event_triggers or self.origins
        ))


async def _pgmesh_objects(conn: Conn, config: Config) -> tuple[bool, bool, set[str], set[str]]:
    """(schema, publication, event triggers, origins) of pgmesh's on the node right now."""
    cur = await conn.execute(
        "SELECT to_regnamespace(%s) IS NOT NULL,"
        " EXISTS (SELECT 1 FROM pg_publication WHERE pubname = %s),"
        " ARRAY(SELECT evtname FROM pg_event_trigger WHERE evtname LIKE 'pgmesh\\_%%'),"
        " ARRAY(SELECT roname FROM pg_replication_origin WHERE roname LIKE %s)",
        [PGMESH_SCHEMA, config.publication_name, f"{config.slot_name}\\_%"],
    )
    row = await cur.fetchone()
    assert row is not None
    return bool(row[0]), bool(row[1]), set(row[2]), set(row[3])


_WITHOUT_KEY: Final = """
SELECT c.oid::int8, n.nspname, c.relname
FROM unnest(%s::text[]) t
CROSS JOIN LATERAL (SELECT pg_catalog.to_regclass(t) AS relid  -- a plain table has no partition tree
                    UNION SELECT relid FROM pg_catalog.pg_partition_tree(pg_catalog.to_regclass(t))) p
JOIN pg_catalog.pg_class c ON c.oid = p.relid
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p') AND c.relreplident <> 'f' AND (
  %s AND c.relreplident = 'd' AND NOT EXISTS (
    SELECT 1 FROM pg_catalog.pg_index i WHERE i.indrelid = c.oid AND i.indisprimary AND i.indimmediate)
  OR EXISTS (  -- a partition of a root made FULL: its changes would come with its key only
    SELECT 1 FROM pg_catalog.pg_class r WHERE r.oid = pg_catalog.pg_partition_root(c.oid) AND r.oid <> c.oid
       AND r.relreplident = 'f'))
"""


async def _ensure_identities(
    conn: Conn, config: Config, tables: Sequence[TableName], created: _Created
) -> list[str]:
    """Under `new_table_without_key = "full"`, a replicated table without a usable replica identity (no
    primary key, or a deferrable one) is made REPLICA IDENTITY FULL here, partitions included; whatever
    the setting, so is a partition of a root made FULL (pgoutput sends a partition's changes with the
    partition's identity: a key-only old row under a root matched by whole rows stopped the link), as
    the DDL capture does with one created later (`ddl_identity`); the caller lists them in
    `pgmesh.auto_identity`, so that a primary key added later makes them DEFAULT again."""
    if not tables:
        return []
    names = [sql.Identifier(*table).as_string(conn) for table in tables]
    keyless = config.replication.new_table_without_key == "full"
    found = await (await conn.execute(_WITHOUT_KEY, [names, keyless])).fetchall()
    for _oid, schema_name, table in found:
        identity = "ALTER TABLE {} REPLICA IDENTITY FULL"
        await conn.execute(sql.SQL(identity).format(sql.Identifier(schema_name, table)))
    created.identities = sorted(oid for oid, _schema, _table in found)
    if not found:
        return []
    return [f"made {len(found)} tables without a key (or under a FULL root) REPLICA IDENTITY FULL"]


async def _stage_node(
    conn: Conn, config: Config, node: str, tables: Sequence[TableName], created: _Created
) -> list[str]:
    """Everything but the slot, in one transaction left open: the caller commits it on every node once
    every node got this far, or rolls it back everywhere."""
    await conn.execute("BEGIN")
    await conn.execute("SET LOCAL pgmesh.ddl_local = on")  # pgmesh's own DDL is not replicated
    # A trigger added to a user table waits for that table's writers, and its writers then queue behind
    # it: a session that holds the table long fails the install (nothing is left) instead.
    await conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(f"{LOCK_TIMEOUT_S}s")))
    schema, publication, triggers, origins = await _pgmesh_objects(conn, config)
    created.before = _found_before(config, schema, publication, triggers, origins)
    done = await _ensure_schema(conn)
    done += await _ensure_links(conn, config, node)
    done += await _ensure_publication(conn, config, tables)
    done += await _ensure_identities(conn, config, tables, created)  # before the tombstone triggers' key
    done += await install_conflict_catalog(conn, tables)
    done += await install_ddl_capture(conn, config, tables)
    done += await ensure_receive_only(conn, config, node, tables)  # (router.cluster.receive)
    done += await ensure_partial(conn, config, node, tables)  # (router.cluster.partial)
    if created.identities:  # listed as pgmesh's doing: a primary key added later makes them DEFAULT again
        listed = "INSERT INTO {}.auto_identity SELECT unnest(%s::oid[]) ON CONFLICT DO NOTHING"
        await conn.execute(sql.SQL(listed).format(sql.Identifier(PGMESH_SCHEMA)), [created.identities])
    done += await _ensure_origins(conn, config, node)  # origins are transactional: they commit with the rest
    now = await _pgmesh_objects(conn, config)
    created.schema, created.publication = now[0] and not schema, now[1] and not publication
    created.event_triggers, created.origins = sorted(now[2] - triggers), sorted(now[3] - origins)
    return done


async def script_node(conn: Conn, config: Config, node: str, tables: Sequence[TableName]) -> None:
    """Install's steps on one node on a recording connection (`router.cluster.script`, `pgmesh init
    --print-sql`): the staged transaction, committed in the script (rolled back here), then the slot."""
    await _stage_node(conn, config, node, tables, _Created())
    await conn.execute("COMMIT")  # recorded for the script
    await conn.execute("ROLLBACK")  # what the reads' transaction did, here
    await _ensure_slot(conn, config, node)


def _failed(node: str, exc: BaseException) -> PgmeshError:
    if isinstance(exc, PgmeshError):
        return exc.at(node=node)
    sqlstate = exc.sqlstate if isinstance(exc, psycopg.Error) else None
    hint = None
    if isinstance(exc, psycopg.errors.LockNotAvailable):
        hint = (f"a session held a table pgmesh adds its trigger to for more than {LOCK_TIMEOUT_S} s"
                " (see pg_locks); run init again once it is done")
    return PgmeshError(describe(exc), node=node, hint=hint) if sqlstate else PgmeshError(
        f"install failed: {describe(exc)}", node=node, hint=hint
    )


async def _each(
    conns: Mapping[str, Conn], step: Callable[[str, Conn], Awaitable[list[str]]]
) -> dict[str, list[str]]:
    """`step` on every node at once; the first node's failure (in config order) is raised, the other
    nodes having finished (or failed) theirs."""
    names = list(conns)
    results = await asyncio.gather(*(step(n, conns[n]) for n in names), return_exceptions=True)
    for name, result in zip(names, results, strict=True):
        if isinstance(result, BaseException):
            raise _failed(name, result) from None
    return {n: r for n, r in zip(names, results, strict=True) if not isinstance(r, BaseException)}


async def _install_nodes(
    config: Config, tables: Sequence[TableName], conns: Mapping[str, Conn], created: Mapping[str, _Created]
) -> list[str]:
    """Stage every node, commit them all, then create the slots (a logical slot cannot be created in a
    transaction that wrote, and must not predate the publication its changes are decoded with)."""
    staged = await _each(conns, lambda n, c: _stage_node(c, config, n, tables, created[n]))
    for name, conn in conns.items():
        try:
            await conn.execute("COMMIT")
        except psycopg.Error as exc:
            raise _failed(name, exc) from None
        created[name].committed = True

    async def slot(name: str, conn: Conn) -> list[str]:
        done = await _ensure_slot(conn, config, name, fresh=created[name].schema)
        created[name].slot = bool(done)
        return done

    slots = await _each(conns, slot)
    lines: list[str] = []
    for name in conns:
        done = staged[name] + slots[name]
        lines += [f"node {name}: {line}" for line in done] or [_unchanged(config, name, tables)]
    return lines


def _unchanged(config: Config, node: str, tables: Sequence[TableName]) -> str:
    others = len(config.nodes) - 1
    return (
        f"node {node}: already installed, nothing changed (schema {PGMESH_SCHEMA}, {others} links,"
        f" publication {config.publication_name} with {len(tables)} tables, slot {config.slot_name},"
        f" {others} origins, conflict history, tombstone triggers on {len(tables)} tables)"
    )


async def _connect_all(config: Config) -> dict[str, Conn]:
    """A connection to every node, each holding pgmesh's install lock on its database (until it closes),
    or none at all: the nodes that refused are named together. The lock keeps two inits apart, and two
    nodes of one config that are the same database (whose staged transactions would wait on each other
    for ever) from being installed at all."""
    results = await asyncio.gather(*(connect(n) for n in config.nodes), return_exceptions=True)
    pairs = list(zip(config.node_names, results, strict=True))
    conns = {name: r for name, r in pairs if isinstance(r, psycopg.AsyncConnection)}
    failed = [(name, r) for name, r in pairs if isinstance(r, BaseException)]
    try:
        if failed:
            why = "; ".join(f"node {name}: {describe(exc)}" for name, exc in failed)
            raise PgmeshError(
                f"install not started, nothing was changed on any node: cannot connect ({why})",
                hint="make every node reachable with the dsn of the config, then run init again",
            )
        for name, conn in conns.items():  # in config order: the later of two alike dsns is named
            cur = await conn.execute("SELECT pg_try_advisory_lock(%s)", [_INSTALL_LOCK])
            row = await cur.fetchone()
            if not (row and row[0]):
                raise PgmeshError(
                    "install not started, nothing was changed on any node: another session holds pgmesh's"
                    " install lock on this node's database",
                    node=name,
                    hint="two nodes of the config are the same database (check their dsn), or another"
                    " `pgmesh init` or `pgmesh join` is running: let it finish, then run init again",
                )
    except BaseException:
        for conn in conns.values():
            await conn.close()
        raise
    return conns


async def _undo_node(config: Config, node: NodeConfig, created: _Created) -> list[str]:
    """Remove what this install created on one node, in a new session (the old one may be broken)."""
    done: list[str] = []
    async with await connect(node) as conn:
        if created.slot:
            await conn.execute("SELECT pg_drop_replication_slot(%s)", [config.slot_name])
            done.append(f"dropped slot {config.slot_name}")
        if not created.committed:
            return done
        async with conn.transaction():
            await conn.execute("SET LOCAL pgmesh.ddl_local = on")
            for trigger in created.event_triggers:
                await conn.execute(sql.SQL("DROP EVENT TRIGGER IF EXISTS {}").format(sql.Identifier(trigger)))
            for origin in created.origins:
                await conn.execute("SELECT pg_replication_origin_drop(%s)", [origin])
            if created.publication:
                pub = sql.Identifier(config.publication_name)
                await conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(pub))
            for oid in created.identities:  # back to what it was: DEFAULT (a table with no usable key)
                found = await conn.execute(
                    "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n"
                    " ON n.oid = c.relnamespace WHERE c.oid = %s AND c.relreplident = 'f'", [oid])
                for schema_name, table in await found.fetchall():
                    identity = "ALTER TABLE {} REPLICA IDENTITY DEFAULT"
                    await conn.execute(sql.SQL(identity).format(sql.Identifier(schema_name, table)))
            if created.schema:  # with it go the tombstone and TRUNCATE triggers on the user tables
                await conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(PGMESH_SCHEMA))
                )
        done += [f"dropped {what}" for what, made in (
            (f"event triggers {', '.join(created.event_triggers)}", created.event_triggers),
            (f"replication origins {', '.join(created.origins)}", created.origins),
            (f"publication {config.publication_name}", created.publication),
            (f"schema {PGMESH_SCHEMA}", created.schema),
            (f"REPLICA IDENTITY FULL of {len(created.identities)} tables", created.identities),
        ) if made]
    return done


def _found_before(
    config: Config, schema: bool, publication: bool, triggers: set[str], origins: set[str]
) -> list[tuple[str, str]]:
    """pgmesh's objects a node held before this install (an earlier init, maybe of another cluster or
    pgmesh version), each with the statement that removes it (the schema's takes its event triggers)."""
    found: list[tuple[str, str]] = []
    if schema:
        drop = f"DROP SCHEMA {sql.Identifier(PGMESH_SCHEMA).as_string()} CASCADE"
        found.append((f"schema {PGMESH_SCHEMA}", drop))
    else:
        found += [(f"event trigger {t}", f"DROP EVENT TRIGGER {sql.Identifier(t).as_string()}")
                  for t in sorted(triggers)]
    if publication:
        name = config.publication_name
        found.append((f"publication {name}", f"DROP PUBLICATION {sql.Identifier(name).as_string()}"))
    found += [(f"replication origin {o}", f"SELECT pg_replication_origin_drop('{o}')")
              for o in sorted(origins)]
    return found


def _stale_hint(created: Mapping[str, _Created], cause: PgmeshError) -> str | None:
    """When the failed node held pgmesh's objects before: name them, and how to remove them."""
    node = cause.node or ""
    before = created[node].before if node in created else []
    if not before:
        return None
    what, how = ", ".join(w for w, _ in before), "; ".join(s for _, s in before)
    return (f"node {node} held pgmesh objects before this init ({what}), perhaps left by an earlier cluster"
            " or pgmesh version, which this install could not bring up to date; if nothing uses them, remove"
            f" them on node {node} ({how}; or `pgmesh part {node} --clean` with that cluster's config) and"
            " run init again")


async def _undo(config: Config, created: Mapping[str, _Created], cause: PgmeshError) -> PgmeshError:
    """Remove what this install created on every node; the error to raise says what is left, if any."""
    undone: list[str] = []
    left: list[str] = []
    for node in config.nodes:
        if node.name not in created or not created[node.name].anything:
            continue
        try:
            lines = await _undo_node(config, node, created[node.name])
        except (psycopg.Error, OSError, PgmeshError) as exc:
            left.append(f"node {node.name} ({describe(exc)})")
            continue
        undone.append(node.name)
        for line in lines:
            logger.info("node %s: install undone: %s", node.name, line)
    what = f" (what it had created on node {', '.join(undone)} was removed)" if undone else ""
    bare = cause.at()  # a copy: its hint goes to the end of the whole message, once
    bare.hint = None
    if not left:
        return PgmeshError(
            f"install failed, nothing of it is left on any node{what}: {bare}",
            hint=cause.hint or _stale_hint(created, cause) or "fix the cause, then run init again",
        )
    return PgmeshError(
        f"install failed{what}, but what it created is left on {', '.join(left)}: {bare}",
        hint=f"fix the cause and run init again; or remove them there (pgmesh part NODE --clean)"
        f" and the slot {config.slot_name} with it",
    )


async def install(config: Config, report: InitReport) -> list[str]:
    """Install pgmesh's objects on every node (idempotent); returns one line per thing done.

    All or nothing: a failure on any node (a refused connection, a statement the node rejects, a slot
    that cannot be created) leaves every node as it was before, pgmesh's earlier objects included; the
    error names the node and what failed.
    """
    if not report.ok:
        raise ConfigError("refusing to install: the nodes are not ready\n" + report.render())
    conns = await _connect_all(config)
    for name, conn in conns.items():  # an init again with synchronous > 0: no router may answer now
        if config.synchronous(name):
            await conn.execute("SET synchronous_commit = local")
    created = {name: _Created() for name in conns}
    try:
        try:
            lines = await _install_nodes(config, report.tables, conns, created)
        finally:
            for conn in conns.values():
                await conn.close()  # a transaction still open (another node failed) is rolled back
        from router.sequences.ids import install_sequences  # node ids and snowflake functions

        lines += await install_sequences(config)
    except (PgmeshError, psycopg.Error, OSError) as exc:
        cause = exc if isinstance(exc, PgmeshError) else PgmeshError(f"install failed: {describe(exc)}")
        raise await _undo(config, created, cause) from None
    except BaseException:  # cancelled: still remove what was created, then go
        await asyncio.shield(_undo(config, created, PgmeshError("install was interrupted")))
        raise
    for line in lines:
        logger.info("%s", line)
    return lines


async def init_cluster(config: Config) -> tuple[InitReport, list[str]]:
    """Check every node, then install; raises ConfigError with the report when a check failed. Nodes
    recorded as parted (router.ops.part) are left out: `pgmesh join` brings one back."""

    parted = sorted(await read_parted(config))
    config = without_parted(config, parted)
    report = await check_cluster(config)
    left = [f"node {n}: parted, left out (`pgmesh join {n}` brings it back)" for n in parted]
    from router.cluster.synchronous import standby_names  # (docs/synchronous.md)

    down = await standby_names(config, waiting=False) if report.ok else []  # first: nothing then waits
    done = await install(config, report)
    return report, left + down + done + await standby_names(config, waiting=True)  # last


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
        async with await connect(target) as conn:
            done = await _drop_slot(conn, config, node)
            await conn.execute("SET pgmesh.ddl_local = on")  # removing pgmesh is not replicated
            for name in ("pgmesh_ddl_capture", "pgmesh_ddl_refuse", "pgmesh_ddl_dropped"):
                await conn.execute(sql.SQL("DROP EVENT TRIGGER IF EXISTS {}").format(sql.Identifier(name)))
            done += await _drop_origins(conn, config)
            schema = await (await conn.execute("SELECT to_regnamespace(%s)", [PGMESH_SCHEMA])).fetchone()
            if schema is not None and schema[0] is not None:
                from router.sequences.convert import to_local  # (it reads what install puts in place)

                done += await to_local(conn, config)  # before the snowflake function goes with the schema
            done += await _drop_publication_and_schema(conn, config)
    except psycopg.Error as exc:
        raise PgmeshError(f"uninstall failed: {describe(exc)}", node=node, sqlstate=exc.sqlstate) from None
    lines = [f"node {node}: {line}" for line in done] or [f"node {node}: nothing of pgmesh left to remove"]
    for line in lines:
        logger.info("%s", line)
    return lines
