"""Conflict resolution: (conflict type, local version, remote version, policy) -> a decision. Pure.

A *version* is what pgmesh knows of one state of a row: the commit time and the node that committed it
(`pg_xact_commit_timestamp_origin(xmin)` on the local row; the source's commit time and name for the
remote change; a tombstone's for a recently deleted row). Every resolver here is a deterministic function
of the two versions (and, for `node_priority`, the configured order), never of the node deciding, the
arrival order or the clock: that is what lets every node decide alike (see docs/conflicts.md for the
convergence argument and which resolvers promise it).

Rule for an unknown commit time (xmin frozen, or the row predates pgmesh): the version counts as older
than any version with a known time, and among unknown ones the node name decides.

No I/O here: the applier detects conflicts on the target and asks this module what to do.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import msgspec

from router.errors import ConfigError

__all__ = [
    "ConflictType",
    "Decision",
    "Outcome",
    "Policy",
    "Resolver",
    "Version",
    "can_diverge",
    "load_custom",
    "merge_deltas",
    "resolve",
]

_UNKNOWN_TIME: Final = -(1 << 62)  # older than any real commit time


class ConflictType(enum.StrEnum):
    INSERT_EXISTS = "insert_exists"  # the key (primary or another unique key) is already there
    INSERT_DELETED = "insert_deleted"  # no row, but a tombstone says the key was deleted recently
    UPDATE_ORIGIN_DIFFERS = "update_origin_differs"  # the local row was last written by another node
    UPDATE_MISSING = "update_missing"  # no local row, no record of a deletion
    UPDATE_DELETED = "update_deleted"  # no local row: it was deleted recently (a tombstone says when)
    DELETE_ORIGIN_DIFFERS = "delete_origin_differs"
    DELETE_MISSING = "delete_missing"


class Resolver(enum.StrEnum):
    LAST_UPDATE_WINS = "last_update_wins"
    FIRST_UPDATE_WINS = "first_update_wins"
    NODE_PRIORITY = "node_priority"
    KEEP_LOCAL = "keep_local"
    APPLY_REMOTE = "apply_remote"
    ERROR = "error"
    CUSTOM = "custom"


# Built-in resolvers that are not a total order over versions that also covers local writes: nodes using
# them can end with different rows (docs/conflicts.md "Resolvers"). The config refuses them unless
# `[conflicts] allow_divergence = true`.
_DIVERGENT: Final = frozenset({Resolver.KEEP_LOCAL, Resolver.APPLY_REMOTE, Resolver.FIRST_UPDATE_WINS})


def can_diverge(resolver: Resolver, conflict: ConflictType | None = None) -> bool:
    """Whether `resolver`, used for `conflict` (None: for every type), can leave nodes apart.

    For delete_missing every built-in resolver does nothing (the row is gone everywhere); for
    update_missing every one but keep_local inserts the row, as last_update_wins does. Custom resolvers
    are not judged here: `init` runs them on generated pairs (router.conflicts.symmetry).
    """
    if resolver not in _DIVERGENT or conflict is ConflictType.DELETE_MISSING:
        return False
    return conflict is not ConflictType.UPDATE_MISSING or resolver is Resolver.KEEP_LOCAL


class Outcome(enum.StrEnum):
    APPLY_REMOTE = "apply_remote"  # the remote change wins (for a missing row: insert its new row)
    KEEP_LOCAL = "keep_local"  # the remote change is skipped; the local state stays
    USE_ROW = "use_row"  # a custom resolver chose this row
    ERROR = "error"  # pause the link, skip nothing


class Version(msgspec.Struct, frozen=True):
    """One state of a row: when it was committed (µs since 2000-01-01 UTC; None: unknown) and where."""

    commit_time: int | None
    node: str

    def order(self) -> tuple[int, str]:
        return (_UNKNOWN_TIME if self.commit_time is None else self.commit_time, self.node)


class Decision(msgspec.Struct, frozen=True):
    outcome: Outcome
    resolver: str
    reason: str
    row: dict[str, Any] | None = None


CustomResolver = Callable[..., Any]


class Policy(msgspec.Struct, frozen=True):
    """The resolver for one (table, conflict type), as configured."""

    resolver: Resolver = Resolver.LAST_UPDATE_WINS
    node_priority: tuple[str, ...] = ()
    window_us: int = 0  # node_priority: versions within one window of time are ordered by node rank
    custom: str | None = None  # "module:function" for Resolver.CUSTOM


def _rank(node: str, priority: Sequence[str]) -> int:
    """Higher wins: the first listed node has the highest rank; unlisted nodes rank below all listed."""
    try:
        return len(priority) - priority.index(node)
    except ValueError:
        return 0


def _priority_order(version: Version, policy: Policy) -> tuple[int, int, int, str]:
    time, node = version.order()
    window = time // policy.window_us if policy.window_us > 0 else time
    return (window, _rank(node, policy.node_priority), time, node)


def _remote_wins(resolver: Resolver, local: Version, remote: Version, policy: Policy) -> bool:
    if resolver is Resolver.LAST_UPDATE_WINS:
        return remote.order() > local.order()
    if resolver is Resolver.FIRST_UPDATE_WINS:
        return remote.order() < local.order()
    if resolver is Resolver.NODE_PRIORITY:
        return _priority_order(remote, policy) > _priority_order(local, policy)
    return resolver is Resolver.APPLY_REMOTE  # keep_local: never


def _compare_reason(won: bool, local: Version, remote: Version, resolver: Resolver) -> str:
    side = "remote" if won else "local"
    if local.order()[0] == remote.order()[0] and resolver is Resolver.LAST_UPDATE_WINS:
        return f"{side} wins: same commit time, node name {max(local.node, remote.node)!r} breaks the tie"
    if local.commit_time is None:
        return f"{side} wins: the local commit time is unknown (frozen or older than pgmesh): oldest"
    return f"{side} wins by {resolver.value}"


def resolve(
    conflict: ConflictType,
    local: Version | None,
    remote: Version,
    policy: Policy,
    *,
    local_row: Mapping[str, Any] | None = None,
    remote_row: Mapping[str, Any] | None = None,
    custom: CustomResolver | None = None,
) -> Decision:
    """What to do with a remote change that met a conflict on the target.

    `local` is the local row's version (for update_deleted: the tombstone's; for the *_missing types:
    None). The result never depends on which node calls it.
    """
    resolver = policy.resolver
    name = resolver.value
    if resolver is Resolver.ERROR:
        return Decision(Outcome.ERROR, name, f"{conflict.value}: the table's rule is error")
    if resolver is Resolver.CUSTOM:
        return _custom(conflict, local, remote, policy, local_row, remote_row, custom)
    if conflict is ConflictType.DELETE_MISSING:
        return Decision(Outcome.KEEP_LOCAL, name, "nothing to delete: the row is already gone")
    if local is None:  # update_missing: nothing local to weigh against
        if resolver is Resolver.KEEP_LOCAL:
            return Decision(Outcome.KEEP_LOCAL, name, "no local row; keep_local leaves it absent")
        return Decision(Outcome.APPLY_REMOTE, name, "no local row and no record of a deletion: insert it")
    won = _remote_wins(resolver, local, remote, policy)
    outcome = Outcome.APPLY_REMOTE if won else Outcome.KEEP_LOCAL
    return Decision(outcome, name, _compare_reason(won, local, remote, resolver))


def _custom(
    conflict: ConflictType,
    local: Version | None,
    remote: Version,
    policy: Policy,
    local_row: Mapping[str, Any] | None,
    remote_row: Mapping[str, Any] | None,
    custom: CustomResolver | None,
) -> Decision:
    """A user function: `f(conflict, local_row, remote_row, local_version, remote_version)`.

    Both rows come in the same form: column name -> the column's text as PostgreSQL's output function
    writes it (None for NULL): the remote row as pgoutput sent it, the local row read with `::text`
    (router.apply.careful.sql). Not typed values: see docs/conflicts.md "Custom resolvers" for why. A
    column pgoutput did not send (unchanged TOAST) is absent from the remote row. It returns a dict (the
    row to keep, values as text), "apply_remote", "keep_local" / None (skip) or "error".
    """
    function = custom or (load_custom(policy.custom) if policy.custom else None)
    if function is None:
        raise ConfigError("resolver = 'custom' needs custom = 'module:function'")
    result = function(conflict.value, dict(local_row or {}), dict(remote_row or {}), local, remote)
    label = f"custom {policy.custom or getattr(function, '__name__', '?')}"
    if isinstance(result, dict):
        return Decision(Outcome.USE_ROW, label, "the custom resolver returned a row", result)
    if result in (None, "keep_local", "skip"):
        return Decision(Outcome.KEEP_LOCAL, label, "the custom resolver kept the local state")
    if result == "apply_remote":
        return Decision(Outcome.APPLY_REMOTE, label, "the custom resolver applied the remote change")
    if result == "error":
        return Decision(Outcome.ERROR, label, "the custom resolver asked to stop")
    raise ConfigError(
        f"custom resolver {label} returned {result!r}; expected a row, a skip or 'apply_remote'"
    )


def load_custom(spec: str) -> CustomResolver:
    """`"package.module:function"` -> the function (a clear error if it cannot be found)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"custom resolver {spec!r}: expected 'module:function'")
    try:
        module = importlib.import_module(module_name)
        function = getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"custom resolver {spec!r} cannot be loaded: {exc}") from exc
    if not callable(function):
        raise ConfigError(f"custom resolver {spec!r} is not callable")
    result: CustomResolver = function
    return result


def merge_deltas(
    local: Mapping[str, Any],
    remote_old: Mapping[str, Any],
    remote_new: Mapping[str, Any],
    columns: Sequence[str],
) -> dict[str, Any]:
    """Delta columns add up: local + (remote new - remote old) for each; other columns from `remote_new`.

    Applied to every remote update of such a column (not only to conflicts), each node ends with the
    initial value plus every node's changes, whatever the order: addition commutes. Needs the old value,
    which pgoutput sends only under REPLICA IDENTITY FULL.
    """
    merged = dict(remote_new)
    for column in columns:
        old, new, mine = remote_old.get(column), remote_new.get(column), local.get(column)
        if old is None or new is None or mine is None:
            merged[column] = new if mine is None else mine if new is None else new
            continue
        merged[column] = mine + (new - old)
    return merged
