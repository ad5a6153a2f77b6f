"""DDL replication: capture on the node where a command runs, replay in commit order everywhere else.

PostgreSQL 15's logical decoding carries no DDL, so pgmesh installs on every node:

- an event trigger on `ddl_command_end` (`pgmesh.ddl_capture`, enabled ALWAYS) that writes the command's
  text, search_path, role and tag into the same transaction as a transactional logical message with
  prefix `pgmesh.ddl` (`pg_logical_emit_message(true, ...)`), so it is decoded at its exact place in the
  source's commit order; the applier runs it there (`router.apply.applier`), before the DML that follows it.
  Commands the router itself applies run under a replication origin and are not captured again; neither
  is DDL run with `SET pgmesh.ddl_local = on` (per-node DDL, e.g. `pgmesh sequences`), on temporary
  objects, in the `pgmesh` schema or by an extension script;
- for every table a command creates or alters in the replicated set (`[replication] tables/exclude`),
  on every node (also when the router applies it): the table joins the publication and gets the
  tombstone trigger (`router.conflicts.catalog`) once it has a key; without one it is left local with a
  warning, or refused (`new_table_without_key = "refuse"`);
- `pgmesh.known_columns` / `pgmesh.column_changes`: what each table's columns were called, so that a
  column renamed or dropped by DDL is recognised when rows sent before the change arrive later from
  another node (`reconcile` maps them); an unexplained missing column still pauses the link;
- an event trigger on `ddl_command_start` refusing, at the node where they are issued, commands that
  cannot be replayed inside a transaction (CREATE / DROP INDEX CONCURRENTLY) and query strings that
  mix DDL with transaction control.

Also `pgmesh ddl`: run a statement cluster-wide on purpose, optionally behind a replication barrier.

Must not: apply DDL itself (the applier does, through `apply_ddl`), decide retry policy, or put a DSN
into a message. Identifiers in SQL built here are quoted (`psycopg.sql` / `format('%I')`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec
import psycopg
from psycopg import sql

from protocol.lsn import format_lsn
from protocol.messages import Delete, Insert, Message, RawInsert, Relation, TupleData, Update
from protocol.pgoutput import decode_raw_insert
from protocol.transactions import Transaction
from router.config import PGMESH_SCHEMA, Config, NodeConfig
from router.errors import PgmeshError, describe
from router.stream.spool import SpillFile

__all__ = [
    "DDL_PREFIX",
    "LOCAL_SETTING",
    "DdlCommand",
    "barrier",
    "cmd_ddl",
    "ddl_command",
    "glob_regex",
    "has_ddl",
    "install_ddl_capture",
    "reconcile",
]

logger = logging.getLogger(__name__)

Conn = psycopg.AsyncConnection[Any]
Drift = Mapping[str, Mapping[str, str | None]]  # "schema.table" -> old column name -> new name / None

DDL_PREFIX: Final = "pgmesh.ddl"
LOCAL_SETTING: Final = "pgmesh.ddl_local"  # SET pgmesh.ddl_local = on: DDL that stays on this node


class DdlCommand(msgspec.Struct, frozen=True):
    """What the capture trigger records of one command (the message's JSON content)."""

    sql: str
    search_path: str
    role: str
    tag: str


def has_ddl(txn: Transaction) -> bool:
    spill = txn.spill
    if isinstance(spill, SpillFile) and DDL_PREFIX in spill.message_prefixes:
        return True  # in the part of the transaction spilled to disk
    if len(txn.changes) == txn.row_count:
        return False  # rows only (the common case, checked once per transaction on the apply path)
    return any(isinstance(c, Message) and c.prefix == DDL_PREFIX for c in txn.changes)


def ddl_command(message: Message) -> DdlCommand:
    return msgspec.json.decode(message.content, type=DdlCommand)


# ---------------------------------------------------------------------------------------------------------
# What is installed on each node


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


_TABLES: Final = (
    sql.SQL("""CREATE TABLE IF NOT EXISTS {schema}.known_columns (
  relid oid NOT NULL, attnum int2 NOT NULL, name text NOT NULL, PRIMARY KEY (relid, attnum))"""),
    sql.SQL("""CREATE TABLE IF NOT EXISTS {schema}.column_changes (
  table_name text NOT NULL, old_name text NOT NULL, new_name text,
  at timestamptz NOT NULL DEFAULT clock_timestamp())"""),
)

_FUNCTIONS: Final = tuple(sql.SQL(part) for part in r"""
CREATE OR REPLACE FUNCTION {schema}.ddl_setting(name text) RETURNS text LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp AS $body$
  SELECT value FROM {schema}.node_info WHERE key = 'ddl.' || name
$body$;
-- next
CREATE OR REPLACE FUNCTION {schema}.ddl_applying() RETURNS boolean LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $body$
  SELECT pg_catalog.pg_replication_origin_session_is_setup()
$body$;
-- next
CREATE OR REPLACE FUNCTION {schema}.ddl_emit(content text) RETURNS void LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $body$
  SELECT NULL::void FROM pg_catalog.pg_logical_emit_message(true, 'pgmesh.ddl', content)
$body$;
-- next
-- One table a command created or altered: track its columns; in the replicated set, put it in the
-- publication with its tombstone trigger once it has a key.
CREATE OR REPLACE FUNCTION {schema}.ddl_table(rel oid) RETURNS void LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  nsp text; tab text; kind "char"; part boolean; persist "char"; ident "char";
  qualified text; key text[]; pub text; published boolean; col record;
BEGIN
  SELECT n.nspname, c.relname, c.relkind, c.relispartition, c.relpersistence, c.relreplident
    INTO nsp, tab, kind, part, persist, ident
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = rel;
  IF NOT FOUND OR kind NOT IN ('r', 'p') OR part OR persist <> 'p' THEN
    RETURN;
  END IF;
  qualified := nsp || '.' || tab;
  IF qualified !~ {schema}.ddl_setting('tables') OR qualified ~ {schema}.ddl_setting('exclude') THEN
    RETURN;
  END IF;
  FOR col IN SELECT k.name AS was, a.attname::text AS now, a.attisdropped AS dropped
               FROM {schema}.known_columns k
               JOIN pg_attribute a ON a.attrelid = rel AND a.attnum = k.attnum
              WHERE k.relid = rel AND (a.attisdropped OR a.attname <> k.name) LOOP
    INSERT INTO {schema}.column_changes (table_name, old_name, new_name)
    VALUES (qualified, col.was, CASE WHEN col.dropped THEN NULL ELSE col.now END);
  END LOOP;
  DELETE FROM {schema}.known_columns WHERE relid = rel;
  INSERT INTO {schema}.known_columns
  SELECT rel, a.attnum, a.attname FROM pg_attribute a
   WHERE a.attrelid = rel AND a.attnum > 0 AND NOT a.attisdropped;

  SELECT array_agg(a.attname::text ORDER BY k.ord) INTO key
    FROM pg_index i CROSS JOIN unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
    JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
   WHERE i.indrelid = rel AND i.indisprimary;
  IF key IS NULL AND ident = 'i' THEN
    SELECT array_agg(a.attname::text ORDER BY k.ord) INTO key
      FROM pg_index i CROSS JOIN unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
     WHERE i.indrelid = rel AND i.indisreplident;
  END IF;
  IF key IS NULL AND ident = 'f' THEN
    SELECT array_agg(a.attname::text ORDER BY a.attnum) INTO key
      FROM pg_attribute a WHERE a.attrelid = rel AND a.attnum > 0 AND NOT a.attisdropped;
  END IF;
  pub := {schema}.ddl_setting('publication');
  SELECT EXISTS (SELECT 1 FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid
                  WHERE p.pubname = pub AND r.prrelid = rel) INTO published;
  IF key IS NULL THEN
    IF published THEN
      RAISE EXCEPTION 'pgmesh: table % is replicated and would lose its key', qualified
        USING ERRCODE = '0A000',
              HINT = 'keep a primary key (or replica identity); to stop replicating it, '
                     'exclude it in config.toml and run pgmesh init';
    ELSIF {schema}.ddl_setting('new_table_without_key') = 'refuse' THEN
      RAISE EXCEPTION 'pgmesh: table % has no primary key, replica identity index or REPLICA IDENTITY FULL',
        qualified
        USING ERRCODE = '0A000',
              HINT = 'create it with a primary key (pgmesh cannot replicate its updates and deletes '
                     'without one), or exclude it in config.toml';
    END IF;
    RAISE WARNING 'pgmesh: table % has no primary key: it stays local (not replicated) until it gets one',
      qualified;
    RETURN;
  END IF;
  IF NOT published THEN
    EXECUTE format('ALTER PUBLICATION %I ADD TABLE %I.%I', pub, nsp, tab);
  END IF;
  EXECUTE format('DROP TRIGGER IF EXISTS pgmesh_tombstone ON %I.%I', nsp, tab);
  EXECUTE format('CREATE TRIGGER pgmesh_tombstone AFTER DELETE ON %I.%I FOR EACH ROW '
                 'EXECUTE FUNCTION {schema}.tombstone(%s)',
                 nsp, tab, (SELECT string_agg(quote_literal(c), ', ') FROM unnest(key) AS c));
  EXECUTE format('ALTER TABLE %I.%I ENABLE ALWAYS TRIGGER pgmesh_tombstone', nsp, tab);
END
$body$;
-- next
-- ddl_command_end: record the command in the transaction (unless it is local or replayed here).
-- SECURITY INVOKER and no SET clause: current_user and search_path are the session's own.
CREATE OR REPLACE FUNCTION {schema}.ddl_capture() RETURNS event_trigger LANGUAGE plpgsql AS $body$
DECLARE
  cmd record;
  replicated boolean := false;
  stamp text;
BEGIN
  IF coalesce(pg_catalog.current_setting('pgmesh.ddl_inner', true), '') = 'on' THEN
    RETURN;  -- DDL pgmesh itself runs from here (ALTER PUBLICATION, its trigger)
  END IF;
  PERFORM pg_catalog.set_config('pgmesh.ddl_inner', 'on', true);
  replicated := coalesce(pg_catalog.current_setting('pgmesh.ddl_dropped', true), '') = 'on';
  PERFORM pg_catalog.set_config('pgmesh.ddl_dropped', 'off', true);
  FOR cmd IN SELECT * FROM pg_catalog.pg_event_trigger_ddl_commands() LOOP
    CONTINUE WHEN cmd.in_extension OR cmd.schema_name IS NOT NULL
      AND (cmd.schema_name IN ('pgmesh', 'pgmesh_join') OR cmd.schema_name LIKE 'pg\_temp%'
           OR cmd.schema_name LIKE 'pg\_toast%');
    CONTINUE WHEN cmd.object_type IN ('publication', 'publication relation', 'publication namespace',
                                      'subscription', 'event trigger');
    replicated := true;
    IF cmd.object_type IN ('table', 'table column') THEN
      PERFORM {schema}.ddl_table(cmd.objid);
    END IF;
  END LOOP;
  IF replicated AND {schema}.ddl_setting('replicate') = 'on' AND NOT {schema}.ddl_applying()
     AND coalesce(pg_catalog.current_setting('pgmesh.ddl_local', true), '') NOT IN ('on', 'true', '1') THEN
    -- one message per statement, also when a query string holds several commands
    stamp := pg_catalog.statement_timestamp()::text || ' ' || pg_catalog.md5(pg_catalog.current_query());
    IF stamp IS DISTINCT FROM pg_catalog.current_setting('pgmesh.ddl_stamp', true) THEN
      PERFORM pg_catalog.set_config('pgmesh.ddl_stamp', stamp, true);
      PERFORM {schema}.ddl_emit(pg_catalog.json_build_object(
        'sql', pg_catalog.current_query(), 'search_path', pg_catalog.current_setting('search_path'),
        'role', current_user, 'tag', tg_tag)::text);
    END IF;
  END IF;
  PERFORM pg_catalog.set_config('pgmesh.ddl_inner', 'off', true);
END
$body$;
-- next
-- sql_drop: DROP commands are not listed at ddl_command_end; note here that one dropped something
-- replicated (ddl_command_end, which fires next, then captures the command).
CREATE OR REPLACE FUNCTION {schema}.ddl_dropped() RETURNS event_trigger LANGUAGE plpgsql AS $body$
BEGIN
  IF coalesce(pg_catalog.current_setting('pgmesh.ddl_inner', true), '') = 'on' THEN
    RETURN;
  END IF;
  IF EXISTS (SELECT 1 FROM pg_catalog.pg_event_trigger_dropped_objects() d
              WHERE d.original AND NOT d.is_temporary
                AND coalesce(d.schema_name, '') NOT IN ('pgmesh', 'pgmesh_join')
                AND coalesce(d.schema_name, '') NOT LIKE 'pg\_toast%'
                AND d.object_type NOT IN ('publication', 'publication relation', 'publication namespace',
                                          'subscription', 'event trigger')) THEN
    PERFORM pg_catalog.set_config('pgmesh.ddl_dropped', 'on', true);
  END IF;
END
$body$;
-- next
-- ddl_command_start: refuse here what could not be replayed on the other nodes.
CREATE OR REPLACE FUNCTION {schema}.ddl_refuse() RETURNS event_trigger LANGUAGE plpgsql AS $body$
DECLARE
  q text := pg_catalog.current_query();
BEGIN
  IF coalesce(pg_catalog.current_setting('pgmesh.ddl_inner', true), '') = 'on'
     OR coalesce(pg_catalog.current_setting('pgmesh.ddl_local', true), '') IN ('on', 'true', '1')
     OR {schema}.ddl_setting('replicate') IS DISTINCT FROM 'on' OR {schema}.ddl_applying() THEN
    RETURN;
  END IF;
  IF tg_tag IN ('CREATE INDEX', 'DROP INDEX') AND q ~* '\mconcurrently\M' THEN
    RAISE EXCEPTION 'pgmesh: % CONCURRENTLY is not replicated (the other nodes replay DDL inside a '
                    'transaction)', tg_tag
      USING ERRCODE = '0A000',
            HINT = 'run it without CONCURRENTLY, or run it on every node with SET pgmesh.ddl_local = on';
  END IF;
  IF q ~* ('(^|;)\s*(begin|start\s+transaction|commit|end|rollback|abort|savepoint|release'
           '|prepare\s+transaction)\M') THEN
    RAISE EXCEPTION 'pgmesh: DDL sent in one query string with transaction control is not replicated'
      USING ERRCODE = '0A000', HINT = 'send BEGIN, each DDL statement and COMMIT as separate statements';
  END IF;
END
$body$;
""".split("\n-- next\n"))  # noqa: SIM905 (one SQL text, read as such)

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
    await conn.execute(
        sql.SQL(
            "INSERT INTO {schema}.known_columns"
            " SELECT a.attrelid, a.attnum, a.attname FROM pg_attribute a"
            " WHERE a.attrelid = ANY(%s::regclass[]) AND a.attnum > 0 AND NOT a.attisdropped"
            " ON CONFLICT (relid, attnum) DO UPDATE SET name = excluded.name"
        ).format(schema=schema),
        [[sql.Identifier(*t).as_string(conn) for t in tables]],
    )
    return done


# ---------------------------------------------------------------------------------------------------------
# Rows sent before a rename or drop


def _follow(changes: Mapping[str, str | None], name: str) -> str | None:
    seen = {name}
    current: str | None = name
    while current is not None and current in changes:
        current = changes[current]
        if current in seen:
            break
        if current is not None:
            seen.add(current)
    return current


def reconcile(
    txn: Transaction, columns: Mapping[tuple[str, str], frozenset[str]], drift: Drift
) -> Transaction | None:
    """`txn` with its rows fitted to the target's columns where DDL explains the difference.

    A column the target lacks that pgmesh saw renamed here is sent under its new name; one it saw
    dropped is left out. None when nothing needed fitting or a difference is not explained (the
    caller then reports the missing column).
    """
    fitted: dict[int, tuple[Relation, list[int] | None]] = {}  # id(relation) -> (fitted, kept positions)

    def fit(relation: Relation) -> tuple[Relation, list[int] | None] | None:
        have = columns.get((relation.schema, relation.name))
        if have is None or all(c.name in have for c in relation.columns):
            return relation, None
        changes = drift.get(f"{relation.schema}.{relation.name}", {})
        kept: list[int] = []
        out = []
        for i, column in enumerate(relation.columns):
            name: str | None = column.name
            if name not in have:
                name = _follow(changes, column.name)
                if name is not None and name not in have:
                    return None
            if name is not None:
                kept.append(i)
                out.append(msgspec.structs.replace(column, name=name) if name != column.name else column)
        return msgspec.structs.replace(relation, columns=tuple(out)), kept

    def cut(data: TupleData | None, kept: list[int]) -> TupleData | None:
        if data is None:
            return None
        return TupleData(bytes(data.kinds[i] for i in kept), tuple(data.values[i] for i in kept))

    current: dict[int, tuple[Relation, list[int] | None]] = {}
    relations: dict[int, Relation] = {}
    changed = False
    for relid, relation in txn.relations.items():
        result = fit(relation)
        if result is None:
            return None
        fitted[id(relation)] = result
        current[relid] = result
        relations[relid] = result[0]
        changed = changed or result[1] is not None
    changes: list[Any] = []
    for change in txn.changes:
        if isinstance(change, Relation):
            result = fit(change)
            if result is None:
                return None
            current[change.relid] = result
            changed = changed or result[1] is not None
            changes.append(result[0])
        elif isinstance(change, (Insert, RawInsert, Update, Delete)) and (
            kept := _kept(current, change.relid)
        ):
            if isinstance(change, RawInsert):  # a part read back raw from a spill file
                change = decode_raw_insert(change)
            if isinstance(change, Insert):
                changes.append(msgspec.structs.replace(change, new=cut(change.new, kept)))
            elif isinstance(change, Update):
                new, old = cut(change.new, kept), cut(change.old, kept)
                changes.append(msgspec.structs.replace(change, new=new, old=old))
            else:
                changes.append(msgspec.structs.replace(change, old=cut(change.old, kept)))
        else:
            changes.append(change)
    if not changed:
        return None
    return msgspec.structs.replace(txn, changes=changes, relations=relations)


def _kept(current: Mapping[int, tuple[Relation, list[int] | None]], relid: int) -> list[int] | None:
    entry = current.get(relid)
    return None if entry is None else entry[1]


# ---------------------------------------------------------------------------------------------------------
# pgmesh ddl: on purpose, cluster-wide


async def _connect(node: NodeConfig) -> Conn:
    try:
        return await psycopg.AsyncConnection.connect(
            node.dsn, autocommit=True, connect_timeout=10, application_name="pgmesh ddl"
        )
    except psycopg.Error as exc:
        raise PgmeshError(f"cannot connect: {describe(exc)}", node=node.name, sqlstate=exc.sqlstate) from None


async def barrier(config: Config, limit: float = 300.0) -> dict[str, int]:
    """Wait until every node's slot is confirmed up to that node's WAL position when called: everything
    committed anywhere before has been applied everywhere. Needs the router running."""
    conns = {node.name: await _connect(node) for node in config.nodes}
    try:
        wanted: dict[str, int] = {}
        for name, conn in conns.items():
            cur = await conn.execute("SELECT (pg_current_wal_lsn() - '0/0')::bigint")
            row = await cur.fetchone()
            assert row is not None
            wanted[name] = int(row[0])
        deadline = time.monotonic() + limit
        pending = dict(wanted)
        while pending:
            for name in list(pending):
                cur = await conns[name].execute(
                    "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots"
                    " WHERE slot_name = %s",
                    [config.slot_name],
                )
                row = await cur.fetchone()
                if row is None:
                    raise PgmeshError(
                        f"slot {config.slot_name} is missing", node=name, hint="run pgmesh init"
                    )
                if row[0] is not None and int(row[0]) >= pending[name]:
                    del pending[name]
            if not pending:
                break
            if time.monotonic() > deadline:
                late = ", ".join(f"{n} (wants {format_lsn(lsn)})" for n, lsn in sorted(pending.items()))
                raise PgmeshError(
                    f"replication barrier not reached after {limit:.0f} s: {late}",
                    hint="is `pgmesh run` running and every link streaming? see `pgmesh status`",
                )
            await asyncio.sleep(0.1)
        return wanted
    finally:
        for conn in conns.values():
            await conn.close()


async def cmd_ddl(
    config: Config, statement: str, *, node: str | None = None, wait: bool = False, limit: float = 300.0
) -> int:
    """Run `statement` on one node (default: the first); the capture trigger replicates it. With `wait`,
    first let every link catch up, then wait until the statement has reached every node."""
    target = next((n for n in config.nodes if node is None or n.name == node), None)
    if target is None:
        raise PgmeshError(f"no node {node!r} in the config")
    if wait:
        await barrier(config, limit)
        print("barrier: every link has caught up")
    async with await _connect(target) as conn:
        try:
            await conn.execute(statement.encode())  # the operator's own SQL, as given
        except psycopg.Error as exc:
            raise PgmeshError(
                f"the statement failed: {describe(exc)}", node=target.name, sqlstate=exc.sqlstate
            ) from None
    print(f"node {target.name}: done")
    if wait:
        await barrier(config, limit)
        print("barrier: applied on every node")
    return 0


def describe_command(command: DdlCommand, limit: int = 200) -> str:
    text = " ".join(command.sql.split())
    return json.dumps(text if len(text) <= limit else text[:limit] + "...")

