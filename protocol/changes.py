"""The kinds of change a transaction carries, and one `{change kind: handler}` table to walk them.

A transaction's changes (`protocol.transactions.Transaction.changes`, and the parts of one read back
from a spill file) are of eight kinds: `Relation` and `Type` (a description sent inline), the row
changes `Insert`, `Update` and `Delete` (and `RawInsert`, an insert still in the server's bytes, which
only a part read back raw holds), `Truncate`, and `Message` (a transactional logical message: its
prefix says whose it is; `prefixes_of` collects them).

A reader that does something per kind (the appliers' scripts and careful path, the lanes' planning,
DDL reconciliation, the tombstone recorder, skip, `pgmesh tail`) walks them through a `Dispatch`: the
handler of each kind, looked up by the change's exact type in one dict (as `protocol.pgoutput` reads
messages by their tag), called with the reader's own context object and the change. A table names
every kind, so what a reader does with each one is read in one place; `ignore` is the handler of a
kind it has nothing to do with, `note_relation` the one that keeps a `ChangeContext`'s relations
current.

Must not: know what a reader does with a change, hold state, or allocate per change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, Generic, TypeVar

from protocol.messages import Delete, Insert, Message, RawInsert, Relation, Truncate, Type, Update

__all__ = [
    "KINDS",
    "Change",
    "ChangeContext",
    "Dispatch",
    "SpilledChange",
    "ignore",
    "note_relation",
    "prefixes_of",
]

# What a Transaction's changes hold, in stream order.
Change = Insert | Update | Delete | Truncate | Message | Relation | Type
# What a Spill (and a part read back raw) may also hold: an Insert not decoded yet.
SpilledChange = Change | RawInsert

KINDS: Final[tuple[type, ...]] = (Relation, Type, Insert, RawInsert, Update, Delete, Truncate, Message)

C = TypeVar("C")
R = TypeVar("R")


def prefixes_of(changes: Iterable[object]) -> set[str]:
    """The prefixes of the logical messages among `changes`."""
    return {c.prefix for c in changes if type(c) is Message}


class ChangeContext:
    """The relation descriptions as of the change being handled: the transaction's own
    (`Transaction.relations`), each inline Relation put in as it comes (`note_relation`). A reader's
    context extends it with what its handlers share."""

    __slots__ = ("relations",)

    def __init__(self, relations: dict[int, Relation]) -> None:
        self.relations = relations


def note_relation(context: ChangeContext, change: Relation) -> None:
    """The handler of an inline Relation: later changes of its relation are described by it."""
    context.relations[change.relid] = change


def ignore(context: object, change: object) -> None:
    """The handler of a kind the reader has nothing to do with."""


class Dispatch(Generic[C, R]):
    """One reader's `{change kind: handler}` table: `dispatch(context, change)` calls the handler of
    `type(change)` with them and returns what it returns.

    `handlers` names every kind of `KINDS` (or `otherwise` handles those it leaves out). A loop over
    many changes may take `handlers` once and index it itself (one dict lookup and one call per change).
    """

    __slots__ = ("handlers",)

    def __init__(
        self,
        handlers: Mapping[type, Callable[[C, Any], R]],
        *,
        otherwise: Callable[[C, Any], R] | None = None,
    ) -> None:
        unknown = [kind.__name__ for kind in handlers if kind not in KINDS]
        if unknown:
            raise TypeError(f"not a kind of change: {', '.join(unknown)}")
        table: dict[type, Callable[[C, Any], R]] = {}
        for kind in KINDS:
            handler = handlers.get(kind, otherwise)
            if handler is None:
                raise TypeError(f"no handler for {kind.__name__} changes")
            table[kind] = handler
        self.handlers: Final = table

    def __call__(self, context: C, change: SpilledChange) -> R:
        return self.handlers[type(change)](context, change)
