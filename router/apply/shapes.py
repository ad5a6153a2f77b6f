"""The pipe session's statements on one target (`Statements`): what each shape of router.apply.encode is
there, prepared once per session under a name of its own, and the plan of a batch of encoded transactions
as the (statement, parameters) pairs the pipe sends (router.apply.pipe).

Each applied transaction is BEGIN, its statements, the origin's set-up, COMMIT, as the script path's
(router.apply.scripts): on PostgreSQL 15 the set-up goes first, on 16+ just before COMMIT (with the
applied mark, router.progress.applied; after `SET CONSTRAINTS ALL IMMEDIATE` where a table checks
constraints at COMMIT), and the remote version the decision functions read is set right after BEGIN.
A shape's SQL is the script path's prepared statement (router.apply.prepared) with the source's origin id
written into its text: every link sends the same parameters, the tuple's own bytes, and only this
session knows its origin. A single insert is two statements, its locks and the insert, both reading
every column (the locks pick the key's: which columns those are is this target's business).

A statement's name is the same in every session of the source's links: a shape's from its number
(router.apply.encode.Shape), the fixed statements' (BEGIN, the set-up, COMMIT, ...) from what they are.
So a change's Bind + Execute bytes, built by the first link that sends them, serve every other link
(`wire`, cached in the `Encoded`). A statement made again (a reset, a lost batch) keeps its name: the
next batch closes the old one first (`stale`; PostgreSQL runs a batch's Close, then Parse, in order).

A shape this target cannot run as a statement raises `Unpipeable` (the script path takes that
transaction); a table it does not get (a partial node) leaves the statement out.

Must not: connect, send, retry, or decide conflicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from protocol.frontend import bind_body, bind_execute, bind_named
from protocol.messages import Update
from protocol.transactions import Transaction
from router.apply.encode import INSERT, UPDATE, Encoded, Params, Shape
from router.apply.prepared import Prepared, delete_sql, insert_sql, update_sql
from router.apply.scripts import COMMIT_CHECKS
from router.apply.statements import (
    TargetTable,
    check_always,
    key_lock,
    quote_literal,
    setup_statement,
    target_table,
)
from router.errors import Unpipeable
from router.stream.seen import APPLIED_PREFIX, applied_content

__all__ = ["DECIDED", "Plan", "Statements"]

_TEXT: Final = 25  # the text type's OID: a parameter the statement does not read has no type of its own

# Conflicts decided since the last count: what router.apply.link.DECIDED asks, and reset here, in the pipe
# session itself (where the decision functions set it).
DECIDED: Final = (
    "SELECT pg_catalog.set_config('pgmesh.decided', '', false)"
    " FROM pg_catalog.current_setting('pgmesh.decided', true) AS d WHERE d = 'y'"
)


class _Statement:
    """One shape's statement in this session: its name (None: the target does not get the table), the
    insert's lock statement, the table (for the checks by value)."""

    __slots__ = ("always", "deferrable", "fused", "lock", "locks", "name", "table", "width")

    def __init__(self, name: bytes | None, lock: bytes | None, table: TargetTable | None) -> None:
        self.name = name
        self.lock = lock
        self.table = table
        self.locks = ""  # an insert's locks (SQL items), for `fused`
        self.width = 0  # an insert's parameters
        # the locks with the origin's set-up first (PostgreSQL 15: a transaction's first statement), by
        # whether they set the remote version too
        self.fused: dict[bool, bytes] = {}
        self.always = False  # an update's, on a table with an identity GENERATED ALWAYS (checked by value)
        self.deferrable = table is not None and table.deferrable


_SKIP: Final = _Statement(None, None, None)

Plan = list[tuple[bytes, Params | None]]
# (place, name, parameters): place is the change's index in its Encoded (or one of the set-up's below), so
# that (place, name) always means the same parameters of that transaction, on every link
_Item = tuple[int, bytes, Params | None]
_SETUP15: Final = -1  # the set-up alone, first (15)
_REMOTE: Final = -2  # the remote version (16+)
_SETUP16: Final = -3  # the set-up with the applied mark, last (16+)


