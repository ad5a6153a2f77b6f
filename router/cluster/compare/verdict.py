"""Who wins a differing key in a repair: a pure decision over each node's state of the key.

A node's state of a key (`State`) is its row (as JSON, with its version and hash) or, where it holds none,
the key's tombstone (the deleting transaction's version: `pgmesh.tombstones`, or the table's TRUNCATE,
whichever is later) or nothing at all. The winner is decided by the versions and the rules the conflict
path uses (router.conflicts.resolve, with the table's resolvers), so a repair ends where replication
would have ended had every change reached every node:

- the rows are folded by the table's `update_origin_differs` rule; how many nodes hold a row never
  counts (a copy of a row is not a new row: only versions are weighed);
- the winning row then meets the tombstone of each node that lacks it, as that node's apply would meet
  the row's change (`update_deleted`, the tombstone being the local version): a tombstone that wins (by
  last_update_wins: a newer one) deletes the key everywhere; one that loses (an older one) gives way to
  the row;
- a node without the row and without a tombstone has no version (`update_missing`: no record of a
  deletion): the row is copied there. Such keys are counted per node (`Verdict.lacking`), for the caller
  to hint at `--from NODE` (a deletion pgmesh never saw leaves no tombstone);
- with `--from NODE` (`source`), that node's state wins: its row, or its absence.

A rule that says `error` (or a custom resolver that asks to stop) decides nothing: the key is refused.

Must not: do I/O, or decide which keys differ.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import msgspec

from router.conflicts.resolve import ConflictType, Outcome, Policy, Resolver, Version, resolve

__all__ = ["Policies", "State", "Verdict", "decide"]


class State(msgspec.Struct, frozen=True):
    """One node's state of a key: its row (JSON of `to_jsonb`, its version, its hash) or, with `row`
    None, its tombstone's version (None: no record of a deletion)."""

    row: str | None
    version: Version | None
    hash: int | None = None


class Policies(msgspec.Struct, frozen=True):
    """A table's rules: between two rows (update_origin_differs) and a row against a tombstone
    (update_deleted)."""

    rows: Policy
    deleted: Policy


class Verdict(msgspec.Struct, frozen=True):
    """What every node of a key is made to hold: `winner`'s row (None: no row, the key deleted
    everywhere), written as of `version` (the winning row's, or the winning tombstone's; None: unknown).
    `lacking`: nodes that held neither the row nor a tombstone (the row copied there by the default rule)."""

    key: str
    winner: str
    row: str | None
    hash: int | None  # the winning row's hash (None: no row)
    version: Version | None
    lacking: tuple[str, ...] = ()


def _beats(conflict: ConflictType, local: Version, local_row: str | None, remote: Version,
           remote_row: str | None, policy: Policy) -> bool | None:
    """Whether the remote side wins (None: the rule decides nothing: error)."""
    custom = policy.resolver is Resolver.CUSTOM  # (only a custom resolver reads the rows)
    decision = resolve(
        conflict, local, remote, policy,
        local_row=json.loads(local_row) if custom and local_row is not None else None,
        remote_row=json.loads(remote_row) if custom and remote_row is not None else None,
    )
    if decision.outcome is Outcome.ERROR:
        return None
    return decision.outcome is Outcome.APPLY_REMOTE


def decide(key: str, states: Mapping[str, State], policies: Policies, source: str | None = None) -> (
    Verdict | None
):
    """The key's verdict (see the module docstring); None when the table's rule refuses to decide, or
    when no node holds a row (nothing left to repair)."""
    if source is not None:
        mine = states[source]
        return Verdict(key, source, mine.row, mine.hash, mine.version)
    present = [n for n in sorted(states) if states[n].row is not None]
    if not present:
        return None
    best = present[0]
    for node in present[1:]:
        here, there = states[best], states[node]
        assert here.version is not None and there.version is not None
        if there.hash == here.hash and there.version == here.version:
            continue  # the same row, the same version: a copy, not a rival
        won = _beats(ConflictType.UPDATE_ORIGIN_DIFFERS, here.version, here.row, there.version, there.row,
                     policies.rows)
        if won is None:
            return None
        if won:
            best = node
    row = states[best]
    assert row.version is not None
    absent = [n for n in sorted(states) if states[n].row is None]
    tombs = sorted((n for n in absent if states[n].version is not None),
                   key=lambda n: _order(states[n].version), reverse=True)
    for node in tombs:
        tomb = states[node].version
        assert tomb is not None
        row_wins = _beats(ConflictType.UPDATE_DELETED, tomb, None, row.version, row.row, policies.deleted)
        if row_wins is None:
            return None
        if not row_wins:
            return Verdict(key, node, None, None, tomb)
    lacking = tuple(n for n in absent if states[n].version is None)
    return Verdict(key, best, row.row, row.hash, row.version, lacking)


def _order(version: Version | None) -> tuple[int, str]:
    assert version is not None
    return version.order()
