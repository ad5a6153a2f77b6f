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
from typing import Any

import msgspec

from protocol.messages import Delete, Insert, Message, RawInsert, Relation, TupleData, Update
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
    for n, change in enumerate(txn.changes):
        if isinstance(change, Message) and change.prefix == DDL_PREFIX:
            # DDL in this transaction runs on the target before the rows after it: those rows are fitted
            # to the columns it leaves, not to today's (a column dropped long ago and added again here is
            # not the dropped one); a difference still left then is reported, never dropped silently
            changes.extend(txn.changes[n:])
            break
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
