"""`pgmesh sequences convert`: makes the sequence-backed columns of replicated tables hand out ids that
no other node hands out, on every node at once.

Owns the conversion of serial, identity and nextval-default columns (found by `router.sequences.ids`) to
- snowflake: the column's default becomes `pgmesh.snowflake_nextval('<its sequence>'::regclass)`
  (bigint columns with a default only; an identity column is refused, dropping the identity would drop
  its sequence), its sequence counts by 1 as bigint;
- step: the sequence counts by `[sequences] step` and restarts at the first value above every id any
  node holds or any node's sequence handed out that is the node's id mod step.
A standalone sequence (no column default names it: the application calls nextval() itself, on any node)
is converted on the sequence itself, so in step mode whatever the mode asked: a snowflake id is made by
a function a default calls, which a caller of nextval() never reaches; a step sequence makes
cluster-unique values for every caller. Its highest value handed out is its sequences' highest
position on any node (the values it made are at most that).

Every node gets one transaction; all are open together, each first sets `pgmesh.ddl_local = 'on'` (the
DDL capture leaves these per-node statements local) and a lock timeout. For step mode each locks the
tables against inserts and the sequences against nextval before their highest values are read, so the
restart value is above everything on every node. All commit at the end; a lock timeout or deadlock
retries the whole conversion (the decision is `router.errors.decide`'s). Converting twice changes
nothing and says so.

Must not: change a column's type, drop an identity, run while a node is unreachable, or put a DSN or a
password into a message. Identifiers are always quoted with `psycopg.sql`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Final

import psycopg
from psycopg import sql

from router.config.model import PGMESH_SCHEMA, SEQUENCE_MODES, Config, split_table_name
from router.errors import Action, ConfigError, PgmeshError, decide, describe
from router.nodes.connect import Conn
from router.sequences.ids import (
    Mode,
    SequenceColumn,
    close_all,
    connect_all,
    detect_mode,
    first_in_progression,
    read_columns,
    read_node_id,
    set_local,
    snowflake_floor,
)

__all__ = ["convert_sequences"]

logger = logging.getLogger(__name__)

ColumnKey = tuple[str, str, str]  # (schema, table, column)

LOCK_TIMEOUT: Final = "10s"
ATTEMPTS: Final = 3
_INT_MAX: Final = {"smallint": 2**15 - 1, "integer": 2**31 - 1, "bigint": 2**63 - 1}


# ---------------------------------------------------------------------------------------------------------
# What cannot be converted (pure)


def _snowflake_problem(node: str, column: SequenceColumn) -> PgmeshError | None:
    name = f"{column.relation}.{column.column}"
    if column.kind == "identity":
        return PgmeshError(
            f"column {column.column} is an identity column: snowflake ids need a column DEFAULT, and"
            " dropping the identity would drop its sequence",
            node=node,
            relation=column.relation,
            hint=f"convert {name} with --mode step (identity columns support step mode only)",
        )
    if column.type != "bigint":
        table = sql.Identifier(column.schema, column.table).as_string()
        return PgmeshError(
            f"column {column.column} is {column.type}: snowflake ids need bigint",
            node=node,
            relation=column.relation,
            hint=f"use --mode step, or ALTER TABLE {table} ALTER COLUMN"
            f" {sql.Identifier(column.column).as_string()} TYPE bigint on every node first",
        )
    return _shape_problem(node, column)


def _step_problem(node: str, column: SequenceColumn) -> PgmeshError | None:
    if column.type not in _INT_MAX:
        return PgmeshError(
            f"column {column.column} is {column.type}: step mode needs smallint, integer or bigint",
            node=node,
            relation=column.relation,
        )
    return _shape_problem(node, column)


def _shape_problem(node: str, column: SequenceColumn) -> PgmeshError | None:
    if column.kind in ("other", "none"):
        return PgmeshError(
            f"column {column.column} defaults to {column.default!r}, which pgmesh does not convert",
            node=node,
            relation=column.relation,
            hint="only serial, identity and nextval('...') defaults are converted",
        )
    if column.increment < 0:
        return PgmeshError(
            f"sequence {column.sequence} of column {column.column} counts down ({column.increment})",
            node=node,
            relation=column.relation,
            hint="pgmesh converts ascending sequences only",
        )
    return None


def _regclass(column: SequenceColumn) -> sql.Composed:
    name = sql.Identifier(column.seq_schema, column.seq_name).as_string()
    return sql.SQL("{}::regclass").format(sql.Literal(name))


# ---------------------------------------------------------------------------------------------------------
# Converting: one transaction per node, all open together, committed together at the end


class _Node:
    """One node during a conversion: its transaction's connection, node id and columns."""

    __slots__ = ("columns", "conn", "name", "node_id")

    def __init__(self, name: str, conn: Conn, node_id: int, columns: dict[ColumnKey, SequenceColumn]) -> None:
        self.name = name
        self.conn = conn
        self.node_id = node_id
        self.columns = columns

    async def run(self, statement: sql.Composed, relation: str | None = None) -> Any:
        """Execute in this node's transaction; a server error names the node and the table."""
        try:
            return await self.conn.execute(statement)
        except psycopg.Error as exc:
            state = exc.sqlstate
            raise PgmeshError(describe(exc), node=self.name, relation=relation, sqlstate=state) from None


