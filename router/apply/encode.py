"""A source transaction encoded once for every target: the statements its changes become, each a `Shape`
and its parameters, the tuple's own text bytes as pgoutput sent them (router.apply.pipe binds them as
they are: no Python value, no SQL literal per column).

A shape says what a statement does and on which columns: a keyed update (the columns it sets: those
the change carries, an unchanged TOAST value is not; then the key's columns), a keyed delete (the key's
columns), a single insert (every column; its locks and the insert read the same parameters). Nothing
here depends on the target: what its SQL is there (the target's types and keys, the origin's id, the
decision functions) the pipe works out once per shape and session (router.apply.shapes). So a
transaction is encoded once, by the first of its source's links that sends it (`Encoder`, shared by
the links of one source), and every other link sends the same parameters. A shape's number (one
`Encoder`'s count) names its statements in every session of the source's links (router.apply.shapes), so
the Bind + Execute bytes of a change are built once too, by the first link that sends them, and kept in
its `Encoded` (`bound`) for the others.

What the pipe does not take is left to the script path (router.apply.scripts): a transaction large
enough to lock whole tables (router.apply.parts.is_large), a TRUNCATE, a row matched by its whole
row (REPLICA IDENTITY FULL), an update that moves its key, a value in binary, a key value left out as an
unchanged TOAST value. `encode` returns None for those.

Must not: build SQL, know a target's tables, or connect.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

import msgspec

from protocol.lsn import format_lsn
from protocol.messages import (
    KIND_BINARY,
    KIND_UNCHANGED,
    Cell,
    Delete,
    Insert,
    Message,
    Relation,
    Type,
    Update,
)
from protocol.transactions import Transaction
from router.apply.parts import is_large
from router.apply.statements import commit_time_literal, remote_version

__all__ = ["DELETE", "INSERT", "UPDATE", "Encoded", "Encoder", "Shape", "encode"]

UPDATE: Final = "U"
DELETE: Final = "D"
INSERT: Final = "I"

# A new tuple's kinds -> its mask: 1 where a value is an unchanged TOAST value (left out), else 0.
_MASK: Final = bytes(1 if i == KIND_UNCHANGED else 0 for i in range(256))
_CACHED: Final = 4096  # transactions whose encoding a source's links share (the oldest go first)
# and their bytes at most (`_size`): 16 MB of payload, and the Bind bytes the links build of it
_CACHED_BYTES: Final = 48 << 20
_BIND_BYTES: Final = 48  # a Bind + Execute's own bytes besides its parameters' (name, lengths, Execute)

Params = tuple[bytes | None, ...]


class Shape:
    """What one statement does, on which relation version and columns: `sets` (an update's columns set,
    parameters first), `keys` (the key's columns, parameters after them). The same object for every
    change of that shape (`Encoder`), so a session finds its statement by identity."""

    __slots__ = ("code", "keys", "number", "pick", "relation", "sets", "usable")

    def __init__(self, code: str, relation: Relation, sets: tuple[int, ...], keys: tuple[int, ...],
                 usable: bool, number: int = 0) -> None:
        self.code = code
        self.number = number  # unique among one Encoder's shapes: its statements' names in every session
        self.relation = relation
        self.sets = sets
        self.keys = keys
        # the parameters out of a row's values, in C: an update's set columns then its key, a delete's
        # key, an insert's row as it is (None for NULL, the text bytes otherwise)
        columns = keys if code == DELETE else sets + keys if code == UPDATE else ()
        self.pick: Callable[[tuple[Cell, ...]], Params] = (
            _whole if code == INSERT else (lambda v, i=columns[0]: (v[i],)) if len(columns) == 1  # type: ignore[misc]
            else operator.itemgetter(*columns))
        # a change of this shape can go through the pipe: it names its row by a key, none of whose values
        # is an unchanged TOAST value (an update's key from its new row)
        self.usable = usable

    def __repr__(self) -> str:
        name = f"{self.relation.schema}.{self.relation.name}"
        return f"Shape({self.code} {name} sets={self.sets} keys={self.keys})"


Change = Insert | Update | Delete


class Encoded(msgspec.Struct, frozen=True, gc=False):
    """One transaction's statements, `(shape, parameters, change)` in order, and its origin set-up's
    parameters: `setup` (end LSN, commit time). The change is kept for what a target checks by value
    (an identity GENERATED ALWAYS column an update would move). `bound`: the Bind + Execute bytes of its
    statements by (place, statement name), filled by the first link that sends each
    (router.apply.shapes.Statements.wire; names are the same in every session of the source's links). Not
    tracked by the garbage collector (the fan-out holds thousands: as `Transaction`; `bound` holds bytes
    only)."""

    statements: tuple[tuple[Shape, Params, Change], ...]
    setup: Params
    txn: Transaction
    bound: dict[tuple[int, bytes], bytes] = msgspec.field(default_factory=dict)

    def remote(self) -> Params:
        """`setup` and the remote version the decision functions read (router.apply.decide): only for a
        link that sends it (`Decisions.remote`)."""
        lsn, when = self.setup
        assert lsn is not None and when is not None
        return (lsn, when, remote_version(self.txn, lsn.decode(), when.decode()).encode())


def _size(txn: Transaction, enc: Encoded) -> int:
    """What a cached encoding holds at most: the payload, and its Bind bytes built for the links (each
    change's parameters bound at most twice, as an insert's locks and the insert, or once with the set-up
    fused in; the set-up's own)."""
    return 3 * txn.nbytes + _BIND_BYTES * (2 * len(enc.statements) + 3)


def _whole(values: tuple[Cell, ...]) -> Params:
    return values  # type: ignore[return-value]  # an insert's row: no unchanged TOAST value in it



class Encoder:
    """Encodes one source's transactions for all its links (`encoded`), each once: the shapes of
    statements and the last transactions' encodings are shared."""

    __slots__ = ("_bytes", "_cache", "_shapes", "encodes", "hits")

    def __init__(self) -> None:
        # (id(relation), code, mask) -> its shape; the shape holds the relation (its id stays its own)
        self._shapes: dict[tuple[int, str, bytes], Shape] = {}
        # id(txn) -> the transaction, its encoding, its payload bytes: the newest, within _CACHED and
        # _CACHED_BYTES (a link further behind than that encodes again: memory stays bounded)
        self._cache: OrderedDict[int, tuple[Transaction, Encoded, int]] = OrderedDict()
        self._bytes = 0
        self.encodes = 0  # transactions encoded (each once)
        self.hits = 0  # encodings another link had made

    def encoded(self, txn: Transaction) -> Encoded | None:
        """`txn` encoded (None: the script path takes it), by the first link that asks."""
        cache = self._cache
        cached = cache.get(id(txn))
        if cached is not None and cached[0] is txn:
            self.hits += 1
            return cached[1]
        result = encode(txn, self._shapes)
        self.encodes += 1
        if result is None:
            return None
        size = _size(txn, result)
        cache[id(txn)] = (txn, result, size)
        self._bytes += size
        while len(cache) > _CACHED or self._bytes > _CACHED_BYTES:
            self._bytes -= cache.popitem(last=False)[1][2]
        return result

    def shape(self, code: str, relation: Relation, mask: bytes) -> Shape:
        return _shape(self._shapes, code, relation, mask)


def _shape(shapes: dict[tuple[int, str, bytes], Shape], code: str, relation: Relation, mask: bytes) -> Shape:
    key = (id(relation), code, mask)
    found = shapes.get(key)
    if found is None:
        keys = tuple(i for i, c in enumerate(relation.columns) if c.key)
        sets = tuple(i for i in range(len(relation.columns)) if not mask[i]) if code == UPDATE else ()
        usable = code == INSERT or (bool(keys) and not (mask and any(mask[i] for i in keys)))
        if code == INSERT:
            sets = tuple(range(len(relation.columns)))
        found = shapes[key] = Shape(code, relation, sets, keys, usable, len(shapes) + 1)
    return found


def encode(txn: Transaction, shapes: dict[tuple[int, str, bytes], Shape] | None = None) -> Encoded | None:
    """`txn`'s statements and parameters (see the module's docstring); None when the pipe does not take it.
    `shapes`: the shapes made so far, shared (`Encoder`)."""
    if is_large(txn) or txn.spill is not None:
        return None
    shapes = {} if shapes is None else shapes
    relations = dict(txn.relations)
    statements: list[tuple[Shape, Params, Change]] = []
    append = statements.append
    for change in txn.changes:
        kind = type(change)
        if kind is Update:
            assert isinstance(change, Update)
            if change.old_kind is not None:  # a moved key ('K') or a whole old row ('O')
                return None
            new = change.new
            kinds = new.kinds
            shape = _shape(shapes, UPDATE, relations[change.relid], kinds.translate(_MASK))
            if not shape.usable or KIND_BINARY in kinds:
                return None
            append((shape, shape.pick(new.values), change))
        elif kind is Insert:
            assert isinstance(change, Insert)
            new = change.new
            if KIND_BINARY in new.kinds or KIND_UNCHANGED in new.kinds:
                return None
            append((_shape(shapes, INSERT, relations[change.relid], b""), new.values, change))  # type: ignore[arg-type]
        elif kind is Delete:
            assert isinstance(change, Delete)
            old = change.old
            if change.old_kind != "K" or old is None:
                return None
            shape = _shape(shapes, DELETE, relations[change.relid], b"")
            if not shape.usable or KIND_BINARY in old.kinds:
                return None
            append((shape, shape.pick(old.values), change))
        elif kind is Relation:
            assert isinstance(change, Relation)
            relations[change.relid] = change
        elif kind is not Type and kind is not Message:
            return None  # a TRUNCATE, a raw insert read back from a spill
    setup = (format_lsn(txn.end_lsn).encode(), commit_time_literal(txn.commit_time).encode())
    return Encoded(tuple(statements), setup, txn)

