"""What conflict handling needs on every node: the history table, tombstones, their trigger, two guards.

Owns the DDL (its text in `sql/*.sql` beside this module, package data) and its idempotent
installation of:

- `pgmesh.conflict_history`: one row per conflict decided on this node (written by the applier);
- `pgmesh.quarantine`: changes this node refused, set aside under `on_refused = "quarantine"`, and the
  later changes of their keys (router.apply.quarantine); created, like every table here, when missing,
  so `pgmesh init` run again adds it to an installation from before it;
- `pgmesh.tombstones` `(table_name, key text[], xid xid8)`: the last deletion of each key, written by
  the `pgmesh.tombstone()` trigger or the recorder, so that "no row here" can be told apart from
  "deleted, at this version" (the deleting transaction's commit time and origin come from `xid`);
- the `pgmesh_tombstone` AFTER DELETE trigger on every replicated table, enabled REPLICA (it fires for
  the router's replicated deletes, under `session_replication_role = replica`; the node's own deletes are
  recorded by the router from its decoded stream, router.apply.recorder, off the application's write
  path) or, where the stream does not carry the tombstone key, ALWAYS (`trigger_fires`);
- `pgmesh.given_up` and the `pgmesh_given_up` trigger (BEFORE INSERT OR UPDATE OR DELETE, ALWAYS) on
  every replicated table with a unique key besides its tombstone key: the secondary unique values rows gave
  up, with the version that held them, and the appliers' claims on them checked (router.conflicts.given_up);
- `pgmesh.expect_origin(xid, oid)` and `pgmesh.expect_rows(bigint, bigint)`: guards the applier's
  statements call, raising SQLSTATE PGM01 / PGM02 when a row does not fit the change (a conflict).
  expect_origin also accepts a row written by the calling transaction itself (top level, not in a
  savepoint); it is PARALLEL RESTRICTED because finding that out is.

The tombstone key is the deleted row's key columns, each cast to text under fixed settings (TimeZone
UTC, DateStyle 'ISO, YMD', IntervalStyle postgres, extra_float_digits 3, bytea_output hex), as a text[]
in key order; the key columns are the primary key, else the replica identity index, else (REPLICA
IDENTITY FULL) every column in attnum order. A partition's deletes are recorded under the partition
root's name, as the publication (publish_via_partition_root) names them.

Must not: decide conflicts, prune tombstones, or touch user tables beyond the two triggers. Called by
`router.cluster.install.install` inside its transaction; identifiers are quoted with `psycopg.sql`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import Final, NamedTuple

from psycopg import sql

from router.config.model import PGMESH_SCHEMA
from router.errors import PgmeshError
from router.nodes.connect import Conn
from router.nodes.sqlfiles import statements

__all__ = [
    "TOMBSTONE_SETTINGS",
    "TRIGGER_NAME",
    "choose_key_columns",
    "install_conflict_catalog",
    "tombstone_keys",
    "trigger_fires",
]

logger = logging.getLogger(__name__)

TableName = tuple[str, str]

TRIGGER_NAME: Final = "pgmesh_tombstone"
# The settings the tombstone key's text is produced under: to compute the same key elsewhere (the
# applier), cast each value to text in a session with exactly these settings.
TOMBSTONE_SETTINGS: Final[Mapping[str, str]] = {
    "TimeZone": "UTC",
    "DateStyle": "ISO, YMD",
    "IntervalStyle": "postgres",
    "extra_float_digits": "3",
    "bytea_output": "hex",
}
_COMMENT_PREFIX: Final = "pgmesh ddl "

# The tables (created when missing) and functions (replaced when their text changed), each from
# sql/<name>.sql beside this module (package data).
_TABLES: Final[Sequence[tuple[str, Sequence[sql.SQL]]]] = tuple(
    (file.removesuffix(".sql"), tuple(sql.SQL(text) for text in statements(__name__, file)))
    for file in ("conflict_history.sql", "node_info.sql", "tombstones.sql", "tombstones_recorded.sql",
                 "table_tombstones.sql", "quarantine.sql", "given_up.sql")
)


class _Function(NamedTuple):
    name: str
    args: sql.SQL  # argument types, as to_regprocedure and COMMENT ON FUNCTION take them
    ddl: sql.SQL  # CREATE OR REPLACE FUNCTION ..., with {schema} for the schema


def _function(file: str, args: str) -> _Function:
    (ddl,) = statements(__name__, file)
    return _Function(file.removesuffix(".sql"), sql.SQL(args), sql.SQL(ddl))


_FUNCTIONS: Final = (
    _function("tombstone.sql", ""),
    _function("expect_origin.sql", "xid, oid"),
    _function("expect_rows.sql", "bigint, bigint"),
    _function("origin_node.sql", "oid"),
    _function("remote_wins.sql", "text, text[], timestamptz, text, timestamptz, text"),
    _function("remote_version.sql", ""),
    _function("decide.sql", "text, text, text, timestamptz, oid, text, text, text, text[]"),
    _function("truncated.sql", "xid, timestamptz, text"),
    _function("table_tombstone.sql", "text, xid8, timestamptz, text"),
    _function("truncate_by_version.sql", "text[], text[], boolean, boolean, timestamptz"),
    _function("truncate_sweep.sql", "text, text"),
)
# the given-up values' (router.conflicts.given_up), reported on a line of their own
_GIVEN_UP_FUNCTIONS: Final = (
    _function("given_up_ensure.sql", "oid, text[]"),
    _function("given_up_index.sql", "oid"),
)

# Per replicated table: its key columns by every rule, its columns, and the trigger pgmesh put there.
_KEYS_SQL: Final = """
SELECT n.nspname, c.relname, c.relreplident::text,
  ARRAY(SELECT a.attname::text FROM pg_index i
        CROSS JOIN unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
        WHERE i.indrelid = c.oid AND i.indisprimary ORDER BY k.ord),
  ARRAY(SELECT a.attname::text FROM pg_index i
        CROSS JOIN unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
        WHERE i.indrelid = c.oid AND i.indisreplident ORDER BY k.ord),
  ARRAY(SELECT a.attname::text FROM pg_attribute a  -- (generated ones follow the others: no key part)
        WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
        ORDER BY a.attnum),
  t.tgargs, t.tgenabled::text
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_trigger t ON t.tgrelid = c.oid AND t.tgname = %(trigger)s AND t.tgparentid = 0
WHERE (n.nspname, c.relname) IN (SELECT * FROM unnest(%(schemas)s::text[], %(names)s::text[]))
"""

# pgmesh's triggers on the node: (schema, table, key columns).
_TRIGGERS_SQL: Final = """
SELECT n.nspname, c.relname, t.tgargs
FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE t.tgname = %s AND t.tgparentid = 0 AND t.tgfoid = to_regprocedure(%s)
ORDER BY 1, 2
"""


def choose_key_columns(
    replident: str, primary: Sequence[str], identity: Sequence[str], columns: Sequence[str]
) -> tuple[str, ...] | None:
    """The columns tombstones key a table's rows by: its primary key, else its replica identity index,
    else (REPLICA IDENTITY FULL) every column in attnum order (`columns`: generated ones left out, the
    decoded stream does not carry them); None when the table has no usable key."""
    if primary:
        return tuple(primary)
    if replident == "i" and identity:
        return tuple(identity)
    if replident == "f" and columns:
        return tuple(columns)
    return None


def trigger_fires(
    replident: str, primary: Sequence[str], identity: Sequence[str], key: Sequence[str]
) -> str:
    """When the tombstone trigger fires: REPLICA (only for the router's replicated deletes) when the
    decoded stream carries `key` for every delete (REPLICA IDENTITY FULL, DEFAULT with a primary key, or
    a replica identity index holding the key): the router records the node's own deletes from it
    (router.apply.recorder). Else ALWAYS: the application's deletes pay the trigger. The same rule as
    ddl_table's in router/ddl/sql/capture.sql."""
    if replident == "f" or (replident == "d" and primary) or (replident == "i" and set(key) <= set(identity)):
        return "REPLICA"
    return "ALWAYS"


def _trigger_args(raw: bytes | None) -> tuple[str, ...] | None:
    """pg_trigger.tgargs (each argument ends with a NUL byte) -> the arguments."""
    if raw is None:
        return None
    return tuple(part.decode() for part in bytes(raw).split(b"\x00")[:-1])


def _fingerprint(ddl: str) -> str:
    return _COMMENT_PREFIX + hashlib.sha256(ddl.encode()).hexdigest()[:16]


def _name(table: TableName) -> str:
    return f"{table[0]}.{table[1]}"


async def _ensure_tables(conn: Conn) -> list[str]:
    done = []
    for name, ddl in _TABLES:
        cur = await conn.execute("SELECT to_regclass(%s) IS NOT NULL", [f"{PGMESH_SCHEMA}.{name}"])
        row = await cur.fetchone()
        if row is not None and row[0]:
            continue
        for statement in ddl:
            await conn.execute(statement.format(schema=sql.Identifier(PGMESH_SCHEMA)))
        done.append(f"created table {PGMESH_SCHEMA}.{name}")
    return done


async def _ensure_functions(conn: Conn, functions: Sequence[_Function] = _FUNCTIONS) -> list[str]:
    """Create each function, or replace it when its definition changed (a fingerprint in its comment)."""
    schema = sql.Identifier(PGMESH_SCHEMA)
    created: list[str] = []
    replaced: list[str] = []
    for function in functions:
        name = f"{PGMESH_SCHEMA}.{function.name}"
        signature = sql.SQL("{}.{}({})").format(schema, sql.Identifier(function.name), function.args)
        ddl = function.ddl.format(schema=schema)
        fingerprint = _fingerprint(ddl.as_string(conn))
        cur = await conn.execute(
            "SELECT to_regprocedure(%s) IS NOT NULL, obj_description(to_regprocedure(%s), 'pg_proc')",
            [signature.as_string(conn)] * 2,
        )
        row = await cur.fetchone()
        assert row is not None
        if row[0] and row[1] == fingerprint:
            continue
        await conn.execute(ddl)
        comment = sql.SQL("COMMENT ON FUNCTION {} IS {}").format(signature, sql.Literal(fingerprint))
        await conn.execute(comment)
        (replaced if row[0] else created).append(name)
    done = [f"created functions {', '.join(created)}"] if created else []
    return done + ([f"replaced functions {', '.join(replaced)} (new definition)"] if replaced else [])


def _create_trigger(table: TableName, key: Sequence[str]) -> sql.Composed:
    return sql.SQL(
        "CREATE TRIGGER {trigger} AFTER DELETE ON {table} FOR EACH ROW"
        " EXECUTE FUNCTION {schema}.tombstone({args})"
    ).format(
        trigger=sql.Identifier(TRIGGER_NAME),
        table=sql.Identifier(*table),
        schema=sql.Identifier(PGMESH_SCHEMA),
        args=sql.SQL(", ").join(sql.Literal(c) for c in key),
    )


async def _ensure_trigger(
    conn: Conn, table: TableName, key: tuple[str, ...], have: tuple[str, ...] | None, enabled: str | None,
    fires: str,
) -> str | None:
    """Create, re-create (other key columns) or re-enable (`fires`: REPLICA or ALWAYS) one table's
    trigger; what was done."""
    ident = sql.Identifier(*table)
    trigger = sql.Identifier(TRIGGER_NAME)
    what: str | None = None
    if have != key:
        if have is not None:
            await conn.execute(sql.SQL("DROP TRIGGER {} ON {}").format(trigger, ident))
            change = f"{', '.join(have)} -> {', '.join(key)}"
            what = f"re-created tombstone trigger on {_name(table)} (key {change})"
        else:
            what = f"created tombstone trigger on {_name(table)} (key {', '.join(key)})"
        await conn.execute(_create_trigger(table, key))
        enabled = None
    if enabled != fires[0]:
        enable = sql.SQL("ALTER TABLE {} ENABLE {} TRIGGER {}")
        await conn.execute(enable.format(ident, sql.SQL(fires), trigger))
        what = what or f"enabled tombstone trigger {fires} on {_name(table)}"
    return what


async def _ensure_triggers(conn: Conn, tables: Sequence[TableName]) -> list[str]:
    params = {
        "trigger": TRIGGER_NAME,
        "schemas": [t[0] for t in tables],
        "names": [t[1] for t in tables],
    }
    cur = await conn.execute(_KEYS_SQL, params)
    found = {(r[0], r[1]): r[2:] for r in await cur.fetchall()}
    done: list[str] = []
    for table in tables:
        if table not in found:
            raise PgmeshError("the table is missing here", relation=_name(table))
        replident, primary, identity, columns, tgargs, enabled = found[table]
        key = choose_key_columns(replident, primary, identity, columns)
        if key is None:
            ident = sql.Identifier(*table).as_string(conn)
            raise PgmeshError(
                "no primary key, replica identity index or REPLICA IDENTITY FULL: deletions cannot be keyed",
                relation=_name(table),
                hint=f"add a primary key, or ALTER TABLE {ident} REPLICA IDENTITY FULL",
            )
        fires = trigger_fires(replident, primary, identity, key)
        line = await _ensure_trigger(conn, table, key, _trigger_args(tgargs), enabled, fires)
        if line:
            logger.debug("%s", line)
            done.append(line)
        cur = await conn.execute(  # the given-up trigger, where the table has other unique keys
            sql.SQL("SELECT {}.given_up_ensure(%s::regclass::oid, %s)").format(sql.Identifier(PGMESH_SCHEMA)),
            [sql.Identifier(*table).as_string(conn), list(key)],
        )
        given = await cur.fetchone()
        if given is not None and given[0]:
            done.append(given[0])
    for table in sorted(set(await tombstone_keys(conn)) - set(tables)):
        await conn.execute(
            sql.SQL("DROP TRIGGER {} ON {}").format(sql.Identifier(TRIGGER_NAME), sql.Identifier(*table))
        )
        done.append(f"dropped tombstone trigger from {_name(table)} (no longer replicated)")
    return done


async def tombstone_keys(conn: Conn) -> dict[TableName, tuple[str, ...]]:
    """The tables carrying pgmesh's tombstone trigger on this node, with the key columns it records."""
    cur = await conn.execute(_TRIGGERS_SQL, [TRIGGER_NAME, f"{PGMESH_SCHEMA}.tombstone()"])
    return {(s, t): _trigger_args(args) or () for s, t, args in await cur.fetchall()}


async def install_conflict_catalog(conn: Conn, tables: Sequence[TableName]) -> list[str]:
    """History, tombstones, functions and one trigger per replicated table (idempotent): what changed.

    Runs inside the caller's transaction, after the `pgmesh` schema exists.
    """
    done = await _ensure_tables(conn)
    done += await _ensure_functions(conn)
    done += await _ensure_functions(conn, _GIVEN_UP_FUNCTIONS)
    done += await _ensure_triggers(conn, tables)
    return done
