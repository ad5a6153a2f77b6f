"""The relation cache: what each relation id means right now.

pgoutput describes a table once per walsender (and again after any schema change) with a Relation
message, and row changes refer to it only by id. The cache keeps the latest description per id and is
replaced entry by entry whenever a Relation message arrives; it never outlives a connection (the new
walsender resends every description it uses).
"""

from __future__ import annotations

from protocol.errors import UnknownRelation
from protocol.messages import Relation, Type

__all__ = ["RelationCache"]


class RelationCache:
    """Relation id -> latest Relation message; type oid -> latest Type message."""

    __slots__ = ("_relations", "_types")

    def __init__(self) -> None:
        self._relations: dict[int, Relation] = {}
        self._types: dict[int, Type] = {}

    def put(self, relation: Relation) -> None:
        self._relations[relation.relid] = relation

    def put_type(self, type_: Type) -> None:
        self._types[type_.oid] = type_

    def get(self, relid: int, *, lsn: int | None = None, tag: str | None = None) -> Relation:
        try:
            return self._relations[relid]
        except KeyError:
            raise UnknownRelation(relid, lsn=lsn, tag=tag) from None

    def type(self, oid: int) -> Type | None:
        """The Type message for a non-built-in type oid, if the server sent one."""
        return self._types.get(oid)

    def __contains__(self, relid: object) -> bool:
        return relid in self._relations

    def __len__(self) -> int:
        return len(self._relations)

    def clear(self) -> None:
        self._relations.clear()
        self._types.clear()
