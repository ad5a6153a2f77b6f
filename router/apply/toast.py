"""The unchanged TOAST values a winning remote update did not bring, read on its source.

pgoutput leaves a TOASTed value an UPDATE did not change out of the new row ("unchanged TOAST"). Applied
over the row it was made on, that is harmless: the target holds the same value. But when the change wins
a conflict it is written over another version of the row (which may hold another value there), or it
re-creates a row deleted here: then the left-out values are needed, and only the source has them. They
are read there by key, and used only when the source's row is still at exactly the change's version;
otherwise a later version of the row (or its deletion) is on the source, will reach the target after this
change, and decides against whatever is there: the change is skipped and recorded as such, so every node
still ends with the latest version whole (docs/conflicts.md, "Unchanged TOAST values").

Must not: write anything, or read anything but the one row on the source.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from protocol.lsn import datetime_to_pg_us
from protocol.messages import KIND_UNCHANGED, Relation, Update
from protocol.transactions import Transaction
from router.apply.careful.sql import read_row_sql
from router.apply.statements import TargetTable
from router.apply.uniques import row_where
from router.config.model import Config
from router.conflicts.resolve import ConflictType, Decision, Outcome, Version, resolve

__all__ = ["ReadSource", "whole_row"]

Row = dict[str, str | None]
ReadSource = Callable[[str], Awaitable[Mapping[str, Any] | None]]


class Careful(Protocol):
    """What `whole_row` needs of the careful applier."""

    config: Config
    source: str
    read_source: ReadSource | None


class LocalVersion(Protocol):
    version: Version
    row: Row | None


def _key(relation: Relation, change: Update) -> Row:
    """The row's values as the change leaves them (its key, where the source has the row now)."""
    data = change.new
    return {c.name: v.decode() if isinstance(v, bytes) else None
            for c, k, v in zip(relation.columns, data.kinds, data.values, strict=False)
            if k != KIND_UNCHANGED}


async def whole_row(
    careful: Careful,
    txn: Transaction,
    relation: Relation,
    table: TargetTable,
    change: Update,
    new: Row,
    conflict: ConflictType,
    local: LocalVersion | None,
    remote: Version,
) -> tuple[Row, Decision | None]:
    """The remote row, whole, when it wins and pgoutput left unchanged TOAST values out of it.

    Overwriting another version of the row, or re-creating it, needs those values, which only the
    source has: they are read there, by key, and used only when the source's row is still at this
    very version (committed by the source itself at the remote commit time). Otherwise the source
    holds a later version of the row (or has deleted it), which reaches this node after this one and
    decides against what is here: this change is skipped, and recorded as such. Returns the row and
    the decision to record (None: decide as usual)."""
    if all(c.name in new for c in relation.columns) or careful.read_source is None:
        return new, None
    policy = careful.config.policy(relation.schema, relation.name, conflict.value)
    decision = resolve(conflict, local.version if local else None, remote, policy,
                       local_row=local.row if local else None, remote_row=new)
    if decision.outcome is not Outcome.APPLY_REMOTE:
        return new, None
    key = _key(relation, change)
    read = read_row_sql(table, row_where(key, table.pk, table.compare), lock=False)
    found = await careful.read_source(read)
    at = found["pgmesh_ts"] if found is not None else None
    if found is not None and found["pgmesh_origin"] in (0, None) and at is not None \
            and datetime_to_pg_us(at) == txn.commit_time:
        whole: Row = {**json.loads(found["pgmesh_row"]), **new}
        reason = f"{decision.reason}; the unchanged TOAST values read on {careful.source} at this version"
        return whole, Decision(Outcome.APPLY_REMOTE, decision.resolver, reason)
    reason = (f"{decision.reason}, but the change left TOAST values out and {careful.source} holds a later"
              " version of the row now (or none): skipped, that version follows")
    return new, Decision(Outcome.KEEP_LOCAL, decision.resolver, reason)

