"""A decoded source transaction as the target's transaction: SQL scripts and COPY runs, no I/O.

A source transaction becomes one script: BEGIN, one statement per change (`router.apply.statements`;
each kind of change has its handler in one table, `_SCRIPT`, a protocol.changes.Dispatch), the
origin's `pg_replication_origin_xact_setup` with the source's commit end LSN and commit time, COMMIT.
The setup comes last, right before COMMIT: on PostgreSQL 16+ a transaction that rolls back after it
(and wrote anything) still moves the origin's progress to that LSN, so a conflict or a deadlock would
make a transaction look applied that never was (invariant 1); deferred constraints are checked before
it. The script goes to the target in one round trip (simple query protocol), so a reader there sees all
of it or none of it. In a large transaction, runs of inserts into one table go in by COPY instead
(`CopyRun`), cutting the script into segments; a part of a transaction read back from a spill file may
hold `RawInsert`s, whose rows go to COPY straight from the server's bytes.

Must not: connect, retry, decide conflicts, or know which node it runs for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Final

from protocol.changes import ChangeContext, Dispatch, note_relation
from protocol.errors import ProtocolError
from protocol.messages import (
    KIND_NULL,
    KIND_TEXT,
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
from protocol.pgoutput import decode_raw_insert, raw_copy_text, raw_tuple
from protocol.transactions import SpilledChange, Transaction
from router.apply.prepared import Prepared, prepared_delete, prepared_insert, prepared_update
from router.apply.statements import (
    KEY_LOCKS_MAX,
    TargetTable,
    delete_statement,
    guard,
    insert_rows,
    quote_literal,
    remote_setting_sql,
    setup_args,
    table_lock,
    target_table,
    tombstone_key,
    truncate_statement,
    update_statement,
    xact_setup_sql,
)
from router.errors import ApplyError

__all__ = [
    "COMMIT_CHECKS",
    "COPY_MIN_ROWS",
    "COPY_RUN",
    "INSERT_RUN",
    "ORIGIN_MARK",
    "CopyRun",
    "copy_text",
    "transaction_script",
    "transaction_segments",
]

INSERT_RUN = 1000  # rows per multi-row INSERT
# A run of at least this many inserts into one table, in a transaction that locks whole tables (more
# than KEY_LOCKS_MAX row changes), goes in as COPY when the target may take it (see `CopyRun`).
COPY_MIN_ROWS: Final = 200
COPY_RUN: Final = 50_000  # rows per COPY (bounds the bytes built at once)
# Two row writes under the session's replication origin, leaving nothing: before a TRUNCATE here, and
# before each replicated DDL command (router.apply.applier). PostgreSQL 15 announces a transaction it
# streams in progress with the origin of its first decoded change (reorderbuffer.c, ReorderBufferProcessTXN:
# `txn->origin_id = change->origin_id` before stream_start; pgoutput_stream_start sends the Origin from it,
# once), and the first change of DDL or of a TRUNCATE is internal (the command id of its catalog writes),
# without origin: the target streamed a transaction that opened with one without an Origin, and its source
# took it for the target's own and sent it back (invariant 3). A row write carries the origin.
# Before the origin's xact_setup: what deferred constraints check at COMMIT is checked here instead, so that
# nothing fails after the setup (on PostgreSQL 16+ a rollback then still moves the origin's progress).
COMMIT_CHECKS: Final = "SET CONSTRAINTS ALL IMMEDIATE"

ORIGIN_MARK: Final = (
    "INSERT INTO \"pgmesh\".\"node_info\" (\"key\", \"value\")"
    " VALUES ('origin_mark.' || pg_catalog.pg_current_xact_id(), '');"
    " DELETE FROM \"pgmesh\".\"node_info\" WHERE \"key\" = 'origin_mark.' || pg_catalog.pg_current_xact_id()"
)
_INSERT_TYPES: Final = frozenset((Insert, RawInsert))
_RAW_ONLY: Final = frozenset((RawInsert,))
_RELID: Final = attrgetter("relid")


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
        rows, relation, table = _decoded(self.relation, self.rows), self.relation, self.table
        return ";\n".join(
            insert_rows(relation, table, rows[i : i + INSERT_RUN], self.check_tombstones, self.coarse)
            for i in range(0, len(rows), INSERT_RUN)
        )


def _copy_escape(value: bytes) -> bytes:
    return (
        value.replace(b"\\", b"\\\\").replace(b"\t", b"\\t").replace(b"\n", b"\\n").replace(b"\r", b"\\r")
    )


def _unreadable(relation: Relation, exc: ProtocolError) -> ApplyError:
    """The error for a row left undecoded by the source that does not read back (a damaged spill)."""
    return ApplyError(f"an insert spilled to disk does not read back: {exc.detail}",
                      relation=f"{relation.schema}.{relation.name}")


def _decoded(relation: Relation, rows: list[Insert | RawInsert]) -> list[Insert]:
    """`rows` with every RawInsert decoded (`rows` itself when it holds none)."""
    if all(type(r) is Insert for r in rows):
        return rows  # type: ignore[return-value]  # checked just above
    try:
        return [decode_raw_insert(r) if isinstance(r, RawInsert) else r for r in rows]
    except ProtocolError as exc:
        raise _unreadable(relation, exc) from exc


def copy_text(relation: Relation, rows: Sequence[Insert | RawInsert]) -> bytes:
    """COPY text-format lines for `rows` (pgoutput's text values are the types' output, which COPY's
    input functions read back). Fast path: join everything, then check in C that no value needed
    escaping; otherwise escape value by value. A RawInsert's row is read straight from its bytes."""
    width = len(relation.columns)
    if _RAW_ONLY.issuperset(map(type, rows)):  # every row undecoded (checked in C)
        fast = raw_copy_text(rows, width)  # type: ignore[arg-type]  # all RawInserts, checked above
        if fast is not None:
            return fast
    plain = bytes([KIND_TEXT]) * width
    lines: list[bytes] = []
    append = lines.append
    join = b"\t".join
    nulls = 0  # each written as \N: the only backslashes when no value needs escaping
    try:
        news = [raw_tuple(r) if isinstance(r, RawInsert) else r.new for r in rows]
    except ProtocolError as exc:
        raise _unreadable(relation, exc) from exc
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


