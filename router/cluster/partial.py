"""Partial nodes: a receive-only node that holds part of the data (docs/topology.md, "Partial nodes").

Under the node's `[[nodes]]`: `tables` (the replicated tables that reach it; unset: all), `rows` (per
table, a row filter: an SQL boolean over the table's columns, NULL counting as false, as a publication's
row filter) and `columns` (per table, the columns it holds; the others are NULL there). Only a receive-only
node may hold part of the data (router.config.parts): it sends nothing, so nothing it lacks can reach another
node, and every other node still holds everything.

Where each part is enforced:
- tables the node does not get: the router's links into it skip their changes (router.apply.link marks
  the target's table `skip`); nothing of them is sent.
- columns: a BEFORE INSERT OR UPDATE trigger there, `pgmesh_part_columns`, sets the others to NULL (the
  router still sends their values to the node, which drops them before they are written).
- rows: an AFTER INSERT OR UPDATE trigger there, `pgmesh_part_rows`, deletes a row the filter does not
  keep, in the applying transaction; pgmesh's tombstone trigger records that deletion under the remote
  change's version. So a key outside the filter is, on the partial node, a deleted key with the version of
  the change that took it out, and every later change of it is decided against that version exactly as a
  full node decides it against the row: an older change that would bring the row in loses; a newer one
  brings it in (an update of a key missing there re-creates the row, the trigger keeps it if it passes).
  Decisions against a missing row or a tombstone on a filtered table are not recorded in the node's
  conflict history (most are rows the filter keeps out, not conflicts: pgmesh.decide reads `pgmesh.part`).
Both triggers are ENABLE ALWAYS (they fire in the appliers' replica sessions).

Refused at init, each with the node and table: a name that is not a replicated table there; a row filter
PostgreSQL would refuse in a publication (checked by creating one, rolled back: only columns, constants and
immutable built-in functions); a row filter on a table without a primary key, or with another unique key
(rows the node lacks could not meet the rows it holds on that key as they meet on full nodes); a column
list leaving out a column of a key or unique index (expressions and predicates included), a NOT NULL
column, or a generated one; a row filter naming a column the list leaves out (it sees the row as held).

`pgmesh init` also makes rows already there fit (a node made partial after it held everything): those the
filter drops are deleted, left-out columns set to NULL, under an origin of their own (not the node's own
writes for its recorder) and without tombstones (as the join's copy).

Must not: decide links (the supervisor does), or put a DSN in a message.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Final

import msgspec
import psycopg
from psycopg import sql

from router.config.model import PGMESH_SCHEMA, Config, NodeConfig
from router.errors import ConfigError
from router.nodes.connect import Conn

__all__ = ["PART_TABLE", "TablePart", "ensure_partial", "is_partial", "reaches", "table_part"]

PART_TABLE: Final = "part"  # pgmesh.part: this node's filtered tables (read by pgmesh.decide)
ROWS_TRIGGER: Final = "pgmesh_part_rows"
COLUMNS_TRIGGER: Final = "pgmesh_part_columns"


class TablePart(msgspec.Struct, frozen=True):
    """What a partial node holds of one table it gets."""

    table: str  # schema.table
    rows: str | None  # the row filter (None: every row)
    columns: tuple[str, ...] | None  # the columns it holds (None: every column)


def is_partial(node: NodeConfig) -> bool:
    return node.tables is not None or bool(node.rows) or bool(node.columns)


def reaches(node: NodeConfig, qualified: str) -> bool:
    """Whether the changes of replicated table `qualified` ("schema.table") go to `node`."""
    return node.tables is None or qualified in node.tables


def table_part(node: NodeConfig, qualified: str) -> TablePart | None:
    """The part of `qualified` that `node` holds; None where it holds all of it (or none: `reaches`)."""
    rows = node.rows.get(qualified)
    columns = node.columns.get(qualified)
    if rows is None and columns is None:
        return None
    return TablePart(qualified, rows, tuple(columns) if columns is not None else None)


_PART_DDL: Final = """
CREATE TABLE IF NOT EXISTS {schema}.part (table_name text PRIMARY KEY, row_filter text, columns text[])
"""
# the table's columns: name, NOT NULL, generated, in a primary key or unique index; and whether it has a
# primary key, and another unique index
_COLUMNS: Final = """
SELECT a.attname::text, a.attnotnull, a.attgenerated <> '',
       EXISTS (SELECT FROM pg_catalog.pg_index i WHERE i.indrelid = c.oid AND i.indisunique
                 AND (a.attnum = ANY (i.indkey) OR EXISTS (  -- in an expression or a predicate
                   SELECT FROM pg_catalog.pg_depend d WHERE d.classid = 'pg_catalog.pg_class'::regclass
                      AND d.objid = i.indexrelid AND d.refobjid = c.oid AND d.refobjsubid = a.attnum)))
  FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
  JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
 WHERE n.nspname = %s AND c.relname = %s ORDER BY a.attnum