class Statements:
    """The pipe session's prepared statements (see the module docstring)."""

    __slots__ = (
        "_bare", "_counter", "_fixed", "_numbers", "_shapes", "fresh", "late", "mark", "new", "origin",
        "origin_name", "source", "stale", "tables",
    )

    def __init__(self, source: str, origin_name: str, *, late: bool, mark: bool) -> None:
        self.source = source
        self.origin_name = origin_name
        self.late = late  # the set-up just before COMMIT (16+)
        self.mark = mark  # and the applied mark with it (16+)
        self.origin = ""  # the source's origin id here, as SQL (set with the tables)
        self.tables: dict[tuple[str, str], TargetTable] = {}
        self._shapes: dict[Shape, _Statement] = {}
        self._numbers: dict[int, Shape] = {}  # whose number names its statements (one per number)
        self._counter = 0
        self._bare: dict[bytes, bytes] = {}  # the Bind + Execute of a statement without parameters
        self.new: list[tuple[bytes, str, Sequence[int] | None]] = []  # PREPAREs not sent yet
        self.fresh: list[bytes] = []  # names prepared by the batch in flight (gone if it fails)
        self.stale: list[bytes] = []  # names no shape uses any more, for the next batch to close
        self._fixed: dict[str, bytes] = {}

    def reset(self) -> None:
        """Every statement made again (the tables were read again, a table's inserts decide insert_exists
        now: their SQL changed), under the same names: the old ones are closed by the next batch
        (`stale`), before it prepares any again."""
        unsent = {name for name, _, _ in self.new}
        for st in self._shapes.values():
            names = (st.name, st.lock, *st.fused.values())
            self.stale += [n for n in names if n is not None and n not in unsent]
        self.stale += [n for n in self._fixed.values() if n not in unsent]
        self._shapes = {}
        self._numbers = {}
        self._fixed = {}
        self.new = []

    def lost(self) -> None:
        """The batch in flight failed: what it prepared may or may not be there (a Parse before the failed
        command ran): prepared again when used, each closed first (`stale`)."""
        if self.fresh:
            gone = set(self.fresh)
            self._shapes = {
                s: st for s, st in self._shapes.items() if st.name not in gone and st.lock not in gone}
            self._numbers = {n: s for n, s in self._numbers.items() if s in self._shapes}
            for st in self._shapes.values():
                if st.fused:
                    st.fused = {remote: name for remote, name in st.fused.items() if name not in gone}
            self._fixed = {k: n for k, n in self._fixed.items() if n not in gone}
            self.stale += self.fresh
            self.fresh = []

    def sent(self) -> None:
        """The batch's PREPAREs went out: they are the batch's own until it succeeds (`lost`)."""
        self.fresh = [name for name, _, _ in self.new]
        self.new = []

    def _name(self, name: bytes, sql: str, types: Sequence[int] | None = None) -> bytes:
        self.new.append((name, sql, types))
        return name

    def fixed(self, key: str, sql: str, types: Sequence[int] | None = None) -> bytes:
        """A statement known by `key` (its name's end: the same in every session of the source)."""
        name = self._fixed.get(key)
        if name is None:
            name = self._fixed[key] = self._name(f"pgmesh_{key}".encode(), sql, types)
        return name

    def _base(self, shape: Shape) -> str:
        """The start of `shape`'s statements' names: its number, or (a shape not of the source's Encoder,
        whose number another shape has here) one of this session's own."""
        held = self._numbers.setdefault(shape.number, shape) if shape.number else None
        if held is shape:
            return f"pgmesh_s{shape.number}"
        self._counter += 1
        return f"pgmesh_x{self._counter}"

    def _fused(self, st: _Statement, remote: bool) -> bytes:
        """An insert's locks with the origin's set-up (and the remote version) first: its parameters are
        the row's, then the set-up's."""
        name = st.fused.get(remote)
        if name is None:
            n = st.width
            setting = f", pg_catalog.set_config('pgmesh.remote', ${n + 3}, true)" if remote else ""
            setup = f"pg_catalog.pg_replication_origin_xact_setup(${n + 1}::pg_lsn, ${n + 2}::timestamptz)"
            sql = f"SELECT {setup}{setting}, {st.locks}"
            assert st.name is not None
            name = st.fused[remote] = self._name(
                st.name + (b"f1" if remote else b"f0"), sql, [_TEXT] * (n + (3 if remote else 2)))
        return name

    def statement(self, shape: Shape, prepared: Prepared) -> _Statement:
        found = self._shapes.get(shape)
        if found is None:
            found = self._shapes[shape] = self._make(shape, prepared)
        return found

    def _make(self, shape: Shape, prepared: Prepared) -> _Statement:
        relation = shape.relation
        table = target_table(relation, self.tables)  # SchemaMismatch: the script path fits or reports it
        if table.skip:
            return _SKIP
        keys, sets = list(shape.keys), list(shape.sets)
        base = self._base(shape).encode()
        if shape.code == UPDATE:
            sql = update_sql(relation, table, sets, keys, self.origin, prepared)
            made = _Statement(self._name(base, sql), None, table)
            made.always = bool(table.always)
            return made
        if shape.code == INSERT:
            if not table.types or not all(k in table.types for k in table.tombstone_key):
                raise Unpipeable("an insert the target's types do not key", relation=table.name)
            sql, positions, types = insert_sql(relation, table, prepared)
            texts = [f"${p + 1}::{t}::text" for p, t in zip(positions, types, strict=True)]
            single = texts[0] if len(texts) == 1 else None
            array = "ARRAY[" + ", ".join(texts) + "]::text[]"
            name = quote_literal(table.name)
            locks = (f"pg_catalog.pg_advisory_xact_lock_shared(pg_catalog.hashtext({name}), 0),"
                     f" {key_lock(table, array, single)}")
            width = len(relation.columns)
            lock = self._name(base + b"l", f"SELECT {locks}", [_TEXT] * width)
            made = _Statement(self._name(base, sql), lock, table)
            made.locks, made.width = locks, width
            return made
        sql = delete_sql(relation, table, keys, self.origin, prepared)
        return _Statement(self._name(base, sql), None, table)

    def _setup(self, remote: bool) -> bytes:
        """The origin's set-up alone: on 16+ the last statement, with the applied mark (the remote version
        is set apart, first); on 15 the first, with the remote version when `remote`."""
        if self.late:
            return self.fixed("setup", setup_statement("$1::pg_lsn", "$2::timestamptz", None, self.mark))
        third = "$3" if remote else None
        return self.fixed(f"setup{remote}", setup_statement("$1::pg_lsn", "$2::timestamptz", third, False))

    def transaction(self, enc: Encoded, prepared: Prepared, remote: bool) -> Plan:
        """The (statement, parameters) pairs of one encoded transaction: BEGIN to COMMIT. Raises
        `Unpipeable`, or what router.apply.statements.target_table raises, for the script path to take it."""
        return [(name, params) for _, name, params in self._items(enc, prepared, remote)]

    def wire(self, enc: Encoded, prepared: Prepared, remote: bool) -> list[bytes]:
        """`transaction` as the Bind + Execute bytes of each pair: those with parameters built once per
        transaction for all the source's links (`enc.bound`), those without once per session."""
        bound, bare = enc.bound, self._bare
        out: list[bytes] = []
        add = out.append
        last: Params | None = None  # an insert's locks and the insert bind the same parameters: built once
        body = b""
        for place, name, params in self._items(enc, prepared, remote):
            if params is None:
                piece = bare.get(name)
                if piece is None:
                    piece = bare[name] = bind_execute(name, None)
            else:
                key = (place, name)
                piece = bound.get(key)
                if piece is None:
                    if params is not last:
                        last, body = params, bind_body(params)
                    piece = bound[key] = bind_named(name, body)
            add(piece)
        return out

    def _items(self, enc: Encoded, prepared: Prepared, remote: bool) -> list[_Item]:
        begin = self.fixed("begin", "BEGIN")
        late = self.late
        out: list[_Item] = [(0, begin, None)]
        add = out.append
        pending = not late  # (15) the set-up still to send, with the first statement if it can
        if late and remote:
            set_remote = self.fixed("remote", "SELECT pg_catalog.set_config('pgmesh.remote', $1, true)")
            add((_REMOTE, set_remote, enc.remote()[2:]))
        deferred = False
        shapes = self._shapes
        for place, (shape, params, change) in enumerate(enc.statements):
            st = shapes.get(shape) or self.statement(shape, prepared)
            if st.name is None:
                continue
            if st.always:
                assert st.table is not None and isinstance(change, Update)
                check_always(shape.relation, st.table, change)
            if st.lock is not None:
                if pending:  # one statement fewer for the target
                    pending = False
                    add((place, self._fused(st, remote), params + (enc.remote() if remote else enc.setup)))
                else:
                    add((place, st.lock, params))
            elif pending:
                pending = False
                add((_SETUP15, self._setup(remote), enc.remote() if remote else enc.setup))
            add((place, st.name, params))
            deferred = deferred or st.deferrable
        if pending:
            add((_SETUP15, self._setup(remote), enc.remote() if remote else enc.setup))
        if late:
            if deferred:
                add((0, self.fixed("checks", COMMIT_CHECKS), None))
            add((_SETUP16, self._setup(False), enc.setup))
        add((0, self.fixed("commit", "COMMIT"), None))
        return out

    def ending(self, batch: Sequence[Transaction], announce: bool, source: str) -> Plan:
        """What follows a batch's commits: on 16+ the applied note (as
        router.apply.link.LinkSession.applied_note), then DECIDED."""
        out: Plan = []
        if announce and batch:
            note = self.fixed("note", (
                "SELECT pg_catalog.pg_replication_origin_session_reset(),"
                f" pg_catalog.pg_logical_emit_message(false, {quote_literal(APPLIED_PREFIX)}, $1),"
                f" pg_catalog.pg_replication_origin_session_setup({quote_literal(self.origin_name)})"
            ))
            out.append((note, (applied_content(source, max(t.commit_time for t in batch)).encode(),)))
        out.append((self.fixed("decided", DECIDED), None))
        return out
