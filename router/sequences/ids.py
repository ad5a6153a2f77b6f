"""Global sequences: node ids, and sequence-backed columns that never hand out one id on two nodes.

Owns:
- node ids 0..1023, one per node, kept on the node as the row ('node_id', n) of `pgmesh.node_info`;
  `assign_node_ids` (run by `pgmesh init`) keeps the ids nodes have and gives a new node the smallest id
  no current node holds, so the id of a node that left is reused;
- the functions `pgmesh.snowflake_nextval(regclass)`, `pgmesh.snowflake_parts(bigint)` and
  `pgmesh.node_id()` on every node (their text: `sql/*.sql` beside this module, package data);
- the id layout (40 bits of milliseconds since 2025-01-01 UTC, 10 bits of node id, 14 bits of the
  column's own sequence) and the step/offset arithmetic (a node's values are node_id mod step), as pure
  functions;
- finding the serial, identity and nextval-default columns of the replicated tables, and the sequences
  no column default names that sit in a replicated schema (an application calling `nextval()` itself:
  "standalone"), and telling which mode each is in (`pgmesh sequences status`). Converting them is
  `router.sequences.convert`'s.
See docs/sequences.md.

Must not: let its statements be replicated (every transaction it opens sets `pgmesh.ddl_local = 'on'`
before anything else, so the DDL capture leaves them on their node), alter user tables or sequences, or
put a DSN or password into a message. Identifiers are always quoted with `psycopg.sql`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec
import psycopg
from psycopg import sql

from router.config.model import PGMESH_SCHEMA, SYSTEM_SCHEMAS, Config, NodeConfig
from router.errors import ConfigError, PgmeshError, describe
from router.nodes.connect import ADMIN_SETUP, Conn, Failure, connect
from router.nodes.sqlfiles import statements

__all__ = [
    "EPOCH_MS",
    "LOCAL_DDL_SETTING",
    "MAX_NODE_ID",
    "Mode",
    "NodeSequences",
    "SequenceColumn",
    "assign_node_ids",
    "close_all",
    "connect_all",
    "default_kind",
    "detect_mode",
    "disagreements",
    "first_in_progression",
    "install_sequences",
    "plan_node_ids",
    "read_columns",
    "read_node_id",
    "read_status",
    "render_status",
    "set_local",
    "snowflake",
    "snowflake_floor",
    "snowflake_parts",
    "status_json",
]

logger = logging.getLogger(__name__)

ColumnKey = tuple[str, str, str]  # (schema, table, column)

EPOCH_MS: Final = 1_735_689_600_000  # 2025-01-01 00:00:00 UTC, in Unix milliseconds
TIME_BITS: Final = 40
NODE_BITS: Final = 10
COUNTER_BITS: Final = 14
MAX_NODE_ID: Final = (1 << NODE_BITS) - 1
COUNTER_MODULUS: Final = 1 << COUNTER_BITS
NODE_ID_KEY: Final = "node_id"
LOCAL_DDL_SETTING: Final = "pgmesh.ddl_local"
APPLICATION_NAME: Final = "pgmesh sequences"
_COMMENT_PREFIX: Final = "pgmesh sequences "
_LITERAL: Final = r"'(?:[^']|'')+'::regclass"
_NEXTVAL_RE: Final = re.compile(rf"^nextval\({_LITERAL}\)$")
_SNOWFLAKE_RE: Final = re.compile(rf"^(?:{PGMESH_SCHEMA}\.)?snowflake_nextval\({_LITERAL}\)$")

# ---------------------------------------------------------------------------------------------------------
# Pure: node ids, bit layout, progressions, defaults


def plan_node_ids(names: Sequence[str], existing: Mapping[str, int | None]) -> dict[str, int]:
    """Every node's id: the one it has, else the smallest id no node in `names` holds (in `names` order).

    Two current nodes holding the same id is a ConfigError naming both.
    """
    owners: dict[int, str] = {}
    for name in names:
        held = existing.get(name)
        if held is None:
            continue
        if held in owners:
            raise ConfigError(
                f"node {owners[held]} and node {name} both have node id {held}",
                hint=f"one of them was copied from the other; DELETE FROM {PGMESH_SCHEMA}.node_info WHERE"
                f" key = 'node_id' on the newer one before anything was converted, then run pgmesh init",
            )
        owners[held] = name
    free = (i for i in range(MAX_NODE_ID + 1) if i not in owners)
    plan: dict[str, int] = {}
    for name in names:
        held = existing.get(name)
        if held is None:
            held = next(free, None)
            if held is None:
                raise ConfigError(f"no node id left for node {name}: at most {MAX_NODE_ID + 1} nodes")
        plan[name] = held
    return plan


def parse_node_id(node: str, raw: str) -> int:
    """The value of a node's ('node_id', ...) row, checked."""
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_NODE_ID:
        raise PgmeshError(
            f"{PGMESH_SCHEMA}.node_info has node_id {raw!r}, not a number 0..{MAX_NODE_ID}",
            node=node,
            hint="delete that row and run pgmesh init to assign a new one",
        )
    return value