async def _open(name: str, conn: Conn, config: Config) -> _Node:
    """Begin the node's transaction (kept local, with a lock timeout) and read its id and columns."""
    try:
        await set_local(conn)
        await conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(LOCK_TIMEOUT)))
        node_id = await read_node_id(conn, name)
        columns = await read_columns(conn, config)
    except psycopg.Error as exc:
        raise PgmeshError(describe(exc), node=name, sqlstate=exc.sqlstate) from None
    if node_id is None:
        raise PgmeshError("node id not assigned", node=name, hint="run pgmesh init")
    return _Node(name, conn, node_id, columns)


def _targets(config: Config, nodes: Sequence[_Node], tables: Sequence[str]) -> list[ColumnKey]:
    """The columns to convert: those of `tables`, or of every replicated table; each must be on every node."""
    found = sorted({key for node in nodes for key in node.columns})
    if tables:
        wanted = [split_table_name(t) for t in tables]
        for schema, table in wanted:
            relation = f"{schema}.{table}"
            if (schema, table, "") in found:  # a standalone sequence, named itself
                continue
            if not config.replicates(schema, table):
                raise ConfigError("is not replicated (see [replication] tables/exclude)", relation=relation)
            if not any(key[:2] == (schema, table) for key in found):
                raise PgmeshError(
                    "does not exist or has no serial, identity or nextval-default column (nor is it a"
                    " sequence no column default names)",
                    node=nodes[0].name,
                    relation=relation,
                )
        found = [key for key in found if key[:2] in wanted]
    for key in found:
        holders = [n.name for n in nodes if key in n.columns]
        for node in nodes:
            if key not in node.columns:
                what = f"column {key[2]} is not filled from a sequence" if key[2] else "no such sequence"
                raise PgmeshError(
                    f"{what} here (it is on node {', '.join(holders)})",
                    node=node.name,
                    relation=f"{key[0]}.{key[1]}",
                    hint="make the column the same on every node first" if key[2] else
                    "create the sequence on every node first (or drop it everywhere)",
                )
    return found


def _is_snowflake(column: SequenceColumn) -> bool:
    return column.kind == "snowflake" and column.increment == 1 and column.seq_type == "bigint"


async def _set_snowflake(node: _Node, column: SequenceColumn, floor: int) -> str:
    table = sql.Identifier(column.schema, column.table)
    ident = sql.Identifier(column.column)
    if column.seq_type != "bigint" or column.increment != 1:
        alter = sql.SQL("ALTER SEQUENCE {} AS bigint INCREMENT BY 1")
        await node.run(alter.format(sql.Identifier(column.seq_schema, column.seq_name)), column.relation)
    default = sql.SQL("ALTER TABLE {} ALTER COLUMN {} SET DEFAULT {}.snowflake_nextval({})")
    schema = sql.Identifier(PGMESH_SCHEMA)
    await node.run(default.format(table, ident, schema, _regclass(column)), column.relation)
    cur = await node.run(sql.SQL("SELECT max({}) FROM {}").format(ident, table), column.relation)
    row = await cur.fetchone()
    if row is not None and row[0] is not None and row[0] >= floor:
        raise PgmeshError(
            f"column {column.column} already holds {row[0]}, inside the snowflake range (from {floor})",
            node=node.name,
            relation=column.relation,
            hint="these ids could collide with snowflake ids: use --mode step for this table",
        )
    return f"node {node.name}: {column.relation}.{column.column}: {detect_mode(column)} -> snowflake"