def _one_run(changes: Sequence[SpilledChange]) -> bool:
    """Whether `changes` are all inserts into one table (checked in C, not change by change)."""
    return (
        len(changes) > 1
        and _INSERT_TYPES.issuperset(map(type, changes))
        and len(set(map(_RELID, changes))) == 1
    )


def _preparable(table: TargetTable) -> bool:
    """Whether a single guarded insert into `table` can go through `prepared_insert` (its key's
    types are known), else a text INSERT (`insert_rows`)."""
    return bool(table.types) and all(k in table.types for k in table.tombstone_key)


def _keyed(relation: Relation, kind: str | None) -> bool:
    """Whether rows are matched by key columns (prepared statements), not by whole rows."""
    return kind != "O" and any(c.key for c in relation.columns)


def moved_key_tombstone(relation: Relation, table: TargetTable, change: Update) -> str | None:
    """An UPDATE that changes a table's primary key (pgoutput sends its old key: old_kind 'K') takes the
    old key away: the statement that makes the applying transaction that key's tombstone, as the DELETE
    trigger writes one (router.conflicts.catalog; the node's own key updates are recorded by
    router.apply.recorder). None when the update keeps its key or the old key does not hold the
    tombstone key's columns. Run after the update, in its transaction: when the update does not apply
    (a conflict), the transaction goes to the careful path, which writes it where the update wins."""
    if change.old_kind != "K" or change.old is None or not table.pk:
        return None
    position = {c.name: i for i, c in enumerate(relation.columns)}
    parts = []
    for name in table.tombstone_key:
        i = position.get(name)
        if i is None or change.old.kinds[i] != KIND_TEXT or not isinstance(change.old.values[i], bytes):
            return None
        value = change.old.values[i]
        assert isinstance(value, bytes)
        parts.append(f"{quote_literal(value.decode())}::{table.compare.get(name, 'text')}::text")
    key = tombstone_key(f"ARRAY[{', '.join(parts)}]::text[]")
    return (
        f"INSERT INTO pgmesh.tombstones (table_name, key, xid) VALUES ({quote_literal(table.name)}, {key},"
        f" pg_catalog.pg_current_xact_id()) ON CONFLICT (table_name, key) DO UPDATE SET xid = excluded.xid"
    )