def snowflake(ms: int, node_id: int, counter: int) -> int:
    """The id for Unix millisecond `ms` on node `node_id`, the sequence's value being `counter`, as the
    signed bigint `pgmesh.snowflake_nextval` returns (40 + 10 + 14 bits fill all 64: from 2042-06-03,
    when the time field reaches 2**39, the sign bit is set and ids are negative)."""
    since = ms - EPOCH_MS
    if not 0 <= since < 1 << TIME_BITS:
        raise ValueError(f"{ms} ms is outside the snowflake range")
    value = since << (NODE_BITS + COUNTER_BITS) | node_id << COUNTER_BITS | counter % COUNTER_MODULUS
    return value - (1 << 64) if value >= 1 << 63 else value


def snowflake_parts(value: int) -> tuple[int, int, int]:
    """(Unix milliseconds, node id, counter) of a snowflake id; the same as SQL `pgmesh.snowflake_parts`."""
    bits = value & (1 << 64) - 1
    ms = (bits >> (NODE_BITS + COUNTER_BITS)) + EPOCH_MS
    return ms, bits >> COUNTER_BITS & MAX_NODE_ID, bits & COUNTER_MODULUS - 1


def snowflake_floor(ms: int) -> int:
    """The smallest snowflake id any node hands out at or after Unix millisecond `ms`."""
    return snowflake(ms, 0, 0)


def first_in_progression(above: int, step: int, offset: int) -> int:
    """The smallest value greater than `above` that is `offset` mod `step`."""
    start = above + 1
    return start + (offset - start) % step


def default_kind(default: str | None, identity: str) -> str:
    """What fills a column: 'identity', 'nextval', 'snowflake', 'none' or 'other' (another expression).

    `default` is the column's default as pg_get_expr prints it, `identity` pg_attribute.attidentity.
    """
    if identity:
        return "identity"
    if default is None:
        return "none"
    text = default.strip()
    if _SNOWFLAKE_RE.match(text):
        return "snowflake"
    if _NEXTVAL_RE.match(text):
        return "nextval"
    return "other"


class SequenceColumn(msgspec.Struct, frozen=True):
    """A column of a table filled from a sequence, as one node has it."""

    schema: str
    table: str
    column: str
    type: str  # format_type of the column
    identity: str  # '' (none), 'a' (GENERATED ALWAYS) or 'd' (GENERATED BY DEFAULT)
    default: str | None  # pg_get_expr of the default; None for identity columns
    seq_schema: str
    seq_name: str
    increment: int
    start: int
    max_value: int
    seq_type: str
    last_value: int | None  # None until the sequence is first used after a (re)start
    # a sequence no column default or identity names (its callers run nextval() themselves): then
    # `schema`/`table` name the sequence itself and `column` is ''
    standalone: bool = False

    @property
    def key(self) -> ColumnKey:
        return (self.schema, self.table, self.column)

    @property
    def relation(self) -> str:
        return f"{self.schema}.{self.table}"

    @property
    def label(self) -> str:
        """How messages name it: `schema.table.column`, or `sequence schema.name` for a standalone one."""
        return f"sequence {self.sequence}" if self.standalone else f"{self.relation}.{self.column}"

    @property
    def sequence(self) -> str:
        return f"{self.seq_schema}.{self.seq_name}"

    @property
    def kind(self) -> str:
        return "standalone" if self.standalone else default_kind(self.default, self.identity)


