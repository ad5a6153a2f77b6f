"""SQL for the changes of a decoded source transaction: one statement per change, pure text, no I/O.

Each change becomes one statement (or two: a single guarded insert takes its locks first), as text or
as an EXECUTE of a statement prepared once per session (`Prepared`); `router.apply.scripts` puts them
together into the target transaction. Also here: the conflict guards' SQL (`guard`, the advisory
locks), the origin's `pg_replication_origin_xact_setup`, and the target's tables as the applier
found them (`TargetTable`).

Values arrive from pgoutput in text mode and are written as quoted literals that PostgreSQL coerces to
the target column's type with the type's input function, exactly as COPY or the native apply worker
would. Identifiers are always quoted. Columns are matched by name: a column the target lacks is an
`ApplyError` naming table and column. An unchanged-TOAST cell leaves its column out of the UPDATE.

Must not: connect, retry, decide conflicts, or know which node it runs for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from protocol.lsn import format_lsn, pg_us_to_datetime
from protocol.messages import (
    KIND_BINARY,
    KIND_NULL,
    KIND_TEXT,
    KIND_UNCHANGED,
    Delete,
    Insert,
    Relation,
    Truncate,
    TupleData,
    Update,
)
from protocol.transactions import Transaction
from router.errors import ApplyError, SchemaMismatch

__all__ = [
    "COMMIT_ALIAS", "KEY_LOCKS_MAX", "REMOTE_ALIAS", "RESERVED_NAMES", "TABLE_ALIAS", "TOMBSTONE_ALIAS",
    "Prepared", "TargetTable", "UniqueIndex", "delete_statement", "guard", "identity_match", "insert_rows",
    "key_lock", "prepared_delete", "prepared_insert", "prepared_update", "quote_ident", "quote_literal",
    "setup_args", "table_lock", "target_table", "tombstone_key", "truncate_statement", "typed",
    "update_statement", "xact_setup_sql",
]

# The source's values for GENERATED ALWAYS identity columns are the row's values (as the native apply
# worker applies them); harmless for tables without identity columns.
_OVERRIDING: Final = "OVERRIDING SYSTEM VALUE"

# Built-in types (and their arrays) without an equality operator, or whose `=` is not sameness (box,
# circle, lseg... compare areas or lengths): compared through their text form in whole-row matches.
_NO_EQUALITY: Final = frozenset({114, 199, 142, 143,  # json, xml, then the geometric types
    600, 1017, 601, 1018, 602, 1019, 603, 1020, 604, 1027, 628, 629, 718, 719,  # refcursor, txid_snapshot,
    1790, 2201, 2970, 2949, 4072, 4073, 5038, 5039})  # jsonpath, pg_snapshot (each with its array)
# Types made by users (enums, composites, ranges, domains and their arrays) get OIDs from here: a
# composite's `=` needs every field's, which it may not have; a whole-row match compares their text.
_FIRST_USER_OID: Final = 16384


# pgmesh's own names in the SQL it generates. Every column reference is qualified by its table's alias
# (and every function call by its schema), so that no user column, whatever its name, resolves in place
# of one of them; the aliases are quoted `pgmesh_` names besides (issue 17: a user column `c` once took
# the place of the lateral commit timestamp `c` in `(c).timestamp`).
TABLE_ALIAS: Final = '"pgmesh_t"'  # the replicated table
VALUES_ALIAS: Final = '"pgmesh_v"'  # the rows of a guarded insert, columns "pgmesh_c0", "pgmesh_c1", ...
TOMBSTONE_ALIAS: Final = '"pgmesh_ts"'  # pgmesh.tombstones
COMMIT_ALIAS: Final = '"pgmesh_c"'  # pg_xact_commit_timestamp_origin(xmin): "timestamp", roident
FULL_ALIAS: Final = '"pgmesh_f"'  # the replicated table again, in a REPLICA IDENTITY FULL match
REMOTE_ALIAS: Final = '"pgmesh_r"'  # a remote row as a one-row VALUES, for unique indexes' expressions
RESERVED_NAMES: Final = frozenset(
    {"pgmesh_t", "pgmesh_v", "pgmesh_ts", "pgmesh_c", "pgmesh_f", "pgmesh_w", "pgmesh_r"}
)  # (and the row labels of router.apply.careful, and the columns "pgmesh_c<i>" of pgmesh_v)


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def quote_literal(value: str) -> str:
    """A standard-conforming string literal (the session sets standard_conforming_strings = on)."""
    return "'" + value.replace("'", "''") + "'"


# A unique index with a predicate or on expressions, as the target's catalog deparses it: its key terms
# (a column's name or an expression: pg_get_indexdef(index, k, true)) and its predicate (or None), their
# column references unqualified (evaluated where one relation is in scope: router.apply.uniques).
UniqueIndex = tuple[tuple[str, ...], str | None]


class TargetTable:
    """What the target has for one replicated table: names, column types, primary and unique keys."""

    __slots__ = (
        "_fits", "columns", "compare", "indexes", "name", "partitioned", "pk", "qualified", "tombstone_key",
        "types", "uniques",
    )

    def __init__(
        self,
        schema: str,
        name: str,
        columns: frozenset[str],
        types: Mapping[str, str] | None = None,
        pk: tuple[str, ...] = (),
        uniques: tuple[tuple[str, ...], ...] = (),
        *,
        partitioned: bool = False,
        bases: Mapping[str, str] | None = None,
        indexes: tuple[UniqueIndex, ...] = (),
    ) -> None:
        self.name = f"{schema}.{name}"  # as pgmesh.tombstones and pgmesh.conflict_history name it
        self.partitioned = partitioned  # a partitioned root: a ctid names a row only with its tableoid
        self.qualified = f"{quote_ident(schema)}.{quote_ident(name)}"
        self.columns = columns
        self.types = dict(types or {})
        # the types values are compared and keyed as: a domain's base type (no CHECK of it runs there)
        self.compare = {**self.types, **(bases or {})}
        self.pk = pk
        self.uniques = uniques  # the other unique keys: plain column lists
        self.indexes = indexes  # the unique indexes with a predicate or on expressions
        # Relation descriptions already checked against this table, by id() (each kept alive here so
        # that its id stays its own): the check runs once per relation version, not once per row.
        self._fits: dict[int, Relation] = {}
        # the columns the tombstone trigger keys deletions by: the primary key, else every column
        self.tombstone_key = pk or tuple(self.types) or tuple(sorted(columns))


def _literal(relation: Relation, row: TupleData, i: int) -> str:
    kind = row.kinds[i]
    if kind == KIND_NULL:
        return "NULL"
    value = row.values[i]
    if kind == KIND_BINARY or not isinstance(value, bytes):
        raise ApplyError(
            f"column {relation.columns[i].name} arrived as {chr(kind)!r}, expected text",
            relation=f"{relation.schema}.{relation.name}",
        )
    return quote_literal(value.decode())


def _literals(relation: Relation, row: TupleData, columns: Sequence[int]) -> list[str]:
    """`_literal` of each of `columns`, the common kinds inline (the applier's hottest loop)."""
    kinds = row.kinds
    values = row.values
    out: list[str] = []
    for i in columns:
        kind = kinds[i]
        value = values[i]
        if kind == KIND_TEXT and isinstance(value, bytes):
            out.append("'" + value.decode().replace("'", "''") + "'")
        elif kind == KIND_NULL:
            out.append("NULL")
        else:
            out.append(_literal(relation, row, i))
    return out


def _check_columns(relation: Relation, table: TargetTable) -> None:
    missing = [c.name for c in relation.columns if c.name not in table.columns]
    if missing:
        raise SchemaMismatch(
            f"the target has no column {', '.join(missing)}",
            relation=f"{relation.schema}.{relation.name}",
            hint="add the column on the target (or drop it on the source), then `pgmesh resume`",
        )


def typed(literal: str, kind: str | None) -> str:
    """`literal` cast to the target column's type `kind` (format_type), when known: untyped, a literal
    compared with a composite (or a domain over one) is read as `record` (`record = record`), which
    fails ("input of anonymous composite types is not implemented")."""
    return literal if kind is None or literal == "NULL" else f"{literal}::{kind}"


def identity_match(
    relation: Relation,
    row: TupleData,
    *,
    full: bool,
    alias: str = TABLE_ALIAS,
    types: Mapping[str, str] | None = None,
) -> str:
    """WHERE clause matching the row by its key columns, or by every column under REPLICA IDENTITY FULL;
    the columns qualified by `alias`, the table's alias in the statement, the values cast to `types`
    (the target's column types, by name). In a whole-row match a column whose type has no sameness
    `=` (`_NO_EQUALITY`, or a type made by users) is compared by its text form."""
    types = types or {}
    parts = []
    for i, column in enumerate(relation.columns):
        if not full and not column.key:
            continue
        if row.kinds[i] == KIND_UNCHANGED:
            continue
        name = f"{alias}.{quote_ident(column.name)}"
        literal = _literal(relation, row, i)
        kind = types.get(column.name)
        if literal == "NULL":
            parts.append(f"{name} IS NULL")
        elif column.type_oid in _NO_EQUALITY or (full and column.type_oid >= _FIRST_USER_OID):
            parts.append(f"{name}::text = {'(' + typed(literal, kind) + ')::text' if kind else literal}")
        else:
            parts.append(f"{name} = {typed(literal, kind)}")
    if not parts:
        raise ApplyError("change without any key value", relation=f"{relation.schema}.{relation.name}")
    return " AND ".join(parts)


def _where(
    relation: Relation, table: TargetTable, old: TupleData | None, new: TupleData, kind: str | None
) -> str:
    if kind == "O" and old is not None:
        # REPLICA IDENTITY FULL: rows may repeat; touch exactly one, as the source did.
        match = identity_match(relation, old, full=True, alias=FULL_ALIAS, types=table.compare)
        if table.partitioned:  # every partition has its own ctids: the row is (tableoid, ctid)
            return (
                f"({TABLE_ALIAS}.tableoid, {TABLE_ALIAS}.ctid) = (SELECT {FULL_ALIAS}.tableoid,"
                f" {FULL_ALIAS}.ctid FROM {table.qualified} AS {FULL_ALIAS} WHERE {match} LIMIT 1)"
            )
        return (  # a plain table: ctid alone, which keeps the outer scan a TID scan
            f"{TABLE_ALIAS}.ctid = (SELECT {FULL_ALIAS}.ctid FROM {table.qualified} AS {FULL_ALIAS}"
            f" WHERE {match} LIMIT 1)"
        )
    return identity_match(relation, old if old is not None else new, full=False, types=table.compare)


def _origin_check(origin: str) -> str:
    """SQL true when the row's xmin was committed under `origin` (SQL for an origin id); any other row
    goes to `pgmesh.expect_origin`, which accepts it or raises PGM01. The common case never calls
    PL/pgSQL (a function call per row was a third of a guarded update's cost on the target)."""
    return (
        f"CASE WHEN (pg_catalog.pg_xact_commit_timestamp_origin({TABLE_ALIAS}.xmin)).roident = {origin}"
        f" THEN true ELSE pgmesh.expect_origin({TABLE_ALIAS}.xmin, {origin}) END"
    )


def _rows_check(wanted: int | str) -> str:
    """The final SELECT of a guarded statement: `pgmesh.expect_rows` raises PGM02 unless the
    `pgmesh_w` CTE returned exactly `wanted` rows (only called when the count is off)."""
    return (
        f"SELECT CASE WHEN pg_catalog.count(*) = {wanted} THEN NULL"
        f" ELSE pgmesh.expect_rows(pg_catalog.count(*), {wanted}) END FROM pgmesh_w"
    )


def guard(statement: str, origin: str | None, wanted: int = 1) -> str:
    """Wrap a DML statement (which must end in `WHERE ...`) so that a conflict raises instead of passing.

    The row must have been last written by the source (`pgmesh.expect_origin`, PGM01) and exactly
    `wanted` rows must be touched (`pgmesh.expect_rows`, PGM02): anything else is a conflict, handled by
    the applier's careful path. `origin` is SQL for the source's origin id (a literal or a parameter);
    without one the statement is returned as is.
    """
    if origin is None:
        return statement
    return f"WITH pgmesh_w AS ({statement} AND {_origin_check(origin)} RETURNING 1) {_rows_check(wanted)}"


def update_statement(relation: Relation, table: TargetTable, change: Update) -> str:
    sets = [
        f"{quote_ident(c.name)} = {_literal(relation, change.new, i)}"
        for i, c in enumerate(relation.columns)
        if change.new.kinds[i] != KIND_UNCHANGED
    ]
    where = _where(relation, table, change.old, change.new, change.old_kind)
    return f"UPDATE {table.qualified} AS {TABLE_ALIAS} SET {', '.join(sets)} WHERE {where}"


def delete_statement(relation: Relation, table: TargetTable, change: Delete) -> str:
    where = _where(relation, table, change.old, change.old, change.old_kind)
    return f"DELETE FROM {table.qualified} AS {TABLE_ALIAS} WHERE {where}"


_SETUP_KEY: Final = (0, "S", b"")  # the origin's xact_setup in `Prepared` (no relation has id 0)


class Prepared:
    """Server-side prepared statements of one target session, by (relation version, shape).

    A prepared statement is planned once; afterwards each row costs the server only the parse of a
    short EXECUTE. The cache lives as long as the session: a new session needs a new `Prepared`.
    Names never repeat within a session; `forget_since(mark)` drops names whose PREPARE was never sent.
    """

    __slots__ = ("_counter", "_names", "_order", "_relations", "insert_plans", "plans")

    def __init__(self) -> None:
        self._names: dict[tuple[int, str, bytes], str] = {}
        # (id(relation), shape, row kinds) -> (name, parameter columns...): skips working out the
        # shape of a row seen before (ids stay unique: `_relations` keeps the relations alive)
        self.plans: dict[tuple[int, str, bytes], tuple[str, list[int], list[int]]] = {}
        # id(relation) -> insert, key positions, key types
        self.insert_plans: dict[int, tuple[str, list[int], list[str]]] = {}
        self._order: list[tuple[int, str, bytes]] = []
        self._relations: dict[int, Relation] = {}  # keeps the keyed relations alive (ids stay unique)
        self._counter = 0

    def name(
        self, relation: Relation, shape: str, mask: bytes, build: Callable[[], str], out: list[str]
    ) -> str:
        key = (id(relation), shape, mask)
        name = self._names.get(key)
        if name is None:
            name = self._new(key, build(), out)
            self._relations[id(relation)] = relation
        return name

    def setup(self, args: list[str], out: list[str]) -> str:
        """`xact_setup_sql` as an EXECUTE of a statement prepared once per session (planned once);
        `args` from `setup_args`."""
        name = self._names.get(_SETUP_KEY)
        if name is None:
            name = self._new(_SETUP_KEY, "SELECT pg_catalog.pg_replication_origin_xact_setup($1, $2)", out)
        return _execute(name, args)

    def _new(self, key: tuple[int, str, bytes], body: str, out: list[str]) -> str:
        self._counter += 1
        name = f"pgmesh_{self._counter}"
        self._names[key] = name
        self._order.append(key)
        out.append(f"PREPARE {name} AS {body}")
        return name

    def mark(self) -> int:
        return len(self._order)

    def forget_since(self, mark: int) -> None:
        if mark < len(self._order):
            self.plans.clear()  # some may name a statement forgotten here
            self.insert_plans.clear()
        for key in self._order[mark:]:
            del self._names[key]
        del self._order[mark:]


def _execute(name: str, literals: list[str]) -> str:
    return f"EXECUTE {name}({', '.join(literals)})"


def setup_args(txn: Transaction, origin_lsn: int | None) -> list[str]:
    """The origin's position and commit time for `txn`'s target transaction, as SQL literals."""
    lsn = format_lsn(origin_lsn if origin_lsn is not None else txn.end_lsn)
    return [f"'{lsn}'", f"'{commit_time_literal(txn.commit_time)}'"]


def prepared_update(
    relation: Relation,
    table: TargetTable,
    change: Update,
    prepared: Prepared,
    out: list[str],
    origin: int | None = None,
) -> str:
    new = change.new
    row_key = change.old if change.old is not None else new
    cols = relation.columns
    shape = "U" if origin is None else "UG"
    plan = prepared.plans.get((id(relation), shape, new.kinds))
    if plan is not None:
        name, sets, keys = plan
        literals = _literals(relation, new, sets) + _literals(relation, row_key, keys)
        if origin is not None:
            literals.append(f"'{origin}'")
        return _execute(name, literals)
    sets = [i for i in range(len(cols)) if new.kinds[i] != KIND_UNCHANGED]
    keys = [i for i, c in enumerate(cols) if c.key]

    def build() -> str:
        assignments = ", ".join(f"{quote_ident(cols[i].name)} = ${n}" for n, i in enumerate(sets, 1))
        where = " AND ".join(
            f"{TABLE_ALIAS}.{quote_ident(cols[i].name)} = {typed(f'${n}', table.compare.get(cols[i].name))}"
            for n, i in enumerate(keys, len(sets) + 1)
        )
        statement = f"UPDATE {table.qualified} AS {TABLE_ALIAS} SET {assignments} WHERE {where}"
        return guard(statement, None if origin is None else f"${len(sets) + len(keys) + 1}")

    mask = bytes(1 if new.kinds[i] == KIND_UNCHANGED else 0 for i in range(len(cols)))
    name = prepared.name(relation, shape, mask, build, out)
    prepared.plans[(id(relation), shape, new.kinds)] = (name, sets, keys)
    literals = _literals(relation, new, sets) + _literals(relation, row_key, keys)
    if origin is not None:
        literals.append(f"'{origin}'")
    return _execute(name, literals)


def prepared_delete(
    relation: Relation,
    table: TargetTable,
    change: Delete,
    prepared: Prepared,
    out: list[str],
    origin: int | None = None,
) -> str:
    cols = relation.columns
    keys = [i for i, c in enumerate(cols) if c.key]

    def build() -> str:
        where = " AND ".join(
            f"{TABLE_ALIAS}.{quote_ident(cols[i].name)} = {typed(f'${n}', table.compare.get(cols[i].name))}"
            for n, i in enumerate(keys, 1)
        )
        statement = f"DELETE FROM {table.qualified} AS {TABLE_ALIAS} WHERE {where}"
        return guard(statement, None if origin is None else f"${len(keys) + 1}")

    name = prepared.name(relation, "D" if origin is None else "DG", b"", build, out)
    literals = _literals(relation, change.old, keys)
    if origin is not None:
        literals.append(f"'{origin}'")
    return _execute(name, literals)


# A transaction with more row changes than this locks whole tables, not keys: advisory locks held to
# commit fill the server's lock table (max_locks_per_transaction x max_connections) otherwise.
KEY_LOCKS_MAX: Final = 64


def key_lock(table: TargetTable, key_array: str) -> str:
    """The advisory lock on one key of `table` (`key_array`: SQL for its key as text[]). Every path
    that decides a key takes exactly this lock (router.apply.careful, the guarded inserts here)."""
    name = quote_literal(table.name + ":")
    return (
        f"pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended("
        f"{name} || pg_catalog.array_to_string({key_array}, ','), 0))"
    )


def tombstone_key(key_array: str) -> str:
    """A key (`key_array`: SQL for it as text[]) as pgmesh.tombstones holds it: a key too long for the
    table's index (a keyless table's whole row) by its md5, as the tombstone trigger stores it."""
    size = f"pg_catalog.octet_length(({key_array})::text) + 8 * pg_catalog.cardinality({key_array})"
    digest = f"ARRAY['pgmesh:md5:' || pg_catalog.md5(({key_array})::text)]"
    return f"(CASE WHEN {size} > 2000 THEN {digest} ELSE {key_array} END)"


def table_lock(table: TargetTable, *, exclusive: bool) -> str:
    """The advisory lock on a whole table that decisions on its keys share (router.apply.careful)."""
    mode = "" if exclusive else "_shared"
    name = quote_literal(table.name)
    return f"SELECT pg_catalog.pg_advisory_xact_lock{mode}(pg_catalog.hashtext({name}), 0)"


def insert_rows(
    relation: Relation, table: TargetTable, rows: list[Insert], guarded: bool = False, coarse: bool = False
) -> str:
    """One INSERT for a run of inserts into the same table (fewer statements for the server to parse).

    Guarded, a row whose key has a tombstone is not inserted and the statement raises PGM02 (a
    conflict: insert against a recent delete); an existing key raises unique_violation.
    """
    names = ", ".join(quote_ident(c.name) for c in relation.columns)
    width = range(len(relation.columns))
    values = ", ".join("(" + ", ".join(_literal(relation, r.new, i) for i in width) + ")" for r in rows)
    if not guarded or not table.types:
        return f"INSERT INTO {table.qualified} ({names}) {_OVERRIDING} VALUES {values}"
    aliases = ", ".join(f'"pgmesh_c{i}"' for i in width)
    position = {c.name: i for i, c in enumerate(relation.columns)}
    v, ts = VALUES_ALIAS, TOMBSTONE_ALIAS
    picks = ", ".join(
        f'{v}."pgmesh_c{i}"::{table.types.get(c.name, "text")}' for i, c in enumerate(relation.columns)
    )
    key = ", ".join(
        f'{v}."pgmesh_c{position[k]}"::{table.compare[k]}::text' for k in table.tombstone_key if k in position
    )
    where = (
        f"NOT EXISTS (SELECT 1 FROM pgmesh.tombstones AS {ts}"
        f" WHERE {ts}.table_name = {quote_literal(table.name)}"
        f" AND {ts}.key = {tombstone_key(f'ARRAY[{key}]::text[]')})"
    )
    # The careful path's lock per (table, key), taken in a statement of its own so that the insert's
    # tombstone check runs on a snapshot taken after the lock: an applier of another source deciding
    # the same key (possibly absent here) finishes first, and this insert then sees what it did.
    if coarse:  # a big transaction: the whole table, once
        lock = table_lock(table, exclusive=True)
    else:
        lock = (
            f"{table_lock(table, exclusive=False)};\n"
            f"SELECT pg_catalog.count({key_lock(table, f'ARRAY[{key}]::text[]')})"
            f" FROM (VALUES {values}) AS {v}({aliases})"
        )
    statement = (
        f"INSERT INTO {table.qualified} ({names}) {_OVERRIDING} SELECT {picks}"
        f" FROM (VALUES {values}) AS {v}({aliases})"
        f" WHERE {where} RETURNING 1"
    )
    return f"{lock};\nWITH pgmesh_w AS ({statement}) {_rows_check(len(rows))}"


def prepared_insert(
    relation: Relation,
    table: TargetTable,
    change: Insert,
    prepared: Prepared,
    out: list[str],
    setup: list[str] | None = None,
) -> str:
    """A single guarded insert as two prepared statements: the locks (the table shared, the key
    exclusive), then the insert, which raises PGM02 if a tombstone holds the key. Planned once per
    relation: a text INSERT ... SELECT with the tombstone check costs the server far more to parse and
    plan. With `setup` (`setup_args`), the first statement also does the origin's xact_setup (the
    transaction's first statement then: one fewer for the target to run)."""
    plan = prepared.insert_plans.get(id(relation))
    if plan is None:
        plan = _plan_insert(relation, table, prepared, out)
    insert, key_columns, key_types = plan
    values = _literals(relation, change.new, range(len(relation.columns)))
    keys = [values[i] for i in key_columns]
    if setup is None:
        lock = prepared.name(relation, "IL", b"", lambda: f"SELECT {_insert_locks(table, key_types)}", out)
        first = _execute(lock, keys)
    else:
        n = len(keys)
        fused = prepared.name(
            relation, "ISL", b"",
            lambda: (f"SELECT pg_catalog.pg_replication_origin_xact_setup(${n + 1}, ${n + 2}),"
                     f" {_insert_locks(table, key_types)}"),
            out,
        )
        first = _execute(fused, [*keys, *setup])
    return f"{first};\n{_execute(insert, values)}"


def _insert_locks(table: TargetTable, key_types: list[str]) -> str:
    """The locks of a single guarded insert, its key as parameters $1...: the table's, shared (as
    `table_lock`), then the key's (`key_lock`)."""
    key = ", ".join(f"${n}::{t}::text" for n, t in enumerate(key_types, 1))
    return (
        f"pg_catalog.pg_advisory_xact_lock_shared(pg_catalog.hashtext({quote_literal(table.name)}), 0),"
        f" {key_lock(table, f'ARRAY[{key}]::text[]')}"
    )


def _plan_insert(
    relation: Relation, table: TargetTable, prepared: Prepared, out: list[str]
) -> tuple[str, list[int], list[str]]:
    """The PREPARE (into `out`) of a single guarded insert into `relation`, where its key is."""
    cols = relation.columns
    position = {c.name: i for i, c in enumerate(cols)}
    key = [k for k in table.tombstone_key if k in position]
    key_types = [table.compare[k] for k in key]

    def build_insert() -> str:
        names = ", ".join(quote_ident(c.name) for c in cols)
        picks = ", ".join(f"${i + 1}::{table.types.get(c.name, 'text')}" for i, c in enumerate(cols))
        keys = ", ".join(f"${position[k] + 1}::{table.compare[k]}::text" for k in key)
        # Raising in the WHERE clause (CASE evaluates in order; the subquery keeps the planner from
        # folding the call) is cheaper for the target than counting through a data-modifying CTE.
        return (
            f"INSERT INTO {table.qualified} ({names}) {_OVERRIDING} SELECT {picks}"
            f" WHERE CASE WHEN EXISTS (SELECT 1 FROM pgmesh.tombstones AS {TOMBSTONE_ALIAS}"
            f" WHERE {TOMBSTONE_ALIAS}.table_name = {quote_literal(table.name)}"
            f" AND {TOMBSTONE_ALIAS}.key = {tombstone_key(f'ARRAY[{keys}]::text[]')})"
            " THEN pgmesh.expect_rows((SELECT 0::bigint), 1) IS NULL ELSE true END"
        )

    insert = prepared.name(relation, "IG", b"", build_insert, out)
    plan = (insert, [position[k] for k in key], key_types)
    prepared.insert_plans[id(relation)] = plan
    return plan


@functools.lru_cache(maxsize=64)
def _utc_second(seconds: int) -> str:
    return pg_us_to_datetime(seconds * 1_000_000).strftime("%Y-%m-%d %H:%M:%S")


def commit_time_literal(us: int) -> str:
    """A PostgreSQL timestamp (µs since 2000-01-01 UTC) as timestamptz text, to the microsecond.
    Commit times come in order, so the date and time of day are formatted once per second."""
    seconds, fraction = divmod(us, 1_000_000)
    return f"{_utc_second(seconds)}.{fraction:06d}+00"


def xact_setup_sql(txn: Transaction, origin_lsn: int | None = None) -> str:
    """The origin's position and commit time for the target transaction applying `txn`."""
    lsn, when = setup_args(txn, origin_lsn)
    return f"SELECT pg_catalog.pg_replication_origin_xact_setup({lsn}, {when})"


def target_table(relation: Relation, tables: Mapping[tuple[str, str], TargetTable]) -> TargetTable:
    table = tables.get((relation.schema, relation.name))
    if table is None:
        raise SchemaMismatch(
            "the target has no such table",
            relation=f"{relation.schema}.{relation.name}",
            hint="create it on the target with the same columns, then `pgmesh resume`",
        )
    if table._fits.get(id(relation)) is not relation:
        _check_columns(relation, table)
        table._fits[id(relation)] = relation
    return table


def truncate_statement(
    change: Truncate, relations: Mapping[int, Relation], tables: Mapping[tuple[str, str], TargetTable]
) -> str:
    names = ", ".join(target_table(relations[r], tables).qualified for r in change.relids)
    restart = " RESTART IDENTITY" if change.restart_identity else ""
    cascade = " CASCADE" if change.cascade else ""
    return f"TRUNCATE {names}{restart}{cascade}"