async def _to_snowflake(nodes: Sequence[_Node], targets: Sequence[ColumnKey], step: int) -> list[str]:
    for node in nodes:
        for key in targets:
            problem = _snowflake_problem(node.name, node.columns[key])
            if problem is not None:
                raise problem
    function = sql.Literal(f"{PGMESH_SCHEMA}.snowflake_nextval(regclass)")
    for node in nodes:
        row = await (await node.run(sql.SQL("SELECT to_regprocedure({})").format(function))).fetchone()
        if row is None or row[0] is None:
            raise PgmeshError(f"{PGMESH_SCHEMA}.snowflake_nextval is not installed", node=node.name,
                              hint="run pgmesh init")
    floor = snowflake_floor(int(time.time() * 1000))
    lines: list[str] = []
    for key in targets:
        todo = [node for node in nodes if not _is_snowflake(node.columns[key])]
        if not todo:
            lines.append(f"{nodes[0].columns[key].label}: already snowflake on every node, nothing changed")
        for node in todo:
            lines.append(await _set_snowflake(node, node.columns[key], floor))
    return lines


def _increment(column: SequenceColumn, step: int) -> sql.Composed:
    if column.identity:
        return sql.SQL("ALTER TABLE {} ALTER COLUMN {} SET INCREMENT BY {}").format(
            sql.Identifier(column.schema, column.table), sql.Identifier(column.column), sql.Literal(step)
        )
    return sql.SQL("ALTER SEQUENCE {} INCREMENT BY {}").format(
        sql.Identifier(column.seq_schema, column.seq_name), sql.Literal(step)
    )


async def _lock_and_read(nodes: Sequence[_Node], keys: Sequence[ColumnKey], step: int) -> dict[str, int]:
    """On every node: stop inserts into the tables and nextval on their sequences (until commit), then
    read the highest value each sequence has handed out or its column holds. Sequence -> highest."""
    names = sorted({key[:2] for key in keys if key[2]})  # (a standalone sequence has no table to lock)
    tables = sql.SQL(", ").join(sql.Identifier(s, t) for s, t in names)
    high: dict[str, int] = {}
    for node in nodes:
        if names:
            await node.run(sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(tables))
        for key in keys:
            column = node.columns[key]
            await node.run(_increment(column, step), column.relation)  # holds the sequence's lock
            sequence = sql.Identifier(column.seq_schema, column.seq_name)
            query = sql.SQL("SELECT last_value FROM {}").format(sequence) if column.standalone else sql.SQL(
                "SELECT max({}), (SELECT last_value FROM {}) FROM {}").format(
                sql.Identifier(column.column), sequence, sql.Identifier(column.schema, column.table))
            row = await (await node.run(query, column.relation)).fetchone()
            seen = max(int(v) for v in row if v is not None)
            high[column.sequence] = max(high.get(column.sequence, seen), seen)
    return high


async def _restart(node: _Node, column: SequenceColumn, step: int, above: int) -> str:
    value = first_in_progression(above, step, node.node_id)
    limit = min(column.max_value, _INT_MAX[column.type])
    if value > limit:
        raise PgmeshError(
            f"column {column.column} would restart at {value}, past its maximum {limit}",
            node=node.name,
            relation=column.relation,
            hint="use a bigint column (and sequence), or a smaller step",
        )
    table = sql.Identifier(column.schema, column.table)
    ident = sql.Identifier(column.column)
    literal = sql.Literal(value)
    if column.identity:
        restart = sql.SQL("ALTER TABLE {} ALTER COLUMN {} SET START WITH {} RESTART WITH {}")
        await node.run(restart.format(table, ident, literal, literal), column.relation)
    else:
        restart = sql.SQL("ALTER SEQUENCE {} START WITH {} RESTART WITH {}")
        sequence = sql.Identifier(column.seq_schema, column.seq_name)
        await node.run(restart.format(sequence, literal, literal), column.relation)
    if column.kind == "snowflake":
        default = sql.SQL("ALTER TABLE {} ALTER COLUMN {} SET DEFAULT nextval({})")
        await node.run(default.format(table, ident, _regclass(column)), column.relation)
    after = Mode("step", step, node.node_id)
    return f"node {node.name}: {column.label}: {detect_mode(column)} -> {after}, next value {value}"