class Mode(msgspec.Struct, frozen=True):
    """How a column's ids are made: 'snowflake', 'step' (with step and offset), 'local' or 'other'."""

    kind: str
    step: int = 0
    offset: int = 0

    def __str__(self) -> str:
        if self.kind == "step":
            return f"step {self.step} offset {self.offset}"
        return {"local": "local (unconverted)", "other": "other (not a sequence default)"}.get(
            self.kind, self.kind
        )


def detect_mode(column: SequenceColumn) -> Mode:
    """The mode a column is in, from its default and its sequence's increment, start and position."""
    kind = column.kind
    if kind == "snowflake":
        return Mode("snowflake")
    if kind not in ("nextval", "identity", "standalone"):
        return Mode("other")
    if column.increment > 1:
        base = column.last_value if column.last_value is not None else column.start
        return Mode("step", column.increment, base % column.increment)
    return Mode("local")


# ---------------------------------------------------------------------------------------------------------
# SQL

_COLUMNS_SQL: Final = """
SELECT DISTINCT ON (n.nspname, c.relname, a.attnum)
       n.nspname, c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attidentity::text,
       pg_get_expr(d.adbin, d.adrelid), sn.nspname, s.relname, q.seqincrement, q.seqstart, q.seqmax,
       format_type(q.seqtypid, NULL), pg_sequence_last_value(s.oid)
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
JOIN pg_depend dep ON dep.refclassid = 'pg_class'::regclass AND (
       (dep.classid = 'pg_attrdef'::regclass AND dep.objid = d.oid)
    OR (a.attidentity <> '' AND dep.classid = 'pg_class'::regclass AND dep.deptype = 'i'
        AND dep.refobjid = c.oid AND dep.refobjsubid = a.attnum))
JOIN pg_class s ON s.relkind = 'S'
  AND s.oid = CASE WHEN dep.classid = 'pg_attrdef'::regclass THEN dep.refobjid ELSE dep.objid END
JOIN pg_namespace sn ON sn.oid = s.relnamespace
JOIN pg_sequence q ON q.seqrelid = s.oid
WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
  AND n.nspname <> ALL(%s) AND n.nspname NOT LIKE 'pg\\_%%'
ORDER BY n.nspname, c.relname, a.attnum, s.oid
"""
# The sequences no column default or identity names (an application calls nextval() on them itself), with
# the tables of their schema (a sequence counts when its schema holds a replicated table, or when its own
# name matches `tables`).
_STANDALONE_SQL: Final = """
SELECT sn.nspname, s.relname, format_type(q.seqtypid, NULL), q.seqincrement, q.seqstart, q.seqmax,
       pg_sequence_last_value(s.oid),
       ARRAY(SELECT c.relname::text FROM pg_class c WHERE c.relnamespace = sn.oid AND c.relkind IN ('r', 'p'))
FROM pg_class s
JOIN pg_namespace sn ON sn.oid = s.relnamespace
JOIN pg_sequence q ON q.seqrelid = s.oid
WHERE s.relkind = 'S' AND sn.nspname <> ALL(%s) AND sn.nspname NOT LIKE 'pg\\_%%'
  AND NOT EXISTS (SELECT FROM pg_depend d JOIN pg_attrdef ad ON ad.oid = d.objid
                   WHERE d.classid = 'pg_attrdef'::regclass AND d.refclassid = 'pg_class'::regclass
                     AND d.refobjid = s.oid)
  AND NOT EXISTS (SELECT FROM pg_depend d WHERE d.classid = 'pg_class'::regclass AND d.objid = s.oid
                     AND d.deptype = 'i')
ORDER BY 1, 2
"""
_NODE_ID_SQL: Final = sql.SQL("SELECT value FROM {}.node_info WHERE key = %s")
_SET_NODE_ID_SQL: Final = sql.SQL(
    "INSERT INTO {}.node_info (key, value) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING"
)