"""
_KEYS: Final = """
SELECT i.indisprimary, ARRAY(SELECT a.attname::text FROM unnest(i.indkey) WITH ORDINALITY AS k(num, ord)
                               JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.num
                              ORDER BY k.ord)
  FROM pg_catalog.pg_index i
 WHERE i.indrelid = %s::regclass AND i.indisunique
"""
_OLD_FUNCTIONS: Final = """
SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p
 WHERE p.pronamespace = %s::regnamespace AND p.proname LIKE 'part\\_%%'
"""


def _function_name(qualified: str, kind: str) -> sql.Identifier:
    return sql.Identifier(PGMESH_SCHEMA, f"part_{hashlib.md5(qualified.encode()).hexdigest()[:20]}_{kind}")


async def ensure_partial(
    conn: Conn, config: Config, node: str, tables: Sequence[tuple[str, str]]
) -> list[str]:
    """In the install's transaction: `node`'s part of the data as the config says (pgmesh.part, the
    triggers, the rows already there made to fit); one line if it holds part of it."""
    schema = sql.Identifier(PGMESH_SCHEMA)
    for (name,) in await (await conn.execute(_OLD_FUNCTIONS, [PGMESH_SCHEMA])).fetchall():
        await conn.execute(sql.SQL("DROP FUNCTION {} CASCADE").format(sql.SQL(name)))  # its triggers too
    spec = config.node(node)
    if not is_partial(spec):  # (only a partial node has pgmesh.part: pgmesh.decide reads it where it is)
        await conn.execute(sql.SQL("DROP TABLE IF EXISTS {}.part").format(schema))
        return []
    await conn.execute(sql.SQL(_PART_DDL).format(schema=schema))
    await conn.execute(sql.SQL("DELETE FROM {}.part").format(schema))
    replicated = {f"{s}.{t}": (s, t) for s, t in tables}
    named = set(spec.tables or ()) | set(spec.rows) | set(spec.columns)
    for qualified in sorted(named - set(replicated)):
        raise ConfigError(f"{qualified} is named in the node's tables, rows or columns but is not a"
                          " replicated table there", node=node,
                          hint="name replicated tables only, as schema.table")
    parts = []
    for qualified, (table_schema, table) in sorted(replicated.items()):
        part = table_part(spec, qualified)
        if part is None or not reaches(spec, qualified):
            continue
        parts.append(await _install_part(conn, config, node, part, table_schema, table))
    got = len([q for q in replicated if reaches(spec, q)])
    line = f"holds part of the data: {got} of {len(replicated)} replicated tables"
    return [line + "".join(f"; {p}" for p in parts)]


async def _install_part(
    conn: Conn, config: Config, node: str, part: TablePart, table_schema: str, table: str
) -> str:
    qualified = part.table
    ident = sql.Identifier(table_schema, table)
    cur = await conn.execute(_COLUMNS, [table_schema, table])
    columns = {name: (notnull, generated, keyed) for name, notnull, generated, keyed in await cur.fetchall()}
    keys = await (await conn.execute(_KEYS, [ident.as_string(conn)])).fetchall()
    pk = next((list(cols) for primary, cols in keys if primary), None)

    def refuse(why: str, hint: str) -> ConfigError:
        return ConfigError(why, node=node, relation=qualified, hint=hint)

    left_out: list[str] = []
    if part.columns is not None:
        for name in part.columns:
            if name not in columns:
                raise refuse(f"the column list names {name!r}, which the table does not have",
                             "list the table's columns")
        left_out = [c for c in columns if c not in part.columns]
        for name in left_out:
            notnull, generated, keyed = columns[name]
            if keyed or notnull or generated:
                what = "a key or unique index" if keyed else "NOT NULL" if notnull else "generated"
                raise refuse(f"column {name!r} is left out of the column list but is {what}",
                             "a partial node holds NULL in the columns it does not get: list this one")
    if part.rows is not None:
        if pk is None:
            raise refuse("a row filter needs a primary key", "add a primary key, or hold the whole table")
        if len(keys) > 1:
            raise refuse("a row filter on a table with a unique key besides the primary key",
                         "rows the node lacks could not meet the rows it holds on that key as they do"
                         " on the other nodes: hold the whole table")
        used = await _check_filter(conn, ident, part.rows, refuse)
        if hidden := [c for c in used if c in left_out]:
            raise refuse(f"the row filter names {', '.join(hidden)}, left out of the column list",
                         "the filter sees the row as the node holds it: list those columns too")
    await _fit_rows(conn, config, ident, part.rows, left_out)
    said = []
    if left_out:
        assert part.columns is not None
        await _columns_trigger(conn, qualified, ident, part.columns)
        said.append(f"{len(columns) - len(left_out)} of {len(columns)} columns of {qualified}")
    if part.rows is not None:
        assert pk is not None
        await _rows_trigger(conn, qualified, ident, part.rows, pk)
        said.append(f"rows of {qualified} where {part.rows}")
    insert = sql.SQL("INSERT INTO {}.part VALUES (%s, %s, %s)").format(sql.Identifier(PGMESH_SCHEMA))
    await conn.execute(insert, [qualified, part.rows, list(part.columns) if part.columns else None])
    return ", ".join(said)


async def _check_filter(conn: Conn, ident: sql.Identifier, rows: str, refuse: Any) -> list[str]:
    """PostgreSQL's own rules for a publication's row filter, by creating one and rolling it back; the
    columns the filter names."""
    await conn.execute("SAVEPOINT pgmesh_part_check")
    try:
        await conn.execute(sql.SQL("CREATE PUBLICATION pgmesh_part_check FOR TABLE {} WHERE ({})").format(
            ident, sql.SQL(rows)))  # the user's expression, as a publication takes it (checked there)
    except psycopg.Error as exc:
        await conn.execute("ROLLBACK TO SAVEPOINT pgmesh_part_check")
        said = [exc.diag.message_primary or type(exc).__name__, exc.diag.message_detail or ""]
        raise refuse(f"the row filter is refused: {': '.join(s for s in said if s)}",
                     "only columns, constants and immutable built-in functions, as in a publication's"
                     " row filter") from None
    cur = await conn.execute(_FILTER_COLUMNS)
    used = [name for (name,) in await cur.fetchall()]
    await conn.execute("ROLLBACK TO SAVEPOINT pgmesh_part_check")
    return used


# the columns the check publication's row filter names (its dependencies on the table's columns)
_FILTER_COLUMNS: Final = """
SELECT DISTINCT a.attname::text FROM pg_catalog.pg_publication_rel pr
  JOIN pg_catalog.pg_publication p ON p.oid = pr.prpubid AND p.pubname = 'pgmesh_part_check'
  JOIN pg_catalog.pg_depend d ON d.classid = 'pg_catalog.pg_publication_rel'::regclass AND d.objid = pr.oid
  JOIN pg_catalog.pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
 ORDER BY 1
