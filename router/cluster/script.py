"""`pgmesh init --print-sql [--node N]`: the SQL `pgmesh init` would run on each node (or on node N only),
as a script a DBA runs (as a superuser, or a managed service's administrator role) where pgmesh may not
install itself, followed by the GRANTs for the role that runs the router (`router.cluster.grants`).

Owns recording: each node's install steps of `router.cluster.install` run on a `_Recorder`, a connection
that runs what only reads (the catalog, for what is already there) and records, without running it,
everything that would change the node; a read of an object the script would create answers no rows. The
node ids and snowflake functions of `router.sequences.ids` are written from its SQL files and its id plan.

Must not: change anything on a node (every statement that writes is recorded, never run; the reads run
in a transaction that is rolled back), or print a DSN or a password (a node is named, with its database).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final, LiteralString, cast

import psycopg
from psycopg import sql
from psycopg.abc import Params, Query

from router.cluster.checks import TableName, replicated_tables
from router.cluster.grants import OWNERS_SQL, grant_statements, run_role_of
from router.config.model import PGMESH_SCHEMA, Config, NodeConfig
from router.errors import PgmeshError, describe
from router.nodes.connect import CONNECT_TIMEOUT_S
from router.nodes.sqlfiles import statements
from router.sequences.ids import EPOCH_MS, NODE_ID_KEY, plan_node_ids, read_node_id

__all__ = ["print_sql"]

# What changes a node: a statement starting so, or a SELECT of one of these functions.
_WRITES: Final = re.compile(
    r"^\s*(CREATE|ALTER|DROP|COMMENT|INSERT|UPDATE|DELETE|GRANT|REVOKE|TRUNCATE|DO|SET|BEGIN|COMMIT)\b", re.I
)
_WRITING_FUNCTIONS: Final = re.compile(
    r"pg_replication_origin_(create|drop|advance)|pg_(create|drop)_logical_replication_slot", re.I
)
_RUN_TOO: Final = re.compile(r"^\s*(SET|BEGIN)\b", re.I)  # recorded, and run: they shape the reads
_READABLE_NODE_INFO: Final = (
    "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class c"
    " JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
    " WHERE n.nspname = %s AND c.relname = 'node_info' AND pg_catalog.has_schema_privilege(n.oid, 'USAGE')"
    " AND pg_catalog.has_table_privilege(c.oid, 'SELECT'))"
)
# router.sequences.ids's functions, from that package's sql/ (named without the suffix: not files of this one)
_SNOWFLAKE_FUNCTIONS: Final = ("node_id", "snowflake_nextval", "snowflake_parts")


class _Recorder(psycopg.AsyncConnection[Any]):
    """A connection whose writes are recorded as text instead of run; reads run, each in a savepoint."""

    recorded: list[str]
    _savepoints: int

    async def execute(
        self, query: Query, params: Params | None = None, *, prepare: bool | None = None, binary: bool = False
    ) -> psycopg.AsyncCursor[Any]:
        text = psycopg.AsyncClientCursor(self).mogrify(query, params)
        nothing: LiteralString = "SELECT WHERE false"
        if _WRITES.match(text) or _WRITING_FUNCTIONS.search(text):
            self.recorded.append(text.strip().rstrip(";") + ";")
            if not _RUN_TOO.match(text):
                return await super().execute(nothing)
        if self.info.transaction_status != psycopg.pq.TransactionStatus.INTRANS:
            return await super().execute(cast(Any, query), params, prepare=prepare, binary=binary)
        self._savepoints += 1
        point = sql.Identifier(f"r{self._savepoints}")
        await super().execute(sql.SQL("SAVEPOINT {}").format(point))
        try:
            return await super().execute(cast(Any, query), params, prepare=prepare, binary=binary)
        except psycopg.Error:  # an object the script creates first: no rows
            await super().execute(sql.SQL("ROLLBACK TO SAVEPOINT {}").format(point))
            return await super().execute(nothing)


async def _recorder(node: NodeConfig) -> _Recorder:
    try:
        conn = await _Recorder.connect(node.dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
                                       application_name="pgmesh init --print-sql")
    except psycopg.ProgrammingError:
        raise PgmeshError("the dsn is not a valid libpq connection string", node=node.name) from None
    except (psycopg.Error, OSError) as exc:
        raise PgmeshError(f"cannot connect: {describe(exc)}", node=node.name) from None
    conn.recorded, conn._savepoints = [], 0
    return conn


def _snowflake(node_id: int) -> list[str]:
    schema = sql.Identifier(PGMESH_SCHEMA)
    out = [
        "BEGIN;", "SET LOCAL pgmesh.ddl_local = 'on';",
        sql.SQL("INSERT INTO {}.node_info (key, value) VALUES ({}, {}) ON CONFLICT (key) DO NOTHING;").format(
            schema, sql.Literal(NODE_ID_KEY), sql.Literal(str(node_id))).as_string(None),
    ]
    for function in _SNOWFLAKE_FUNCTIONS:
        (ddl,) = statements("router.sequences.ids", f"{function}.sql")
        out.append(sql.SQL(ddl).format(
            schema=schema, epoch=sql.Literal(EPOCH_MS)).as_string(None) + ";")
    return [*out, "COMMIT;"]


async def _node_script(config: Config, node: NodeConfig, node_id: int, role: str) -> tuple[str, list[str]]:
    """(database, statements) of one node: install's, then the node id, then the run role's GRANTs."""
    from router.cluster.install import script_node  # (install imports checks, as this module does)

    conn = await _recorder(node)
    try:
        tables: Sequence[TableName] = await replicated_tables(conn, config)
        database = conn.info.dbname
        await script_node(conn, config, node.name, tables)
        lines = [*conn.recorded, *_snowflake(node_id)]
        role = role or run_role_of(node)
        cur = await conn.execute(OWNERS_SQL, [[t[0] for t in tables], [t[1] for t in tables]])
        owners = [str(r[0]) for r in await cur.fetchall()]
        grants = grant_statements(role, database, tables, conn.info.server_version, owners)
    except psycopg.Error as exc:
        raise PgmeshError(f"reading the node failed: {describe(exc)}", node=node.name) from None
    finally:
        await conn.close()  # what the reads' transaction did is rolled back
    return database, [*lines, f"-- the role the config connects as ({role}) runs `pgmesh run`", *grants]


async def print_sql(config: Config, role: str = "", node: str = "") -> str:
    """The script of every node (or of `node` alone): what `pgmesh init` would install there, and the
    GRANTs for the run role (`role`, else the role each node's DSN connects as). Connects as the config's
    role, which must be able to read pgmesh's schema where it is installed (the DBA's, or the run role
    once granted). Node ids are planned over every node, so the scripts printed one node at a time
    agree."""
    if node and node not in config.node_names:
        raise PgmeshError(f"no node {node} in the config (its nodes: {', '.join(config.node_names)})",
                          hint="name a node of the config's [[nodes]]")
    existing: dict[str, int | None] = {}
    for member in config.nodes:
        conn = await _recorder(member)
        try:
            cur = await conn.execute(_READABLE_NODE_INFO, [PGMESH_SCHEMA])
            readable = (await cur.fetchone() or (False,))[0]
            existing[member.name] = await read_node_id(conn, member.name) if readable else None
        finally:
            await conn.close()
    ids = plan_node_ids(config.node_names, existing)
    if node:
        out = [f"-- pgmesh init --print-sql --node {node}: cluster {config.cluster.name}, node {node} of"
               f" {len(config.nodes)}.",
               "-- Run it as a superuser (or the service's administrator role) connected to this node's",
               "-- database (psql -v ON_ERROR_STOP=1 -f); the other nodes' scripts likewise, then",
               "-- `pgmesh init --check` as the run role."]
    else:
        out = [f"-- pgmesh init --print-sql: cluster {config.cluster.name}, {len(config.nodes)} nodes.",
               "-- Run each node's part as a superuser (or the service's administrator role) connected to",
               "-- that node's database (psql -v ON_ERROR_STOP=1 -f); then `pgmesh init --check` as the run",
               "-- role."]
    for each in config.nodes:
        if node and each.name != node:
            continue
        database, lines = await _node_script(config, each, ids[each.name], role)
        out += ["", f"-- node {each.name} (database {database})", *lines]
    return "\n".join(out) + "\n"