def _function(file: str, args: str) -> tuple[str, str, sql.SQL]:
    (ddl,) = statements(__name__, file)
    return file.removesuffix(".sql"), args, sql.SQL(ddl)


# (name, argument types, definition with {schema} and {epoch}), each from sql/<name>.sql (package data).
# node_id() is SECURITY DEFINER so that a role inserting into a converted table needs no privilege on
# node_info (only USAGE on the schema); snowflake_nextval runs as its caller, so nextval() still checks
# the caller's right to the sequence.
_FUNCTIONS: Final = (
    _function("node_id.sql", ""),
    _function("snowflake_nextval.sql", "regclass"),
    _function("snowflake_parts.sql", "bigint"),
)


async def set_local(conn: Conn) -> None:
    """The first statement of every transaction here: the DDL capture leaves what follows on this node."""
    await conn.execute(sql.SQL("SET LOCAL {} = 'on'").format(sql.SQL(LOCAL_DDL_SETTING)))


# ---------------------------------------------------------------------------------------------------------
# Connecting and reading


async def _connect(node: NodeConfig, *, autocommit: bool) -> Conn:
    """A connection to one node; failures name the node, never the DSN."""
    return await connect(node, purpose=APPLICATION_NAME, autocommit=autocommit, failure=Failure.UNREACHABLE)


async def connect_all(config: Config, *, autocommit: bool) -> dict[str, Conn]:
    results = await asyncio.gather(
        *(_connect(node, autocommit=autocommit) for node in config.nodes), return_exceptions=True
    )
    conns: dict[str, Conn] = {}
    for node, result in zip(config.nodes, results, strict=True):
        if isinstance(result, psycopg.AsyncConnection):
            conns[node.name] = result
    failures = [r for r in results if isinstance(r, BaseException)]
    for name, conn in [] if failures else conns.items():  # synchronous > 0 (docs/synchronous.md): never
        if config.synchronous(name):  # wait for the router, which may not be running
            await conn.execute(ADMIN_SETUP)
            if not autocommit:
                await conn.commit()
    if failures:
        await close_all(conns)
        if len(failures) == 1:
            raise failures[0]
        raise PgmeshError("; ".join(describe(f) for f in failures))
    return conns


async def close_all(conns: Mapping[str, Conn]) -> None:
    for conn in conns.values():
        await conn.close()


async def read_node_id(conn: Conn, node: str) -> int | None:
    try:
        cur = await conn.execute(_NODE_ID_SQL.format(sql.Identifier(PGMESH_SCHEMA)), [NODE_ID_KEY])
    except psycopg.errors.UndefinedTable:
        raise PgmeshError(
            f"pgmesh is not installed here (no {PGMESH_SCHEMA}.node_info)", node=node, hint="run pgmesh init"
        ) from None
    row = await cur.fetchone()
    return None if row is None else parse_node_id(node, row[0])


