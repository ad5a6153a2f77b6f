"""The careful path's row values and records: a row image as a dict of column text, what an update leaves
at the source, and one decided conflict (router.apply.careful.transaction).

Pure: no I/O. Shared by what decides (router.apply.careful.transaction) and what reads the target
(router.apply.careful.local).
"""

from __future__ import annotations

from protocol.messages import KIND_UNCHANGED, Relation, TupleData, Update
from router.apply.statements import TargetTable
from router.conflicts.resolve import ConflictType, Decision

__all__ = ["ConflictRecord", "Row", "keyless", "new_row_values", "row_values"]

Row = dict[str, str | None]


def keyless(table: TargetTable) -> bool:
    return not (table.pk or table.uniques or table.indexes)


class ConflictRecord:
    """One decided conflict (also written to pgmesh.conflict_history)."""

    __slots__ = ("conflict", "decision", "key", "table")

    def __init__(self, table: str, key: str, conflict: ConflictType, decision: Decision) -> None:
        self.table = table
        self.key = key
        self.conflict = conflict
        self.decision = decision


def row_values(relation: Relation, data: TupleData) -> Row:
    out: Row = {}
    for column, kind, value in zip(relation.columns, data.kinds, data.values, strict=False):
        if kind == KIND_UNCHANGED:
            continue
        out[column.name] = value.decode() if isinstance(value, bytes) else None
    return out


def new_row_values(relation: Relation, change: Update) -> Row:
    """The row an update leaves at the source: its new values, and the old row's for a column sent as
    unchanged TOAST when the whole old row came (REPLICA IDENTITY FULL)."""
    new = row_values(relation, change.new)
    if change.old is not None and change.old_kind == "O":
        for name, value in row_values(relation, change.old).items():
            new.setdefault(name, value)
    return new
