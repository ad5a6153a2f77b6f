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

from protocol.messages import KIND_NULL, KIND_UNCHANGED, Delete, Insert, Relation, TupleData, Type, Update
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
    keys: set[Hashable] = set()
    relations = dict(txn.relations)
    for change in txn.changes:
        if isinstance(change, Relation):
            relations[change.relid] = change
            continue
        if isinstance(change, Type):
            continue
        if not isinstance(change, (Insert, Update, Delete)):
            return None  # TRUNCATE or a transactional message: alone
        relation = relations[change.relid]
        ident = [c.name for c in relation.columns if c.key]
        if not ident or (not isinstance(change, Insert) and change.old_kind == "O"):
            return None  # rows matched by every column: alone
        name = (relation.schema, relation.name)
        table = tables.get(name)
        images: list[TupleData] = []
        if isinstance(change, Insert):
            images.append(change.new)
        elif isinstance(change, Update):
            images.append(change.new)
            if change.old is not None:
                images.append(change.old)
        else:
            images.append(change.old)
        for image in images:
            key = _values(relation, image, ident)
            if key is not None:
                keys.add((name, tuple(ident), key))
        if table is not None and not isinstance(change, Delete):
            for unique in table.uniques:
                key = _values(relation, change.new, unique)
                if key is not None:
                    keys.add((name, unique, key))
    return keys


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