async def read_columns(conn: Conn, config: Config) -> dict[ColumnKey, SequenceColumn]:
    """The sequence-backed columns of the node's replicated tables, and its standalone sequences (no
    column default names them: an application calls nextval() itself) in a schema that holds a
    replicated table, or whose own name `tables` matches."""
    cur = await conn.execute(_COLUMNS_SQL, [sorted(SYSTEM_SCHEMAS)])
    found = (SequenceColumn(*row) for row in await cur.fetchall())
    out = {c.key: c for c in found if config.replicates(c.schema, c.table)}
    cur = await conn.execute(_STANDALONE_SQL, [sorted(SYSTEM_SCHEMAS)])
    for schema, name, kind, increment, start, top, last, tables in await cur.fetchall():
        if config.replicates(schema, name) or any(config.replicates(schema, t) for t in tables):
            seq = SequenceColumn(schema, name, "", kind, "", None, schema, name, increment, start, top, kind,
                                 last, standalone=True)
            out[seq.key] = seq
    return out


# ---------------------------------------------------------------------------------------------------------
# Node ids and functions (pgmesh init)


async def _assign(conns: Mapping[str, Conn], config: Config) -> tuple[dict[str, int], list[str]]:
    existing = {name: await read_node_id(conns[name], name) for name in config.node_names}
    plan = plan_node_ids(config.node_names, existing)
    schema = sql.Identifier(PGMESH_SCHEMA)
    assigned: list[str] = []
    for name, node_id in plan.items():
        if existing[name] is None:
            await conns[name].execute(_SET_NODE_ID_SQL.format(schema), [NODE_ID_KEY, str(node_id)])
            assigned.append(name)
            logger.info("node %s: assigned node id %d", name, node_id)
    return plan, assigned


async def assign_node_ids(config: Config) -> dict[str, int]:
    """Read every node's id, keep them, give each node without one the smallest id not held by a node in
    `config` (so ids of nodes that left are reused); node name -> id."""
    conns = await connect_all(config, autocommit=True)
    try:
        plan, _ = await _assign(conns, config)
    finally:
        await close_all(conns)
    return plan


def _fingerprint(ddl: str) -> str:
    return _COMMENT_PREFIX + hashlib.sha256(ddl.encode()).hexdigest()[:16]


async def _install_functions(conn: Conn) -> list[str]:
    """Create or replace the snowflake functions whose definition differs (a fingerprint in the comment)."""
    schema = sql.Identifier(PGMESH_SCHEMA)
    done: list[str] = []
    for name, args, ddl in _FUNCTIONS:
        statement = ddl.format(schema=schema, epoch=sql.Literal(EPOCH_MS))
        fingerprint = _fingerprint(statement.as_string(conn))
        signature = sql.SQL("{}.{}({})").format(schema, sql.Identifier(name), sql.SQL(args))
        cur = await conn.execute(
            "SELECT obj_description(to_regprocedure(%s), 'pg_proc')", [signature.as_string(conn)]
        )
        row = await cur.fetchone()
        if row is not None and row[0] == fingerprint:
            continue
        await conn.execute(statement)
        comment = sql.SQL("COMMENT ON FUNCTION {} IS {}").format(signature, sql.Literal(fingerprint))
        await conn.execute(comment)
        done.append(f"{PGMESH_SCHEMA}.{name}")
    return done


async def install_sequences(config: Config) -> list[str]:
    """`pgmesh init`'s part: node ids and the snowflake functions on every node; one line per change."""
    conns = await connect_all(config, autocommit=True)
    lines: list[str] = []
    try:
        plan, assigned = await _assign(conns, config)
        lines += [f"node {name}: node id {plan[name]} (assigned)" for name in assigned]
        for name, conn in conns.items():
            try:
                async with conn.transaction():
                    await set_local(conn)
                    done = await _install_functions(conn)
            except psycopg.Error as exc:
                raise PgmeshError(f"installing {PGMESH_SCHEMA} functions failed: {describe(exc)}",
                                  node=name, sqlstate=exc.sqlstate) from None
            if done:
                lines.append(f"node {name}: installed functions {', '.join(done)}")
    finally:
        await close_all(conns)
    return lines


# ---------------------------------------------------------------------------------------------------------
# Status


class NodeSequences(msgspec.Struct, frozen=True):
    """One node's node id and sequence-backed replicated columns (or why it could not be read)."""

    name: str
    node_id: int | None
    columns: list[SequenceColumn]
    error: str | None = None


