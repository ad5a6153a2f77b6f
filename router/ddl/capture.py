"""DDL replication, the capturing side: what pgmesh installs on every node (`install_ddl_capture`).

PostgreSQL 15's logical decoding carries no DDL, so pgmesh installs on every node (the functions in
`sql/capture.sql`, the tables in `sql/columns.sql`, beside this module, package data):

- an event trigger on `ddl_command_end` (`pgmesh.ddl_capture`, enabled ALWAYS) that writes the command's
  text, search_path, role and tag into the same transaction as a transactional logical message with
  prefix `pgmesh.ddl` (`pg_logical_emit_message(true, ...)`; the format is `router.ddl.messages`), so it
  is decoded at its exact place in the source's commit order; the applier runs it there
  (`router.apply.applier`), before the DML that follows it.
  Commands the router itself applies run under a replication origin and are not captured again; neither
  is DDL run with `SET pgmesh.ddl_local = on` (per-node DDL, e.g. `pgmesh sequences`), on temporary
  objects, in the `pgmesh` schema or by an extension script;
- for every table a command creates or alters in the replicated set (`[replication] tables/exclude`),
  on every node (also when the router applies it): the table joins the publication and gets the
  tombstone trigger (`router.conflicts.catalog`), keyed by its primary key, else its replica identity
  index, else every column. One without a usable replica identity (no key, its key dropped, or a
  deferrable one) is made REPLICA IDENTITY FULL, partitions included (`new_table_without_key = "full"`,
  the default; recorded in `pgmesh.auto_identity`, and undone when a primary key arrives), left local
  with a warning (`"warn"`, a new table) or refused (`"refuse"`); a table attached as a partition of a
  replicated root first leaves the publication and drops its own tombstone trigger (`ddl_attaching`);
- `pgmesh.known_columns` / `pgmesh.column_changes`: what each table's columns were called, so that a
  column renamed or dropped by DDL is recognised when rows sent before the change arrive later from
  another node (`router.ddl.reconcile` maps them); an unexplained missing column still pauses the link;
- on every partition of a replicated partitioned table, the statement trigger `pgmesh_truncate`, and
  on the root `pgmesh_truncate_start` / `_end` (`truncate_capture`): the publication publishes via the
  root, so pgoutput never sends a TRUNCATE of one partition; the trigger writes it as a command message
  (`truncate_partition`: `TRUNCATE ONLY ... CASCADE` of that partition, or, on a node that partitions
  the root otherwise, a DELETE of the rows within its bounds; tag TRUNCATE), replayed like DDL; a
  TRUNCATE of the root itself travels as pgoutput's Truncate alone;
- an event trigger on `ddl_command_start` refusing, at the node where they are issued, commands that
  cannot be replayed inside a transaction (CREATE / DROP INDEX CONCURRENTLY, DETACH PARTITION
  CONCURRENTLY), query strings that mix DDL with transaction control (`ddl_split`, in
  `sql/statements.sql`, splits a query string into its top-level statements as the server does: a
  function body, a string or a comment is not a statement), and ALTER COLUMN TYPE ... USING a
  non-immutable expression;
- at `ddl_command_end`, where the command is typed, refusals of what would leave nodes apart: a query
  string whose other statements write replicated rows (the capture records the whole string, so the
  other nodes would write them a second time: `ddl_refuse_writes`; a DO block's body is looked into),
  an ADD COLUMN whose values each node would compute itself for the rows it holds (identity, serial, a
  default that is not immutable: `ddl_filled`), enum labels added outside `pgmesh ddl` (two nodes adding
  at once would sort them differently: `ddl_enum_grew`); and, on every node, a partition detached from
  its root joins the publication when it matches `tables` (`ddl_detached`);
- with `[ddl] mode = "locked"`, `ddl_capture` refuses a replicated command unless the session set
  `pgmesh.ddl = on` (`pgmesh ddl` does; `ALLOWED_SETTING`), or it is local or replayed by the router.

`pgmesh ddl` (a statement cluster-wide on purpose) is `router.ops.ddl`.

Must not: apply DDL itself (the applier does, through `apply_ddl`), decide retry policy, or put a DSN
into a message. Identifiers in SQL built here are quoted (`psycopg.sql` / `format('%I')`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final

from psycopg import sql

from router.config.model import PGMESH_SCHEMA, Config
from router.nodes.connect import Conn
from router.nodes.sqlfiles import statements

__all__ = ["ALLOWED_SETTING", "LOCAL_SETTING", "SCHEMA_CHANGES", "glob_regex", "install_ddl_capture"]

logger = logging.getLogger(__name__)

LOCAL_SETTING: Final = "pgmesh.ddl_local"  # SET pgmesh.ddl_local = on: DDL that stays on this node
# `[ddl] mode = "locked"`: DDL is replicated only from a session with pgmesh.ddl = on (`pgmesh ddl`); a
# guard against mistakes, not a security boundary (any session may set it)
ALLOWED_SETTING: Final = "pgmesh.ddl"
# How many DDL commands on replicated objects ran on a node (captured or replayed; `pgmesh.ddl_changed`):
# when it moved, what an applier knows of the node's tables (keys, unique constraints) may be stale.
SCHEMA_CHANGES: Final = (
    "SELECT coalesce(pg_catalog.pg_sequence_last_value(pg_catalog.to_regclass('pgmesh.schema_changes')), 0)"
)


def glob_regex(patterns: Sequence[str]) -> str:
    """`[replication]` glob patterns (schema.table, bare table = any schema) as one POSIX regex."""
    parts = []
    for pattern in patterns:
        if "." not in pattern:
            pattern = f"*.{pattern}"
        out = []
        for ch in pattern:
            if ch == "*":
                out.append(".*")
            elif ch == "?":
                out.append(".")
            elif ch.isalnum() or ch == "_":
                out.append(ch)
            else:
                out.append("\\" + ch)
        parts.append("".join(out))
    return "^(" + "|".join(parts) + ")$" if parts else "^$.^"


# known_columns and column_changes; the functions behind the event triggers (sql/*.sql, package data):
# those reading SQL text first (ddl_statements, a LANGUAGE sql function, names ddl_split when created)
_TABLES: Final = tuple(sql.SQL(text) for text in statements(__name__, "columns.sql"))
_FUNCTIONS: Final = tuple(
    sql.SQL(text) for name in ("statements.sql", "capture.sql") for text in statements(__name__, name)
)

_EVENT_TRIGGERS: Final = (
    ("pgmesh_ddl_capture", "ddl_command_end", "ddl_capture"),
    ("pgmesh_ddl_refuse", "ddl_command_start", "ddl_refuse"),
    ("pgmesh_ddl_dropped", "sql_drop", "ddl_dropped"),
)


async def install_ddl_capture(conn: Conn, config: Config, tables: Sequence[tuple[str, str]]) -> list[str]:
    """Tables, functions and event triggers of DDL replication (idempotent); in the caller's transaction,
    after `pgmesh.node_info` exists. Records the column names of the replicated `tables`."""
    schema = sql.Identifier(PGMESH_SCHEMA)
    done: list[str] = []
    for statement in _TABLES:
        await conn.execute(statement.format(schema=schema))
    rep = config.replication
    settings = {
        "ddl.publication": config.publication_name,
        "ddl.tables": glob_regex(rep.tables),
        "ddl.exclude": glob_regex(rep.exclude),
        "ddl.new_table_without_key": rep.new_table_without_key,
        "ddl.replicate": "on" if rep.replicate_ddl else "off",
        "ddl.mode": config.ddl.mode,  # "locked": direct DDL refused (ddl_locked); `pgmesh ddl` may
    }
    for key, value in settings.items():
        await conn.execute(
            sql.SQL(
                "INSERT INTO {}.node_info VALUES (%s, %s)"
                " ON CONFLICT (key) DO UPDATE SET value = excluded.value"
            ).format(schema),
            [key, value],
        )
    for definition in _FUNCTIONS:
        await conn.execute(definition.format(schema=schema))
    cur = await conn.execute("SELECT evtname FROM pg_event_trigger WHERE evtname LIKE 'pgmesh\\_%%'")
    have = {r[0] for r in await cur.fetchall()}
    for trigger, event, function in _EVENT_TRIGGERS:
        if trigger in have:
            continue
        await conn.execute(
            sql.SQL("CREATE EVENT TRIGGER {} ON {} EXECUTE FUNCTION {}.{}()").format(
                sql.Identifier(trigger), sql.SQL(event), schema, sql.Identifier(function)
            )
        )
        # also under session_replication_role = replica (the router's sessions): new tables join there
        await conn.execute(sql.SQL("ALTER EVENT TRIGGER {} ENABLE ALWAYS").format(sql.Identifier(trigger)))
        done.append(f"created event trigger {trigger} ({event})")
    names = [sql.Identifier(*t).as_string(conn) for t in tables]
    # TRUNCATE of one partition travels as a command (pgoutput sends only the root's): its triggers
    await conn.execute(
        sql.SQL(
            "SELECT {schema}.truncate_triggers(c.oid) FROM pg_class c"
            " WHERE c.oid = ANY(%s::regclass[]) AND c.relkind = 'p'"
        ).format(schema=schema),
        [names],
    )
    await conn.execute(
        sql.SQL(
            "INSERT INTO {schema}.known_columns"
            " SELECT a.attrelid, a.attnum, a.attname FROM pg_attribute a"
            " WHERE a.attrelid = ANY(%s::regclass[]) AND a.attnum > 0 AND NOT a.attisdropped"
            " ON CONFLICT (relid, attnum) DO UPDATE SET name = excluded.name"
        ).format(schema=schema),
        [names],
    )
    return done