def transaction_script(
    txn: Transaction,
    tables: Mapping[tuple[str, str], TargetTable],
    *,
    origin_lsn: int | None = None,
    prepared: Prepared | None = None,
    guard_origin: int | None = None,
    prelude: list[str] | None = None,
    remote: bool = True,
    setup_last: bool = True,
    mark: bool = False,
) -> str:
    """The whole target transaction for `txn` as one SQL script.

    `tables` maps (schema, name) to the target's table; `origin_lsn` is what the origin records
    (default: the transaction's end LSN, the position to resume from); with `prepared`, keyed updates
    and deletes run as prepared statements of the session (PREPARE emitted on first use). With
    `guard_origin` (the source's replication origin id on the target) every change raises instead of
    applying when it meets a conflict (see `router.apply.statements.guard`): the applier then takes the
    careful path.
    New PREPAREs go to `prelude` when given (to run before any transaction of a batch, so that a
    transaction that fails cannot take a prepared statement down with it), else inline. `remote`,
    `setup_last`: see `transaction_segments`.
    """
    (script,) = transaction_segments(
        txn, tables, origin_lsn=origin_lsn, prepared=prepared, guard_origin=guard_origin, prelude=prelude,
        copy=False, remote=remote, setup_last=setup_last, mark=mark,
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
    remote: bool = True,
    setup_last: bool = True,
    mark: bool = False,
) -> list[str | CopyRun]:
    """`transaction_script` cut where a run of inserts goes in by COPY: SQL scripts and `CopyRun`s, in
    order, the first opening the transaction and the last committing it. With `copy` False (or no
    run long enough) it is one script.

    A transaction too big to hold at once is cut into parts by the caller: `begin` / `commit` say
    whether this part opens / commits the target transaction, and `relations` (updated in place by
    inline Relation messages) carries the relation descriptions from one part to the next. A part read
    back from a spill file may hold `RawInsert`s (`router.stream.spool.iter_raw_chunks`): their rows go to
    COPY straight from the server's bytes, or are decoded for an INSERT.

    `at_commit` (statements before COMMIT, statements after it) is for a session that takes the
    replication origin only to commit (router.apply.lanes): the origin's `xact_setup` then goes
    just before COMMIT, after the first of the two. Else it goes just before COMMIT in the part that
    commits, after `SET CONSTRAINTS ALL IMMEDIATE` where deferred checks could fail at COMMIT (see the
    module's docstring); `setup` False leaves it out (the caller sends it, after `COMMIT_CHECKS`, before its
    own COMMIT). `setup_last` False (a PostgreSQL 15 target, where a rollback leaves the origin alone):
    the set-up goes with the first statement instead (in it, when that is a single guarded insert: one
    statement fewer). `mark` (a PostgreSQL 16+ target) has the set-up set the source's applied mark
    (router.progress.applied; `setup_statement`). `remote` False leaves `pgmesh.remote` out
    (router.apply.decide.Decisions.remote: a decision function then raises PGM03 instead of deciding).
    """
    args = setup_args(txn, origin_lsn, remote)  # the origin's position and commit time, once per transaction
    late = setup_last or mark or at_commit is not None or not setup  # the set-up just before COMMIT
    guarded = guard_origin is not None
    coarse = txn.row_count > KEY_LOCKS_MAX
    script = _Script(
        txn, tables, dict(txn.relations) if relations is None else relations, prepared, prelude, args,
        guard_origin, copy and (coarse or not guarded), coarse, begin and not late,
    )
    out = script.out
    if prepared is None:
        setup_sql = xact_setup_sql(txn, origin_lsn, mark)
    else:
        setup_sql = prepared.setup(args[:2] if late else args, script.sink, mark)
    script.setup_sql = setup_sql
    if begin:
        out.append("BEGIN")
    if begin and late and guarded and remote:  # the decision functions need it first
        out.append(remote_setting_sql(args) if prepared is None else prepared.remote(args[2], script.sink))
    changes: Sequence[SpilledChange] = txn.changes  # a part read back raw holds RawInserts, too
    if script.copy and _one_run(changes):  # a part of a bulk load: one COPY run, without the loop below
        script.run = list(changes)  # type: ignore[arg-type]  # all inserts (checked above)
        script.run_rel = script.relations[changes[0].relid]  # type: ignore[union-attr]
        changes = ()
    handlers = _SCRIPT.handlers
    for change in changes:
        handlers[type(change)](script, change)
    script.end_run()
    script.opening()  # a transaction (or opening part) without a statement still sets the origin up
    if commit:
        if late and (script.deferred or not begin):  # (a part: earlier parts may have touched such a table)
            out.append(COMMIT_CHECKS)  # a failure here rolls back before the setup
        if at_commit is not None:
            out += [at_commit[0], setup_sql, "COMMIT", at_commit[1]]
        else:
            out += [setup_sql, "COMMIT"] if late and setup else ["COMMIT"]
    segments = script.segments
    if out:
        segments.append(";\n".join(out) + ";")
    return segments