"""


async def _fit_rows(
    conn: Conn, config: Config, ident: sql.Identifier, rows: str | None, left_out: list[str]
) -> None:
    """Make the rows already there fit the part: in a replica session (no refusal trigger), without
    tombstones (pgmesh.recording), and under an origin of its own, `pgmeshfit_<cluster>`, left set up on
    the install's session until it ends: a transaction's origin is its commit record's, and the node's
    tombstone recorder must not take these deletions for the node's own (its own origin is busy while
    the router runs)."""
    if rows is None and not left_out:
        return
    origin = f"pgmeshfit_{config.cluster.name}"
    await conn.execute("SELECT pg_catalog.pg_replication_origin_create(%s)"
                       " WHERE pg_catalog.pg_replication_origin_oid(%s) IS NULL", [origin, origin])
    await conn.execute("SELECT pg_catalog.pg_replication_origin_session_setup(%s)"
                       " WHERE NOT pg_catalog.pg_replication_origin_session_is_setup()", [origin])
    await conn.execute("SELECT pg_catalog.set_config('session_replication_role', 'replica', true),"
                       " pg_catalog.set_config('pgmesh.recording', 'y', true)")
    if rows is not None:
        drop = sql.SQL("DELETE FROM {} WHERE NOT coalesce(({}), false)")
        await conn.execute(drop.format(ident, sql.SQL(rows)))
    if left_out:
        sets = sql.SQL(", ").join(sql.SQL("{} = NULL").format(sql.Identifier(c)) for c in left_out)
        some = sql.SQL(" OR ").join(sql.SQL("{} IS NOT NULL").format(sql.Identifier(c)) for c in left_out)
        await conn.execute(sql.SQL("UPDATE {} SET {} WHERE {}").format(ident, sets, some))
    await conn.execute("SELECT pg_catalog.set_config('session_replication_role', 'origin', true),"
                       " pg_catalog.set_config('pgmesh.recording', '', true)")


_FUNCTION: Final = """
CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $body$
BEGIN
{body}
END
$body$
"""


async def _columns_trigger(conn: Conn, qualified: str, ident: sql.Identifier, listed: Sequence[str]) -> None:
    """Every column but `listed` set to NULL, those added by DDL later included (named at each row)."""
    function = _function_name(qualified, "columns")
    names = sql.SQL(", ").join(sql.Literal(c) for c in listed)
    body = sql.SQL(
        "  NEW := pg_catalog.jsonb_populate_record(NEW, (\n"
        "    SELECT coalesce(pg_catalog.jsonb_object_agg(k, NULL), '{{}}')\n"
        "      FROM pg_catalog.jsonb_object_keys(pg_catalog.to_jsonb(NEW)) AS k\n"
        "     WHERE k <> ALL (ARRAY[{}])));\n"
        "  RETURN NEW;"
    ).format(names)
    await conn.execute(sql.SQL(_FUNCTION).format(function=function, body=body))
    await _trigger(conn, COLUMNS_TRIGGER, "BEFORE", ident, function)


async def _rows_trigger(conn: Conn, qualified: str, ident: sql.Identifier, rows: str, pk: list[str]) -> None:
    function = _function_name(qualified, "rows")
    key = sql.SQL(", ").join(sql.Identifier(k) for k in pk)
    new_key = sql.SQL(", ").join(sql.SQL("NEW.{}").format(sql.Identifier(k)) for k in pk)
    body = sql.SQL(
        "  IF NOT coalesce((SELECT ({rows}) FROM (SELECT NEW.*) AS pgmesh_r), false) THEN\n"
        "    DELETE FROM {table} WHERE ({key}) = ({new_key});\n"
        "  END IF;\n"
        "  RETURN NULL;"
    ).format(rows=sql.SQL(rows), table=ident, key=key, new_key=new_key)
    await conn.execute(sql.SQL(_FUNCTION).format(function=function, body=body))
    await _trigger(conn, ROWS_TRIGGER, "AFTER", ident, function)


async def _trigger(conn: Conn, name: str, when: str, ident: sql.Identifier, function: sql.Identifier) -> None:
    trigger = sql.Identifier(name)
    await conn.execute(sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(trigger, ident))
    create = "CREATE TRIGGER {} {} INSERT OR UPDATE ON {} FOR EACH ROW EXECUTE FUNCTION {}()"
    await conn.execute(sql.SQL(create).format(trigger, sql.SQL(when), ident, function))
    await conn.execute(sql.SQL("ALTER TABLE {} ENABLE ALWAYS TRIGGER {}").format(ident, trigger))