async def _node_status(config: Config, node: NodeConfig) -> NodeSequences:
    try:
        conn = await _connect(node, autocommit=True)
        async with conn:
            node_id = await read_node_id(conn, node.name)
            columns = await read_columns(conn, config)
    except PgmeshError as exc:
        return NodeSequences(node.name, None, [], exc.message)
    except psycopg.Error as exc:
        return NodeSequences(node.name, None, [], describe(exc))
    return NodeSequences(node.name, node_id, list(columns.values()))


async def read_status(config: Config) -> list[NodeSequences]:
    """Every node's ids and columns, read concurrently; a node that cannot be read carries its error."""
    return list(await asyncio.gather(*(_node_status(config, node) for node in config.nodes)))


def disagreements(nodes: Sequence[NodeSequences]) -> list[str]:
    """Columns whose mode (kind and step) is not the same on every node that was read."""
    modes: dict[ColumnKey, set[tuple[str, int]]] = {}
    for node in nodes:
        if node.error is None:
            for column in node.columns:
                mode = detect_mode(column)
                modes.setdefault(column.key, set()).add((mode.kind, mode.step))
    return [f"sequence {s}.{t}" if not c else f"{s}.{t}.{c}"
            for (s, t, c), found in sorted(modes.items()) if len(found) > 1]


def render_status(nodes: Sequence[NodeSequences]) -> str:
    """A block per node: node id, then one line per column: table, column, type, sequence, default, mode."""
    lines: list[str] = []
    header = ("table", "column", "type", "sequence", "default", "mode")
    for node in nodes:
        if node.error is not None:
            lines.append(f"node {node.name}: NOT READ: {node.error}")
            continue
        ident = "no node id (run pgmesh init)" if node.node_id is None else f"node id {node.node_id}"
        lines.append(f"node {node.name} ({ident})")
        cells = [header] + [
            ("-", "-", c.type, c.sequence, "none: callers run nextval() themselves", str(detect_mode(c)))
            if c.standalone else
            (c.relation, c.column, c.type, c.sequence, c.default or f"identity ({identity_text(c)})",
             str(detect_mode(c)))
            for c in node.columns
        ]
        if len(cells) == 1:
            lines.append("  no replicated table has a serial, identity or nextval-default column, and no"
                         " other sequence is in a replicated schema")
            continue
        widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
        for row in cells:
            lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    for name in disagreements(nodes):
        lines.append(f"WARNING: {name} is not in the same mode on every node; run pgmesh sequences convert")
    local = sorted({c.label for n in nodes if n.error is None for c in n.columns
                    if detect_mode(c).kind == "local"})
    if local and len(nodes) > 1:
        lines.append(f"WARNING: {', '.join(local)} hand(s) out the same values on every node: two nodes"
                     " inserting at once make the same key and one insert is lost (an insert_exists"
                     " conflict); run pgmesh sequences convert")
    return "\n".join(lines)


def identity_text(column: SequenceColumn) -> str:
    return "always" if column.identity == "a" else "by default"


def status_json(nodes: Sequence[NodeSequences]) -> list[dict[str, Any]]:
    """`pgmesh sequences status --json`: the same as `render_status`, with each column's mode spelled out."""
    out: list[dict[str, Any]] = []
    for node in nodes:
        columns = []
        for c in node.columns:
            mode = detect_mode(c)
            columns.append(
                {
                    "table": None if c.standalone else c.relation,
                    "column": None if c.standalone else c.column,
                    "type": c.type,
                    "sequence": c.sequence,
                    "default": c.default,
                    "identity": identity_text(c) if c.identity else None,
                    "standalone": c.standalone,
                    "mode": str(mode),
                    "kind": mode.kind,
                    "step": mode.step,
                    "offset": mode.offset,
                }
            )
        out.append({"node": node.name, "node_id": node.node_id, "error": node.error, "columns": columns})
    return out
