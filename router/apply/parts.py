"""A large transaction's changes in parts: which transactions go in parts (`is_large`), its parts once it
is whole (`parts`), and the growing parts of one handed out before its commit (`growing_parts`).

A plain transaction that router.stream.source handed out at its first spill, or a streamed one it
announced (router.stream.items.EarlyStream), is read while its spill file grows: parts of
LARGE_PART_CHANGES changes as they are written, then the rest once the commit has arrived
(`whole_transaction` is then the whole Transaction). If the source loses it before the commit (an abort,
a reconnect: it is sent again, whole), reading raises `router.errors.LostBeforeCommit`, the one "lost
before commit" error the applier and the side session act on.

Must not: talk to the target, or build SQL (router.apply.large turns the parts into SQL and COPY).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator

from protocol.messages import Relation
from protocol.transactions import SpilledChange, Transaction
from router.apply.statements import KEY_LOCKS_MAX
from router.errors import LostBeforeCommit, PgmeshError
from router.stream.spool import iter_raw_chunks

__all__ = ["LARGE_PART_CHANGES", "growing_parts", "is_large", "parts", "whole_transaction"]

LARGE_PART_CHANGES = 50_000  # changes of a large transaction turned into SQL / COPY at once


def is_large(txn: Transaction) -> bool:
    """Applied alone, in parts, with COPY for runs of inserts (router.apply.large.LargeApply.apply)."""
    return txn.row_count > KEY_LOCKS_MAX or txn.spilled > 0


def whole_transaction(txn: Transaction) -> Transaction:
    """The whole transaction for one handed out before its commit, once the commit arrived."""
    spill = txn.spill
    if spill is not None and spill.early and spill.final is not None:
        whole: Transaction = spill.final
        return whole
    return txn


def parts(txn: Transaction) -> Iterator[list[SpilledChange]]:
    """The transaction's changes in parts of at most LARGE_PART_CHANGES (read back from the spool
    when it spilled to disk; inserts the source left undecoded stay so, for COPY)."""
    yield from iter_raw_chunks(txn, max_changes=LARGE_PART_CHANGES)


async def growing_parts(
    txn: Transaction, relations: dict[int, Relation]
) -> AsyncGenerator[tuple[list[SpilledChange], Transaction | None], None]:
    """The changes of `txn`, read before its commit while its spill file grows: parts of
    LARGE_PART_CHANGES as they are written, then the rest with the in-memory tail once the commit
    arrived; each part with the whole Transaction once the commit is there (None before). Before each
    part, `relations` gets the relations the source learnt meanwhile (`txn.relations` is the source
    assembler's own dict: it grows as later changes name more). Raises LostBeforeCommit when the file
    is abandoned before the commit."""
    spill = txn.spill
    live = txn.relations
    changed = spill.changed
    assert changed is not None
    pending: list[SpilledChange] = []
    pos = 0
    while True:
        changed.clear()
        final = spill.final
        if spill.abandoned and final is None:
            raise LostBeforeCommit(txn)
        try:
            got, pos = spill.read_frames(pos, LARGE_PART_CHANGES, raw=True)
        except PgmeshError:
            if spill.abandoned:
                raise LostBeforeCommit(txn) from None
            raise
        pending += got
        whole = final is not None and pos >= spill.size
        if whole:
            assert final is not None
            pending += final.changes  # the tail that never spilled
        while pending and (len(pending) >= LARGE_PART_CHANGES or whole):
            part = pending[:LARGE_PART_CHANGES]
            del pending[:LARGE_PART_CHANGES]
            for relid, relation in live.items():
                relations.setdefault(relid, relation)
            yield part, final
        if whole:
            return
        if not got:
            await changed.wait()
