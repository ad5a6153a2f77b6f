"""Rows sent before a replicated rename or drop, fitted to the target's columns (`reconcile`).

A transaction decoded on one node before DDL renamed or dropped a column can reach a target after that
DDL ran there: its rows then name a column the target no longer has. The capture (`router.ddl.capture`)
records on every node what each table's columns were called (`pgmesh.column_changes`); the applier reads
those changes as a `Drift` (table -> old column name -> new name, or None when dropped) and hands them
here. A column the target lacks that was renamed is sent under its new name; one that was dropped is
left out; a difference no recorded change explains is left for the applier to report.

Must not: talk to a node, read the catalog, or change a transaction in place (it returns a new one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import msgspec

from protocol.changes import Dispatch
from protocol.messages import Delete, Insert, Message, RawInsert, Relation, Truncate, TupleData, Type, Update
from protocol.pgoutput import decode_raw_insert
from protocol.transactions import Transaction
from router.ddl.messages import DDL_PREFIX

__all__ = ["Drift", "reconcile"]

Drift = Mapping[str, Mapping[str, str | None]]  # "schema.table" -> old column name -> new name / None


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
    dropped is left out. Only the rows before the transaction's first DDL command are fitted: the
    command changes the columns the rows after it meet. None when nothing needed fitting or a
    difference is not explained (the caller then reports the missing column).
    """
    fitting = _Fitting(columns, drift)
    relations: dict[int, Relation] = {}
    for relid, relation in txn.relations.items():
        result = fitting.fit(relation)
        if result is None:
            return None
        fitting.current[relid] = result
        relations[relid] = result[0]
    handlers = _FIT.handlers
    for n, change in enumerate(txn.changes):
        if not handlers[type(change)](fitting, change):
            if fitting.unexplained:
                return None
            # DDL in this transaction runs on the target before the rows after it: those rows are fitted
            # to the columns it leaves, not to today's (a column dropped long ago and added again here is
            # not the dropped one); a difference still left then is reported, never dropped silently
            fitting.changes.extend(txn.changes[n:])
            break
    if not fitting.changed:
        return None
    return msgspec.structs.replace(txn, changes=fitting.changes, relations=relations)


class _Fitting:
    """One transaction being fitted: what the handlers of `_FIT` share. A handler returns False to stop
    (DDL: the rest goes as it is; or `unexplained`: the transaction cannot be fitted)."""

    __slots__ = ("changed", "changes", "columns", "current", "drift", "unexplained")

    def __init__(self, columns: Mapping[tuple[str, str], frozenset[str]], drift: Drift) -> None:
        self.columns = columns
        self.drift = drift
        # relid -> its relation fitted, and the positions of the columns kept (None: all of them)
        self.current: dict[int, tuple[Relation, list[int] | None]] = {}
        self.changes: list[Any] = []
        self.changed = False
        self.unexplained = False

    def fit(self, relation: Relation) -> tuple[Relation, list[int] | None] | None:
        have = self.columns.get((relation.schema, relation.name))
        if have is None or all(c.name in have for c in relation.columns):
            return relation, None
        changes = self.drift.get(f"{relation.schema}.{relation.name}", {})
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
        self.changed = True
        return msgspec.structs.replace(relation, columns=tuple(out)), kept


def _cut(data: TupleData | None, kept: list[int]) -> TupleData | None:
    if data is None:
        return None
    return TupleData(bytes(data.kinds[i] for i in kept), tuple(data.values[i] for i in kept))


def _relation(fitting: _Fitting, change: Relation) -> bool:
    result = fitting.fit(change)
    if result is None:
        fitting.unexplained = True
        return False
    fitting.current[change.relid] = result
    fitting.changes.append(result[0])
    return True


def _kept(fitting: _Fitting, change: Insert | RawInsert | Update | Delete) -> list[int] | None:
    """The positions its relation keeps, when it does not keep them all (else the change goes as it is)."""
    entry = fitting.current.get(change.relid)
    kept = None if entry is None else entry[1]
    if not kept:
        fitting.changes.append(change)
    return kept


def _insert(fitting: _Fitting, change: Insert | RawInsert) -> bool:
    if kept := _kept(fitting, change):
        if isinstance(change, RawInsert):  # a part read back raw from a spill file
            change = decode_raw_insert(change)
        fitting.changes.append(msgspec.structs.replace(change, new=_cut(change.new, kept)))
    return True


def _update(fitting: _Fitting, change: Update) -> bool:
    if kept := _kept(fitting, change):
        new, old = _cut(change.new, kept), _cut(change.old, kept)
        fitting.changes.append(msgspec.structs.replace(change, new=new, old=old))
    return True


def _delete(fitting: _Fitting, change: Delete) -> bool:
    if kept := _kept(fitting, change):
        fitting.changes.append(msgspec.structs.replace(change, old=_cut(change.old, kept)))
    return True


def _message(fitting: _Fitting, change: Message) -> bool:
    if change.prefix == DDL_PREFIX:
        return False  # it and the rest go as they are
    fitting.changes.append(change)
    return True


def _as_it_is(fitting: _Fitting, change: Truncate | Type) -> bool:
    fitting.changes.append(change)
    return True


_FIT: Final[Dispatch[_Fitting, bool]] = Dispatch({
    Relation: _relation, Insert: _insert, RawInsert: _insert, Update: _update, Delete: _delete,
    Message: _message, Truncate: _as_it_is, Type: _as_it_is,
})
