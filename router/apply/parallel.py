"""Which of a batch of source transactions may run at the same time on the target: pure planning, no I/O.

Transactions run in parallel on several sessions ("lanes") of one link and still commit one after the
other in source commit order (router.apply.lanes does the ordering). Two transactions may overlap only when
no row key of one is a row key of the other: every key a change names (the replica identity of the old
row and of the new one) and every unique key of the target table the new row fills. A transaction that
shares a key with a transaction already placed goes to that transaction's lane, behind it; one that
shares keys with transactions in two different lanes ends the plan (it starts the next batch). So does
anything that is not a plain keyed row change (TRUNCATE, a logical message, a row matched by all its
columns): such a transaction runs alone.

Must not: connect, or decide anything about conflicts (a conflict makes the lane fail; the applier then
applies the rest of the batch one by one, as without lanes).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Final

from protocol.changes import ChangeContext, Dispatch, note_relation
from protocol.messages import (
    KIND_NULL,
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
from protocol.transactions import Transaction
from router.apply.statements import TargetTable

__all__ = ["plan_lanes", "row_keys"]

Tables = Mapping[tuple[str, str], TargetTable]


def _values(relation: Relation, row: TupleData, names: Sequence[str]) -> tuple[bytes | None, ...] | None:
    """The row's values for `names`, or None when one is missing, NULL or unchanged (no key then)."""
    position = {c.name: i for i, c in enumerate(relation.columns)}
    out: list[bytes | None] = []
    for name in names:
        i = position.get(name)
        if i is None or row.kinds[i] in (KIND_NULL, KIND_UNCHANGED):
            return None
        value = row.values[i]
        out.append(value if isinstance(value, bytes) else None)
    return tuple(out)


def row_keys(txn: Transaction, tables: Tables) -> set[Hashable] | None:
    """Every row key `txn` touches, or None when it must run alone."""
    keys = _Keys(dict(txn.relations), tables)
    handlers = _KEYS.handlers
    for change in txn.changes:
        if not handlers[type(change)](keys, change):
            return None
    return keys.keys


class _Keys(ChangeContext):
    """The row keys of one transaction found so far (the handlers of `_KEYS` add to them)."""

    __slots__ = ("keys", "tables")

    def __init__(self, relations: dict[int, Relation], tables: Tables) -> None:
        super().__init__(relations)
        self.tables = tables
        self.keys: set[Hashable] = set()


def _add(
    keys: _Keys, relid: int, images: tuple[TupleData, ...], new: TupleData | None, full: bool = False
) -> bool:
    """The keys of a row change's `images` (and the unique keys its `new` row fills); False when its rows
    are matched by every column (`full`, or no key): it runs alone."""
    relation = keys.relations[relid]
    ident = [c.name for c in relation.columns if c.key]
    if not ident or full:
        return False
    name = (relation.schema, relation.name)
    table = keys.tables.get(name)
    for image in images:
        key = _values(relation, image, ident)
        if key is not None:
            keys.keys.add((name, tuple(ident), key))
    if table is not None and new is not None:
        for unique in table.uniques:
            key = _values(relation, new, unique)
            if key is not None:
                keys.keys.add((name, unique, key))
    return True


def _insert(keys: _Keys, change: Insert) -> bool:
    return _add(keys, change.relid, (change.new,), change.new)


def _update(keys: _Keys, change: Update) -> bool:
    images = (change.new,) if change.old is None else (change.new, change.old)
    return _add(keys, change.relid, images, change.new, change.old_kind == "O")


def _delete(keys: _Keys, change: Delete) -> bool:
    return _add(keys, change.relid, (change.old,), None, change.old_kind == "O")


def _relation(keys: _Keys, change: Relation) -> bool:
    note_relation(keys, change)
    return True


def _no_rows(keys: _Keys, change: Type) -> bool:
    return True


def _alone(keys: _Keys, change: Truncate | Message | RawInsert) -> bool:
    return False  # TRUNCATE or a transactional message: alone


_KEYS: Final[Dispatch[_Keys, bool]] = Dispatch({
    Insert: _insert, Update: _update, Delete: _delete, Relation: _relation, Type: _no_rows,
    Truncate: _alone, Message: _alone, RawInsert: _alone,
})


def plan_lanes(batch: Sequence[Transaction], tables: Tables, lanes: int) -> list[int]:
    """The lane of each transaction of the longest prefix of `batch` that can be planned.

    Independent transactions are spread over the lanes (the least loaded first); a transaction that
    depends on one lane follows it there. The prefix ends before a transaction that must run alone or
    that depends on two lanes.
    """
    placed: dict[Hashable, int] = {}
    load = [0] * lanes
    out: list[int] = []
    for txn in batch:
        keys = row_keys(txn, tables)
        if keys is None:
            break
        touched = {placed[k] for k in keys if k in placed}
        if len(touched) > 1:
            break
        lane = touched.pop() if touched else min(range(lanes), key=load.__getitem__)
        for key in keys:
            placed[key] = lane
        load[lane] += max(1, txn.row_count)
        out.append(lane)
    return out