async def _to_step(nodes: Sequence[_Node], targets: Sequence[ColumnKey], step: int) -> list[str]:
    top = max(nodes, key=lambda n: n.node_id)
    if step <= top.node_id:
        raise ConfigError(
            f"sequences.step = {step} must be greater than every node id (node {top.name} has {top.node_id})",
            hint=f"set [sequences] step to at least {top.node_id + 1}",
        )
    for node in nodes:
        for key in targets:
            problem = _step_problem(node.name, node.columns[key])
            if problem is not None:
                raise problem
    lines: list[str] = []
    todo: list[ColumnKey] = []
    for key in targets:
        if all(detect_mode(n.columns[key]) == Mode("step", step, n.node_id) for n in nodes):
            lines.append(f"{nodes[0].columns[key].label}: already step {step} on every node, nothing changed")
        else:
            todo.append(key)  # on every node: a node left as it was could hand out another's next ids
    if todo:
        high = await _lock_and_read(nodes, todo, step)
        for node in nodes:
            for key in todo:
                column = node.columns[key]
                lines.append(await _restart(node, column, step, high[column.sequence]))
    return lines


async def _commit(nodes: Sequence[_Node]) -> None:
    committed: list[str] = []
    for node in nodes:
        try:
            await node.conn.commit()
        except psycopg.Error as exc:
            done = ", ".join(committed) or "none"
            raise PgmeshError(
                f"commit failed ({describe(exc)}); nodes already committed: {done}",
                node=node.name,
                sqlstate=exc.sqlstate,
                hint="run pgmesh sequences convert again: it converts whatever is left",
            ) from None
        committed.append(node.name)


async def _convert_once(config: Config, mode: str, tables: Sequence[str]) -> list[str]:
    conns = await connect_all(config, autocommit=False)
    try:
        nodes = [await _open(name, conn, config) for name, conn in conns.items()]
        targets = _targets(config, nodes, tables)
        if not targets:
            return ["no replicated table has a serial, identity or nextval-default column, and no other"
                    " sequence is in a replicated schema; nothing to do"]
        if mode == "snowflake":  # a standalone sequence: step (see the module docstring)
            columns = [key for key in targets if key[2]]
            alone = [key for key in targets if not key[2]]
            lines = await _to_snowflake(nodes, columns, config.sequences.step) if columns else []
            if alone:
                lines += [f"{nodes[0].columns[key].label}: no column default names it (its callers run"
                          " nextval() themselves), so snowflake ids cannot reach them: converted to step mode"
                          for key in alone]
                lines += await _to_step(nodes, alone, config.sequences.step)
        else:
            lines = await _to_step(nodes, targets, config.sequences.step)
        await _commit(nodes)
    finally:
        await close_all(conns)  # whatever was not committed rolls back
    return lines


async def convert_sequences(config: Config, mode: str | None = None, tables: Sequence[str] = ()) -> list[str]:
    """Convert the sequence-backed columns of `tables` (default: every replicated table) on every node to
    `mode` (default: the config's); idempotent. One line per change, or one per column left as it was."""
    chosen = mode or config.sequences.mode
    if chosen not in SEQUENCE_MODES:
        raise ConfigError(f"mode {chosen!r} is not one of {', '.join(SEQUENCE_MODES)}")
    for attempt in range(1, ATTEMPTS + 1):
        try:
            lines = await _convert_once(config, chosen, tables)
        except PgmeshError as exc:
            if attempt == ATTEMPTS or exc.sqlstate is None or decide(exc) is not Action.RETRY:
                raise
            logger.warning("sequences convert: %s; trying again", exc)
            await asyncio.sleep(0.5 * attempt)
            continue
        for line in lines:
            logger.info("%s", line)
        return lines
    raise AssertionError("unreachable")


async def to_local(conn: Conn, config: Config) -> list[str]:
    """A node leaving pgmesh (`pgmesh part --clean`): each snowflake column's default becomes its own
    sequence again, restarted above the column's highest id (the snowflake function goes with pgmesh's
    schema). One line per column."""
    lines: list[str] = []
    for column in (await read_columns(conn, config)).values():
        if column.kind != "snowflake":
            continue
        table, ident = sql.Identifier(column.schema, column.table), sql.Identifier(column.column)
        default = sql.SQL("ALTER TABLE {} ALTER COLUMN {} SET DEFAULT pg_catalog.nextval({})")
        await conn.execute(default.format(table, ident, _regclass(column)))
        cur = await conn.execute(sql.SQL("SELECT pg_catalog.setval({}, max({})) FROM {} HAVING max({}) > 0")
                                 .format(_regclass(column), ident, table, ident))
        above = await cur.fetchone()
        lines.append(f"{column.relation}.{column.column}: snowflake -> its own sequence {column.sequence}"
                     + (f" (from {int(above[0]) + 1})" if above is not None else ""))
    return lines

