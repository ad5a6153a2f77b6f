"""SQL for applying one decoded source transaction to a target: pure text generation, no I/O.

A source transaction becomes one script: BEGIN, the origin's `pg_replication_origin_xact_setup` with the
source's commit end LSN and commit time, one statement per change, COMMIT. The script goes to the target
in one round trip (simple query protocol), so a reader there sees all of it or none of it.

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
    Message,
    RawInsert,
    Relation,
    Truncate,
    TupleData,
    Type,
    Update,
)
from protocol.pgoutput import decode_raw_insert, raw_tuple
from protocol.transactions import SpilledChange, Transaction
from router.errors import PgmeshError

__all__ = [
    "COPY_MIN_ROWS",
    "ApplyError",
    "CopyRun",
    "Prepared",
    "SchemaMismatch",
    "TargetTable",
    "identity_match",
    "key_lock",
    "quote_ident",
    "quote_literal",
    "table_lock",
    "target_table",
    "transaction_script",
    "transaction_segments",
    "truncate_statement",
    "xact_setup_sql",
]

# The source's values for GENERATED ALWAYS identity columns are the row's values (as the native apply
# worker applies them); harmless for tables without identity columns.
_OVERRIDING: Final = "OVERRIDING SYSTEM VALUE"

# Types without a btree equality operator: compared through their text form in identity matches.
_NO_EQUALITY: Final = frozenset({114, 142, 600, 601, 602, 603, 604, 628, 718})  # json xml point lseg ...


class ApplyError(PgmeshError):
    """A change that cannot be applied as is (schema mismatch, missing column, binary value)."""


class SchemaMismatch(ApplyError):
    """The target lacks a table or column the change names (possibly DDL still on its way here)."""


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def quote_literal(value: str) -> str:
    """A standard-conforming string literal (the session sets standard_conforming_strings = on)."""
    return "'" + value.replace("'", "''") + "'"


class TargetTable:
    """What the target has for one replicated table: names, column types, primary and unique keys."""

    __slots__ = ("_fits", "columns", "name", "pk", "qualified", "tombstone_key", "types", "uniques")

    def __init__(
        self,
        schema: str,
        name: str,
        columns: frozenset[str],
        types: Mapping[str, str] | None = None,
        pk: tuple[str, ...] = (),
        uniques: tuple[tuple[str, ...], ...] = (),
    ) -> None:
        self.name = f"{schema}.{name}"  # as pgmesh.tombstones and pgmesh.conflict_history name it
        self.qualified = f"{quote_ident(schema)}.{quote_ident(name)}"
        self.columns = columns
        self.types = dict(types or {})
        self.pk = pk
        self.uniques = uniques
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


def identity_match(relation: Relation, row: TupleData, *, full: bool) -> str:
    """WHERE clause matching the row by its key columns, or by every column under REPLICA IDENTITY FULL."""
    parts = []
    for i, column in enumerate(relation.columns):
        if not full and not column.key:
            continue
        if row.kinds[i] == KIND_UNCHANGED:
            continue
        name = quote_ident(column.name)
        literal = _literal(relation, row, i)
        if literal == "NULL":
            parts.append(f"{name} IS NULL")
        elif column.type_oid in _NO_EQUALITY:
            parts.append(f"{name}::text = {literal}")
        else:
            parts.append(f"{name} = {literal}")
    if not parts:
        raise ApplyError("change without any key value", relation=f"{relation.schema}.{relation.name}")
    return " AND ".join(parts)


def _where(
    relation: Relation, table: TargetTable, old: TupleData | None, new: TupleData, kind: str | None
) -> str:
    if kind == "O" and old is not None:
        # REPLICA IDENTITY FULL: rows may repeat; touch exactly one, as the source did.
        match = identity_match(relation, old, full=True)
        return f"ctid = (SELECT ctid FROM {table.qualified} WHERE {match} LIMIT 1)"
    return identity_match(relation, old if old is not None else new, full=False)


def _origin_check(origin: str) -> str:
    """SQL true when the row's xmin was committed under `origin` (SQL for an origin id); any other row
    goes to `pgmesh.expect_origin`, which accepts it or raises PGM01. The common case never calls
    PL/pgSQL (a function call per row was a third of a guarded update's cost on the target)."""
    return (
        f"CASE WHEN (pg_catalog.pg_xact_commit_timestamp_origin(xmin)).roident = {origin} THEN true"
        f" ELSE pgmesh.expect_origin(xmin, {origin}) END"
    )


def _rows_check(wanted: int | str) -> str:
    """The final SELECT of a guarded statement: `pgmesh.expect_rows` raises PGM02 unless the
    `pgmesh_w` CTE returned exactly `wanted` rows (only called when the count is off)."""
    return (
        f"SELECT CASE WHEN count(*) = {wanted} THEN NULL"
        f" ELSE pgmesh.expect_rows(count(*), {wanted}) END FROM pgmesh_w"
    )


def _guard(statement: str, origin: str | None, wanted: int = 1) -> str:
    """Wrap a DML statement (which must end in `WHERE ...`) so that a conflict raises instead of passing.

    The row must have been last written by the source (`pgmesh.expect_origin`, PGM01) and exactly
    `wanted` rows must be touched (`pgmesh.expect_rows`, PGM02): anything else is a conflict, handled by
    the applier's careful path. `origin` is SQL for the source's origin id (a literal or a parameter);
    without one the statement is returned as is.
    """
    if origin is None:
        return statement
    return f"WITH pgmesh_w AS ({statement} AND {_origin_check(origin)} RETURNING 1) {_rows_check(wanted)}"


def _update(relation: Relation, table: TargetTable, change: Update) -> str:
    sets = [
        f"{quote_ident(c.name)} = {_literal(relation, change.new, i)}"
        for i, c in enumerate(relation.columns)
        if change.new.kinds[i] != KIND_UNCHANGED
    ]
    where = _where(relation, table, change.old, change.new, change.old_kind)
    return f"UPDATE {table.qualified} SET {', '.join(sets)} WHERE {where}"


def _delete(relation: Relation, table: TargetTable, change: Delete) -> str:
    where = _where(relation, table, change.old, change.old, change.old_kind)
    return f"DELETE FROM {table.qualified} WHERE {where}"


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

    def setup(self, txn: Transaction, origin_lsn: int | None, out: list[str]) -> str:
        """`xact_setup_sql` as an EXECUTE of a statement prepared once per session (planned once)."""
        name = self._names.get(_SETUP_KEY)
        if name is None:
            name = self._new(_SETUP_KEY, "SELECT pg_catalog.pg_replication_origin_xact_setup($1, $2)", out)
        return _execute(name, _setup_args(txn, origin_lsn))

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


def _setup_args(txn: Transaction, origin_lsn: int | None) -> list[str]:
    """The origin's position and commit time for `txn`'s target transaction, as SQL literals."""
    lsn = format_lsn(origin_lsn if origin_lsn is not None else txn.end_lsn)
    return [f"'{lsn}'", f"'{commit_time_literal(txn.commit_time)}'"]


def _prepared_update(
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
        where = " AND ".join(f"{quote_ident(cols[i].name)} = ${n}" for n, i in enumerate(keys, len(sets) + 1))
        statement = f"UPDATE {table.qualified} SET {assignments} WHERE {where}"
        return _guard(statement, None if origin is None else f"${len(sets) + len(keys) + 1}")

    mask = bytes(1 if new.kinds[i] == KIND_UNCHANGED else 0 for i in range(len(cols)))
    name = prepared.name(relation, shape, mask, build, out)
    prepared.plans[(id(relation), shape, new.kinds)] = (name, sets, keys)
    literals = _literals(relation, new, sets) + _literals(relation, row_key, keys)
    if origin is not None:
        literals.append(f"'{origin}'")
    return _execute(name, literals)


def _prepared_delete(
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
        where = " AND ".join(f"{quote_ident(cols[i].name)} = ${n}" for n, i in enumerate(keys, 1))
        statement = f"DELETE FROM {table.qualified} WHERE {where}"
        return _guard(statement, None if origin is None else f"${len(keys) + 1}")

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
    that decides a key takes exactly this lock (router.conflict_apply, the guarded inserts here)."""
    name = quote_literal(table.name + ":")
    return (
        f"pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended("
        f"{name} || pg_catalog.array_to_string({key_array}, ','), 0))"
    )


def table_lock(table: TargetTable, *, exclusive: bool) -> str:
    """The advisory lock on a whole table that decisions on its keys share (router.conflict_apply)."""
    mode = "" if exclusive else "_shared"
    name = quote_literal(table.name)
    return f"SELECT pg_catalog.pg_advisory_xact_lock{mode}(pg_catalog.hashtext({name}), 0)"


def _insert_rows(
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
    aliases = ", ".join(f"c{i}" for i in width)
    position = {c.name: i for i, c in enumerate(relation.columns)}
    picks = ", ".join(f"v.c{i}::{table.types.get(c.name, 'text')}" for i, c in enumerate(relation.columns))
    key = ", ".join(f"v.c{position[k]}::{table.types[k]}::text" for k in table.tombstone_key if k in position)
    where = (
        f"NOT EXISTS (SELECT 1 FROM pgmesh.tombstones t WHERE t.table_name = {quote_literal(table.name)}"
        f" AND t.key = ARRAY[{key}]::text[])"
    )
    # The careful path's lock per (table, key), taken in a statement of its own so that the insert's
    # tombstone check runs on a snapshot taken after the lock: an applier of another source deciding
    # the same key (possibly absent here) finishes first, and this insert then sees what it did.
    if coarse:  # a big transaction: the whole table, once
        lock = table_lock(table, exclusive=True)
    else:
        lock = (
            f"{table_lock(table, exclusive=False)};\n"
            f"SELECT count({key_lock(table, f'ARRAY[{key}]::text[]')}) FROM (VALUES {values}) AS v({aliases})"
        )
    statement = (
        f"INSERT INTO {table.qualified} ({names}) {_OVERRIDING} SELECT {picks}"
        f" FROM (VALUES {values}) AS v({aliases})"
        f" WHERE {where} RETURNING 1"
    )
    return f"{lock};\nWITH pgmesh_w AS ({statement}) {_rows_check(len(rows))}"


def _prepared_insert(
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
    plan. With `setup` (`_setup_args`), the first statement also does the origin's xact_setup (the
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
    key_types = [table.types[k] for k in key]

    def build_insert() -> str:
        names = ", ".join(quote_ident(c.name) for c in cols)
        picks = ", ".join(f"${i + 1}::{table.types.get(c.name, 'text')}" for i, c in enumerate(cols))
        keys = ", ".join(f"${position[k] + 1}::{table.types[k]}::text" for k in key)
        # Raising in the WHERE clause (CASE evaluates in order; the subquery keeps the planner from
        # folding the call) is cheaper for the target than counting through a data-modifying CTE.
        return (
            f"INSERT INTO {table.qualified} ({names}) {_OVERRIDING} SELECT {picks}"
            f" WHERE CASE WHEN EXISTS (SELECT 1 FROM pgmesh.tombstones t WHERE t.table_name ="
            f" {quote_literal(table.name)} AND t.key = ARRAY[{keys}]::text[])"
            " THEN pgmesh.expect_rows((SELECT 0::bigint), 1) IS NULL ELSE true END"
        )

    insert = prepared.name(relation, "IG", b"", build_insert, out)
    plan = (insert, [position[k] for k in key], key_types)
    prepared.insert_plans[id(relation)] = plan
    return plan


INSERT_RUN = 1000  # rows per multi-row INSERT
# A run of at least this many inserts into one table, in a transaction that locks whole tables (more
# than KEY_LOCKS_MAX row changes), goes in as COPY when the target may take it (see `CopyRun`).
COPY_MIN_ROWS: Final = 200
COPY_RUN: Final = 50_000  # rows per COPY (bounds the bytes built at once)


class CopyRun:
    """A run of inserts into one table to load with COPY ... FROM STDIN (text format).

    COPY cannot check tombstones: the applier loads it only when the table has none (checked after the
    transaction took the table's exclusive lock, so no decider of another source can add one), and
    otherwise runs `fallback()`, the guarded INSERT. An existing key still fails the COPY with a
    unique violation, which sends the transaction to the careful path like any other conflict.
    """

    __slots__ = ("check_tombstones", "coarse", "relation", "rows", "table")

    def __init__(
        self,
        relation: Relation,
        table: TargetTable,
        rows: list[Insert | RawInsert],
        check_tombstones: bool,
        coarse: bool,
    ) -> None:
        self.relation = relation
        self.table = table
        self.rows = rows
        self.check_tombstones = check_tombstones
        self.coarse = coarse

    @property
    def schema_and_name(self) -> tuple[str, str]:
        return self.relation.schema, self.relation.name

    @property
    def columns(self) -> list[str]:
        return [c.name for c in self.relation.columns]

    def data(self) -> bytes:
        return copy_text(self.relation, self.rows)

    def fallback(self) -> str:
        """The same rows as guarded INSERT statements (the table has tombstones)."""
        rows, relation, table = _decoded(self.rows), self.relation, self.table
        return ";\n".join(
            _insert_rows(relation, table, rows[i : i + INSERT_RUN], self.check_tombstones, self.coarse)
            for i in range(0, len(rows), INSERT_RUN)
        )


def _copy_escape(value: bytes) -> bytes:
    return (
        value.replace(b"\\", b"\\\\").replace(b"\t", b"\\t").replace(b"\n", b"\\n").replace(b"\r", b"\\r")
    )


def _decoded(rows: list[Insert | RawInsert]) -> list[Insert]:
    """`rows` with every RawInsert decoded (`rows` itself when it holds none)."""
    if all(type(r) is Insert for r in rows):
        return rows  # type: ignore[return-value]  # checked just above
    return [decode_raw_insert(r) if isinstance(r, RawInsert) else r for r in rows]


def copy_text(relation: Relation, rows: Sequence[Insert | RawInsert]) -> bytes:
    """COPY text-format lines for `rows` (pgoutput's text values are the types' output, which COPY's
    input functions read back). Fast path: join everything, then check in C that no value needed
    escaping; otherwise escape value by value. A RawInsert's row is read straight from its bytes."""
    width = len(relation.columns)
    plain = bytes([KIND_TEXT]) * width
    lines: list[bytes] = []
    append = lines.append
    join = b"\t".join
    nulls = 0  # each written as \N: the only backslashes when no value needs escaping
    news = [raw_tuple(r) if isinstance(r, RawInsert) else r.new for r in rows]
    for new in news:
        if new.kinds == plain:
            append(join(new.values))  # type: ignore[arg-type]  # all bytes: every kind is text
        else:
            nulls += new.kinds.count(KIND_NULL)
            append(_copy_line(relation, new))
    data = b"\n".join(lines) + b"\n"
    if (
        data.count(b"\t") == len(rows) * (width - 1)
        and data.count(b"\n") == len(rows)
        and data.count(b"\\") == nulls
        and b"\r" not in data
    ):
        return data
    return b"".join(_copy_line(relation, new, escape=True) + b"\n" for new in news)


def _copy_line(relation: Relation, new: TupleData, *, escape: bool = False) -> bytes:
    cells: list[bytes] = []
    for i, kind in enumerate(new.kinds):
        value = new.values[i]
        if kind == KIND_NULL:
            cells.append(b"\\N")
        elif kind == KIND_TEXT and isinstance(value, bytes):
            cells.append(_copy_escape(value) if escape else value)
        else:
            raise ApplyError(
                f"column {relation.columns[i].name} arrived as {chr(kind)!r}, expected text",
                relation=f"{relation.schema}.{relation.name}",
            )
    return b"\t".join(cells)


def _preparable(table: TargetTable) -> bool:
    """Whether a single guarded insert into `table` can go through `_prepared_insert` (its key's
    types are known), else a text INSERT (`_insert_rows`)."""
    return bool(table.types) and all(k in table.types for k in table.tombstone_key)


def _keyed(relation: Relation, kind: str | None) -> bool:
    """Whether rows are matched by key columns (prepared statements), not by whole rows."""
    return kind != "O" and any(c.key for c in relation.columns)


def transaction_script(
    txn: Transaction,
    tables: Mapping[tuple[str, str], TargetTable],
    *,
    origin_lsn: int | None = None,
    prepared: Prepared | None = None,
    guard_origin: int | None = None,
    prelude: list[str] | None = None,
) -> str:
    """The whole target transaction for `txn` as one SQL script.

    `tables` maps (schema, name) to the target's table; `origin_lsn` is what the origin records
    (default: the transaction's end LSN, the position to resume from); with `prepared`, keyed updates
    and deletes run as prepared statements of the session (PREPARE emitted on first use). With
    `guard_origin` (the source's replication origin id on the target) every change raises instead of
    applying when it meets a conflict (see `_guard`): the applier then takes the careful path.
    New PREPAREs go to `prelude` when given (to run before any transaction of a batch, so that a
    transaction that fails cannot take a prepared statement down with it), else inline.
    """
    (script,) = transaction_segments(
        txn, tables, origin_lsn=origin_lsn, prepared=prepared, guard_origin=guard_origin, prelude=prelude,
        copy=False,
    )
    assert isinstance(script, str)
    return script


def transaction_segments(
    txn: Transaction,
    tables: Mapping[tuple[str, str], TargetTable],
    *,
    origin_lsn: int | None = None,
    prepared: Prepared | None = None,
    guard_origin: int | None = None,
    prelude: list[str] | None = None,
    copy: bool = True,
    relations: dict[int, Relation] | None = None,
    begin: bool = True,
    commit: bool = True,
    at_commit: tuple[str, str] | None = None,
    setup: bool = True,
) -> list[str | CopyRun]:
    """`transaction_script` cut where a run of inserts goes in by COPY: SQL scripts and `CopyRun`s, in
    order, the first opening the transaction and the last committing it. With `copy` False (or no
    run long enough) it is one script.

    A transaction too big to hold at once is cut into parts by the caller: `begin` / `commit` say
    whether this part opens / commits the target transaction, and `relations` (updated in place by
    inline Relation messages) carries the relation descriptions from one part to the next. A part read
    back from a spill file may hold `RawInsert`s (`router.spool.iter_raw_chunks`): their rows go to
    COPY straight from the server's bytes, or are decoded for an INSERT.

    `at_commit` (statements before COMMIT, statements after it) is for a session that takes the
    replication origin only to commit (router.lanes): the origin's `xact_setup` then goes
    just before COMMIT, after the first of the two. `setup` False leaves the `xact_setup` out of the
    opening part (the caller sends it before its own COMMIT).
    """
    prepares = prelude if prelude is not None else None
    out: list[str] = []
    if prepared is None:
        setup_sql = xact_setup_sql(txn, origin_lsn)
    else:
        setup_sql = prepared.setup(txn, origin_lsn, out if prepares is None else prepares)
    if begin:
        out.append("BEGIN")
    # The origin's xact_setup goes with the transaction's first statement (in it, when that is a
    # single guarded insert: see `_prepared_insert`).
    pending = begin and at_commit is None and setup

    def opening() -> None:
        nonlocal pending
        if pending:
            out.append(setup_sql)
            pending = False

    segments: list[str | CopyRun] = []
    origin_sql = None if guard_origin is None else f"'{guard_origin}'"
    guarded = guard_origin is not None
    coarse = txn.row_count > KEY_LOCKS_MAX
    copy = copy and (coarse or not guarded)
    if relations is None:
        relations = dict(txn.relations)
    run: list[Insert | RawInsert] = []
    run_rel: Relation | None = None

    def flush_run() -> None:
        nonlocal pending
        assert run_rel is not None
        table = target_table(run_rel, tables)
        if copy and len(run) >= COPY_MIN_ROWS:
            opening()
            if guarded:
                out.append(table_lock(table, exclusive=True))
            if out:
                segments.append(";\n".join(out) + ";")
                out.clear()
            for i in range(0, len(run), COPY_RUN):
                segments.append(CopyRun(run_rel, table, run[i : i + COPY_RUN], guarded, coarse))
            return
        rows = _decoded(run)
        sink = out if prepares is None else prepares
        if prepared is not None and guarded and not coarse and len(rows) == 1 and _preparable(table):
            setup_args = _setup_args(txn, origin_lsn) if pending else None
            pending = False
            out.append(_prepared_insert(run_rel, table, rows[0], prepared, sink, setup_args))
            return
        opening()
        out.append(_insert_rows(run_rel, table, rows, guarded, coarse))

    changes: Sequence[SpilledChange] = txn.changes  # a part read back raw holds RawInserts, too
    for change in changes:
        if isinstance(change, (Insert, RawInsert)):  # nearly every change of a large transaction
            relation = relations[change.relid]
            if run and (relation is not run_rel or (not copy and len(run) >= INSERT_RUN)):
                flush_run()
                run = []
            run_rel = relation
            run.append(change)
            continue
        if run:
            flush_run()
            run = []
        if isinstance(change, Relation):
            relations[change.relid] = change
            continue
        if isinstance(change, (Type, Message)):
            continue
        if isinstance(change, Truncate):
            opening()
            out.append(truncate_statement(change, relations, tables))
            continue
        relation = relations[change.relid]
        table = target_table(relation, tables)
        opening()
        keyed = prepared is not None and _keyed(relation, change.old_kind)
        if isinstance(change, Update):
            if keyed:
                assert prepared is not None
                sink = out if prepares is None else prepares
                out.append(_prepared_update(relation, table, change, prepared, sink, guard_origin))
            else:
                out.append(_guard(_update(relation, table, change), origin_sql))
        elif keyed:
            assert prepared is not None
            sink = out if prepares is None else prepares
            out.append(_prepared_delete(relation, table, change, prepared, sink, guard_origin))
        else:
            out.append(_guard(_delete(relation, table, change), origin_sql))
    if run:
        flush_run()
    opening()  # a transaction (or opening part) without a statement still sets the origin up
    if commit:
        if at_commit is None:
            out.append("COMMIT")
        else:
            out += [at_commit[0], setup_sql, "COMMIT", at_commit[1]]
    if out:
        segments.append(";\n".join(out) + ";")
    return segments


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
    when = commit_time_literal(txn.commit_time)
    lsn = format_lsn(origin_lsn if origin_lsn is not None else txn.end_lsn)
    return f"SELECT pg_catalog.pg_replication_origin_xact_setup('{lsn}', '{when}')"


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