class _Script(ChangeContext):
    """One transaction (or part) being turned into its script: what the handlers of `_SCRIPT` share."""

    __slots__ = (
        "args", "coarse", "commit_time", "copy", "deferred", "guard_origin", "guarded", "origin_sql", "out",
        "pending", "prepared", "run", "run_rel", "segments", "setup_sql", "sink", "tables",
    )

    def __init__(
        self, txn: Transaction, tables: Mapping[tuple[str, str], TargetTable], relations: dict[int, Relation],
        prepared: Prepared | None, prelude: list[str] | None, args: list[str], guard_origin: int | None,
        copy: bool, coarse: bool, pending: bool,
    ) -> None:
        super().__init__(relations)
        self.tables = tables
        self.commit_time = txn.commit_time
        self.prepared = prepared
        self.args = args
        self.guard_origin = guard_origin
        self.guarded = guard_origin is not None
        self.origin_sql = None if guard_origin is None else f"'{guard_origin}'"
        self.copy = copy
        self.coarse = coarse
        self.out: list[str] = []
        self.sink = self.out if prelude is None else prelude  # where new PREPAREs go
        self.segments: list[str | CopyRun] = []
        self.setup_sql = ""
        self.pending = pending  # the origin set up with the first statement (still to come)
        self.deferred = False  # a table with deferred constraints: checked before a late set-up
        self.run: list[Insert | RawInsert] = []  # the run of inserts into one table being gathered
        self.run_rel: Relation | None = None

    def opening(self) -> None:
        if self.pending:
            self.out.append(self.setup_sql)
            self.pending = False

    def end_run(self) -> None:
        if self.run:
            self._flush_run()
            self.run = []

    def _flush_run(self) -> None:
        run, run_rel, out, prepared = self.run, self.run_rel, self.out, self.prepared
        assert run_rel is not None
        table = target_table(run_rel, self.tables)
        if table.skip:
            return  # a table this (partial) target does not get
        self.deferred = self.deferred or table.deferrable
        guarded, coarse = self.guarded, self.coarse
        if self.copy and len(run) >= COPY_MIN_ROWS:
            self.opening()
            if guarded:
                out.append(table_lock(table, exclusive=True))
            if out:
                self.segments.append(";\n".join(out) + ";")
                out.clear()
            for i in range(0, len(run), COPY_RUN):
                self.segments.append(CopyRun(run_rel, table, run[i : i + COPY_RUN], guarded, coarse))
            return
        rows = _decoded(run_rel, run)
        if prepared is not None and guarded and not coarse and len(rows) == 1 and _preparable(table):
            with_setup = self.args if self.pending else None
            self.pending = False
            out.append(prepared_insert(run_rel, table, rows[0], prepared, self.sink, with_setup))
            return
        self.opening()
        out.append(insert_rows(run_rel, table, rows, guarded, coarse))


def _insert(script: _Script, change: Insert | RawInsert) -> None:
    """Nearly every change of a large transaction: gathered into runs of one table."""
    relation = script.relations[change.relid]
    if relation is script.run_rel and (script.copy or len(script.run) < INSERT_RUN):
        script.run.append(change)  # the run goes on (the common case, first)
        return
    script.end_run()
    script.run_rel = relation
    script.run.append(change)


def _relation(script: _Script, change: Relation) -> None:
    script.end_run()
    note_relation(script, change)


def _nothing(script: _Script, change: Type | Message) -> None:
    script.end_run()


def _truncate(script: _Script, change: Truncate) -> None:
    script.end_run()
    script.opening()
    script.out.append(ORIGIN_MARK)  # a TRUNCATE's first change has no origin
    script.out.append(truncate_statement(change, script.relations, script.tables, script.commit_time))


def _row_table(script: _Script, change: Update | Delete) -> tuple[Relation, TargetTable] | None:
    """An update's or delete's relation and table (None: a table this target does not get)."""
    script.end_run()
    relation = script.relations[change.relid]
    table = target_table(relation, script.tables)
    if table.skip:
        return None
    script.deferred = script.deferred or table.deferrable
    script.opening()
    return relation, table


def _update(script: _Script, change: Update) -> None:
    found = _row_table(script, change)
    if found is None:
        return
    relation, table = found
    prepared, out = script.prepared, script.out
    if prepared is not None and _keyed(relation, change.old_kind):
        out.append(prepared_update(relation, table, change, prepared, script.sink, script.guard_origin))
    else:
        out.append(guard(update_statement(relation, table, change), script.origin_sql))
    moved = moved_key_tombstone(relation, table, change)
    if moved is not None:
        out.append(moved)


def _delete(script: _Script, change: Delete) -> None:
    found = _row_table(script, change)
    if found is None:
        return
    relation, table = found
    prepared, out = script.prepared, script.out
    if prepared is not None and _keyed(relation, change.old_kind):
        out.append(prepared_delete(relation, table, change, prepared, script.sink, script.guard_origin))
    else:
        out.append(guard(delete_statement(relation, table, change), script.origin_sql))


_SCRIPT: Final[Dispatch[_Script, None]] = Dispatch({
    Insert: _insert, RawInsert: _insert, Update: _update, Delete: _delete, Truncate: _truncate,
    Relation: _relation, Type: _nothing, Message: _nothing,
})


