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
import json
from collections.abc import Mapping, Sequence
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
from router.progress.applied import mark_cte

__all__ = [
    "BOUNDED_KEY_COLUMNS", "COMMIT_ALIAS", "KEY_LOCKS_MAX", "REMOTE_ALIAS", "RESERVED_NAMES", "TABLE_ALIAS",
    "TOMBSTONE_ALIAS", "TargetTable", "UniqueIndex", "bounded_key", "check_always", "commit_time_literal",
    "delete_statement", "guard", "identity_match", "insert_rows", "key_lock", "quote_ident", "quote_literal",
    "remote_setting_sql", "remote_version", "setup_args", "setup_statement", "table_lock", "target_table",
    "tombstone_key", "truncate_statement", "typed", "untouched", "update_sets", "update_statement",
    "xact_setup_sql",
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
)  # (and the row labels of router.apply.careful.transaction, and the columns "pgmesh_c<i>" of pgmesh_v)


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
        "_fits", "always", "columns", "compare", "deferrable", "deferred", "filtered", "generated",
        "identity", "indexes", "name", "partitioned", "pk", "qualified", "skip", "tombstone_key", "types",
        "uniques",
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
        # the replica identity index's columns (() under FULL or DEFAULT): a table without a primary key
        # finds a row by them, as its key tuple carries nothing else
        self.identity: tuple[str, ...] = ()
        self.deferred = False  # the primary key is DEFERRABLE: no ON CONFLICT can name it
        # a deferrable constraint or constraint trigger (either side of a foreign key): checked at COMMIT
        self.deferrable = False
        self.always: frozenset[str] = frozenset()  # identity columns GENERATED ALWAYS (no UPDATE sets them)
        # generated columns (STORED; VIRTUAL on 18): only the server computes them, no INSERT or UPDATE may
        # name them (SQLSTATE 428C9). pgoutput leaves them out of its rows (15-17; 18 unless the publication
        # sets publish_generated_columns), but rows read from the catalog (a row read whole on the source,
        # router.apply.toast; a local row a resolver keeps) hold them: every writer leaves them out
        self.generated: frozenset[str] = frozenset()
        # a partial target (router.cluster.partial): does not get this table (its changes are skipped), or
        # holds the rows a filter keeps (a missing row there is no conflict to record)
        self.skip = False
        self.filtered = False


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
    generated = [c.name for c in relation.columns if c.name in table.generated]
    if generated:  # (a publication with publish_generated_columns, 18): the applier fits the rows without
        raise SchemaMismatch(  # them (router.apply.link.LinkSession.fit), else this error stands
            f"the rows carry generated column {', '.join(generated)}, which only the target computes",
            relation=f"{relation.schema}.{relation.name}",
            hint="set publish_generated_columns = none on pgmesh's publication on every node",
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


def update_sets(relation: Relation, table: TargetTable, change: Update) -> list[int]:
    """The columns an UPDATE of `change` sets on the target: those it carries (an unchanged TOAST value is
    not), but not an identity GENERATED ALWAYS, which PostgreSQL lets no UPDATE set (only its key equals
    the source's, the row is matched by it). Such a column whose value the change moves (`SET id =
    DEFAULT` on the source) cannot be applied: ApplyError, naming the table (see `check_always`)."""
    check_always(relation, table, change)
    always = table.always
    return [
        i for i, c in enumerate(relation.columns)
        if change.new.kinds[i] != KIND_UNCHANGED and c.name not in always
    ]


def check_always(relation: Relation, table: TargetTable, change: Update) -> None:
    """Raise when `change` moves an identity GENERATED ALWAYS column's value (its old value is known)."""
    old, new = change.old, change.new
    if not table.always or old is None:
        return
    for i, c in enumerate(relation.columns):
        if c.name in table.always and old.kinds[i] == new.kinds[i] and old.values[i] != new.values[i]:
            raise ApplyError(
                f"the update changes identity column {c.name}, GENERATED ALWAYS on the target, where no"
                " UPDATE may set it", relation=table.name,
                hint="make the column GENERATED BY DEFAULT on every node, then `pgmesh resume`",
            )


def untouched(table: TargetTable, columns: Sequence[str]) -> str:
    """The SET list of an UPDATE that carries no settable value: the first of `columns` that may be set,
    set to itself (the row is still written: its origin and commit time are the source's)."""
    for name in columns:
        if name in table.columns and name not in table.always and name not in table.generated:
            return f"{quote_ident(name)} = {TABLE_ALIAS}.{quote_ident(name)}"
    raise ApplyError("every column is an identity GENERATED ALWAYS: no UPDATE can write the row",
                     relation=table.name)


def update_statement(relation: Relation, table: TargetTable, change: Update) -> str:
    sets = [
        f"{quote_ident(relation.columns[i].name)} = {_literal(relation, change.new, i)}"
        for i in update_sets(relation, table, change)
    ]
    if not sets:  # it carries only an identity GENERATED ALWAYS key
        sets = [untouched(table, [c.name for c in relation.columns])]
    where = _where(relation, table, change.old, change.new, change.old_kind)
    return f"UPDATE {table.qualified} AS {TABLE_ALIAS} SET {', '.join(sets)} WHERE {where}"


def delete_statement(relation: Relation, table: TargetTable, change: Delete) -> str:
    where = _where(relation, table, change.old, change.old, change.old_kind)
    return f"DELETE FROM {table.qualified} AS {TABLE_ALIAS} WHERE {where}"


def setup_args(txn: Transaction, origin_lsn: int | None, remote: bool = True) -> list[str]:
    """The origin's position and commit time for `txn`'s target transaction, and with `remote` the
    remote version the decision functions read (`pgmesh.remote`, router.apply.decide reads it), as SQL
    literals."""
    lsn = format_lsn(origin_lsn if origin_lsn is not None else txn.end_lsn)
    when = commit_time_literal(txn.commit_time)
    if not remote:
        return [f"'{lsn}'", f"'{when}'"]
    return [f"'{lsn}'", f"'{when}'", quote_literal(remote_version(txn, lsn, when))]


def remote_version(txn: Transaction, lsn: str, when: str) -> str:
    """The remote version the decision functions read (`pgmesh.remote`): `lsn` and `when` (the origin
    set-up's position and commit time, as text) and what the source had seen of the other nodes."""
    return f"{lsn}|{when}|{_views(txn.seen)}"


@functools.lru_cache(maxsize=16)
def _views(seen: tuple[tuple[str, int], ...]) -> str:
    """What the source had seen of other nodes (router.stream.seen), as JSON node -> commit time. The
    fan-out shares one tuple until an echo changes it: formatted once, not once per transaction."""
    return json.dumps({node: commit_time_literal(us) for node, us in seen}) if seen else ""


def remote_setting_sql(args: list[str]) -> str:
    """Only `pgmesh.remote` of `setup_args` (for a transaction that sets its origin up at commit)."""
    return f"SELECT pg_catalog.set_config('pgmesh.remote', {args[2]}, true)"


# A transaction with more row changes than this locks whole tables, not keys: advisory locks held to
# commit fill the server's lock table (max_locks_per_transaction x max_connections) otherwise.
KEY_LOCKS_MAX: Final = 64


def key_lock(table: TargetTable, key_array: str, single: str | None = None) -> str:
    """The advisory lock on one key of `table` (`key_array`: SQL for its key as text[]). Every path
    that decides a key takes exactly this lock (router.apply.careful.transaction, the guarded inserts here).
    `single`: SQL for the text of a one-column key, the same string as the array's (cheaper to build)."""
    name = quote_literal(table.name + ":")
    text = single if single is not None else f"pg_catalog.array_to_string({key_array}, ',')"
    return f"pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended({name} || {text}, 0))"


# Key types whose text is at most 64 bytes (format_type's names): a key of up to BOUNDED_KEY_COLUMNS of
# them never reaches the 2000 bytes past which pgmesh.tombstones holds a key by its md5.
_BOUNDED_TYPES: Final = frozenset((
    "smallint", "integer", "bigint", "oid", "boolean", "real", "double precision", "uuid", "date",
    "time without time zone", "timestamp without time zone", "timestamp with time zone",
))
BOUNDED_KEY_COLUMNS: Final = 16


def bounded_key(types: Sequence[str]) -> bool:
    """Whether a key of columns compared as `types` is always short enough to be held as it is (its
    `tombstone_key` needs no size test: the test costs a single insert's target about a fifth more)."""
    return len(types) <= BOUNDED_KEY_COLUMNS and all(t in _BOUNDED_TYPES for t in types)


def tombstone_key(key_array: str, bounded: bool = False) -> str:
    """A key (`key_array`: SQL for it as text[]) as pgmesh.tombstones holds it: a key too long for the
    table's index (a keyless table's whole row) by its md5, as the tombstone trigger stores it.
    `bounded` (`bounded_key`): the key is never that long, and is held as it is."""
    if bounded:
        return key_array
    size = f"pg_catalog.octet_length(({key_array})::text) + 8 * pg_catalog.cardinality({key_array})"
    digest = f"ARRAY['pgmesh:md5:' || pg_catalog.md5(({key_array})::text)]"
    return f"(CASE WHEN {size} > 2000 THEN {digest} ELSE {key_array} END)"


def table_lock(table: TargetTable, *, exclusive: bool) -> str:
    """The advisory lock on a whole table that decisions on its keys share
    (router.apply.careful.transaction)."""
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
    key_columns = [k for k in table.tombstone_key if k in position]
    key = ", ".join(f'{v}."pgmesh_c{position[k]}"::{table.compare[k]}::text' for k in key_columns)
    bounded = bounded_key([table.compare[k] for k in key_columns])
    where = (
        f"NOT EXISTS (SELECT 1 FROM pgmesh.tombstones AS {ts}"
        f" WHERE {ts}.table_name = {quote_literal(table.name)}"
        f" AND {ts}.key = {tombstone_key(f'ARRAY[{key}]::text[]', bounded)})"
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


@functools.lru_cache(maxsize=64)
def _utc_second(seconds: int) -> str:
    return pg_us_to_datetime(seconds * 1_000_000).strftime("%Y-%m-%d %H:%M:%S")


def commit_time_literal(us: int) -> str:
    """A PostgreSQL timestamp (µs since 2000-01-01 UTC) as timestamptz text, to the microsecond.
    Commit times come in order, so the date and time of day are formatted once per second."""
    seconds, fraction = divmod(us, 1_000_000)
    return f"{_utc_second(seconds)}.{fraction:06d}+00"


def xact_setup_sql(txn: Transaction, origin_lsn: int | None = None, mark: bool = False) -> str:
    """The origin's position and commit time for the target transaction applying `txn` (and
    `pgmesh.remote`, see `setup_args`); `mark`: see `setup_statement`."""
    lsn, when, remote = setup_args(txn, origin_lsn)
    return setup_statement(lsn, when, remote, mark)


def setup_statement(lsn: str, when: str, remote: str | None, mark: bool) -> str:
    """The origin's set-up for one applied transaction: `lsn` and `when` (SQL expressions) to
    `pg_replication_origin_xact_setup`, `remote` (an expression, or None) to `pgmesh.remote`. With `mark`
    (a PostgreSQL 16+ target, where a rollback after the set-up still moves the origin) the statement
    first sets the source's applied mark to `lsn`: every set-up there goes through here."""
    setting = "" if remote is None else f", pg_catalog.set_config('pgmesh.remote', {remote}, true)"
    setup = f"SELECT pg_catalog.pg_replication_origin_xact_setup({lsn}, {when}){setting}"
    return f"{mark_cte(lsn)}{setup} FROM pgmesh_marked" if mark else setup


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
    change: Truncate,
    relations: Mapping[int, Relation],
    tables: Mapping[tuple[str, str], TargetTable],
    commit_time: int,
) -> str:
    """A replicated TRUNCATE, decided by version (`pgmesh.truncate_by_version`, router/conflicts/sql): the
    rows older than the source's commit at `commit_time` go, newer ones stay, and each table's tombstone
    records it; a plain TRUNCATE when no row is newer."""
    named = [relations[r] for r in change.relids]
    kept = [rel for rel in named if not target_table(rel, tables).skip]
    if not kept:
        return "SELECT 1"  # every table it empties is one the target does not get
    schemas = ", ".join(quote_literal(rel.schema) for rel in kept)
    names = ", ".join(quote_literal(rel.name) for rel in kept)
    restart = "true" if change.restart_identity else "false"
    cascade = "true" if change.cascade else "false"
    return (f"SELECT pgmesh.truncate_by_version(ARRAY[{schemas}]::text[], ARRAY[{names}]::text[], {restart},"
            f" {cascade}, '{commit_time_literal(commit_time)}'::timestamptz)")
