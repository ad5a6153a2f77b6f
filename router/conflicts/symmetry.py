"""Whether a custom resolver decides alike on every node: run it on generated pairs, in both orders. Pure.

Two nodes that hold different versions of a row each receive the other's: on one node x is local and y
remote, on the other the reverse. They end with the same row only if the resolver's outcome does not
depend on which side is local. `asymmetry` plays both sides for generated pairs of rows and versions
(later / earlier / same commit time, unknown time, every order of node names) and says which pair ended
apart, or None. Pairs: an update against an update (update_origin_differs both ways), an insert against
an insert (insert_exists), and an update against a delete (delete_origin_differs on the updating node,
update_deleted on the deleting one). A resolver that raises is reported too: on the apply path it would
stop the link.

Rows are given as the applier gives them: each column's text (None for NULL), on both sides.
`pgmesh init` runs this for every table with a custom resolver (router.cluster.checks); nothing here
connects anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from router.conflicts.resolve import ConflictType, Outcome, Policy, Resolver, Version, resolve
from router.errors import ConfigError

__all__ = ["Resolvers", "asymmetry", "sample_rows"]

_GONE: Final = "the row deleted"
_T0: Final = 800_000_000_000_000  # 2025-05-09, µs since 2000-01-01
# Two text values per column type, as PostgreSQL writes them (the first word of the type decides).
_VALUES: Final[Mapping[str, tuple[str, str]]] = {
    "smallint": ("1", "2"), "integer": ("1", "2"), "bigint": ("1", "2"), "numeric": ("1.5", "2.25"),
    "real": ("1.5", "2.5"), "double": ("1.5", "2.5"), "boolean": ("f", "t"), "text": ("a", "b"),
    "character": ("a", "b"), "uuid": ("00000000-0000-0000-0000-000000000001",
                                      "00000000-0000-0000-0000-000000000002"),
    "date": ("2025-01-01", "2025-01-02"), "timestamp": ("2025-01-01 00:00:00", "2025-01-02 00:00:00"),
    "jsonb": ('{"k": 1}', '{"k": 2}'), "json": ('{"k": 1}', '{"k": 2}'), "bytea": ("\\x01", "\\x02"),
}


def sample_rows(columns: Mapping[str, str]) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """Two different rows of a table with these columns (name -> type as format_type writes it)."""
    first: dict[str, str | None] = {}
    second: dict[str, str | None] = {}
    for name, type_ in columns.items():
        pair = _VALUES.get(type_.split("(")[0].split()[0] if type_ else "", ("1", "2"))
        first[name], second[name] = pair
    return first, second


def _versions() -> list[tuple[Version, Version]]:
    times = [(_T0, _T0 + 1000), (_T0 + 1000, _T0), (_T0, _T0), (None, _T0), (_T0, None), (None, None)]
    nodes = [("a", "b"), ("b", "a")]
    return [(Version(tx, nx), Version(ty, ny)) for tx, ty in times for nx, ny in nodes]


Resolvers = Mapping[ConflictType, tuple[Policy, Any]]  # each type's policy and its loaded custom function


def _end(resolvers: Resolvers, conflict: ConflictType, local: tuple[Version, Any],
         remote: tuple[Version, Any]) -> Any:
    """The row a node ends with (None: no row; "error": the link stops) after deciding the pair."""
    (lv, lrow), (rv, rrow) = local, remote
    policy, function = resolvers[conflict]
    remote_row = rrow if rrow is not None else lrow  # a delete carries the deleted row (identity full)
    decision = resolve(conflict, lv, rv, policy, local_row=lrow, remote_row=remote_row, custom=function)
    if decision.outcome is Outcome.ERROR:
        return "error"
    if decision.outcome is Outcome.USE_ROW:
        return decision.row
    return rrow if decision.outcome is Outcome.APPLY_REMOTE else lrow


def _when(version: Version) -> str:
    time = version.commit_time
    at = "unknown time" if time is None else "t" if time == _T0 else f"t+{(time - _T0) // 1000}ms"
    return f"{at} on {version.node}"


def _show(end: Any) -> str:
    return _GONE if end is None else "error" if end == "error" else repr(end)


_CASES: Final = (
    ("update against update", ConflictType.UPDATE_ORIGIN_DIFFERS, ConflictType.UPDATE_ORIGIN_DIFFERS),
    ("insert against insert", ConflictType.INSERT_EXISTS, ConflictType.INSERT_EXISTS),
    ("update against delete", ConflictType.DELETE_ORIGIN_DIFFERS, ConflictType.UPDATE_DELETED),
)


def asymmetry(resolvers: Resolvers, columns: Mapping[str, str]) -> str | None:
    """Why a table's resolvers (`resolvers`: each conflict type's policy and custom function, None for a
    built-in) can leave two nodes apart, or None. Only pairs where a custom resolver decides are played."""
    x_row, y_row = sample_rows(columns)
    for what, on_x, on_y in _CASES:
        if all(resolvers[kind][0].resolver is not Resolver.CUSTOM for kind in (on_x, on_y)):
            continue
        deleting = on_y is ConflictType.UPDATE_DELETED
        y_state = None if deleting else y_row  # the deleting node holds a tombstone
        for vx, vy in _versions():
            try:
                # on the node that wrote x, y arrives; on the node that wrote y, x arrives
                end_x = _end(resolvers, on_x, (vx, x_row), (vy, y_state))
                end_y = _end(resolvers, on_y, (vy, y_state), (vx, x_row))
            except ConfigError as exc:
                return f"{what}: {exc.message}"
            except Exception as exc:  # the user's function: anything it raises would stop the link
                return f"{what}: it raised {type(exc).__name__}: {exc}"
            if end_x != end_y:
                y_shown = "a delete" if deleting else y_row
                return (
                    f"{what}, x = {x_row} at {_when(vx)}, y = {y_shown} at {_when(vy)}: the node holding x"
                    f" ends with {_show(end_x)}, the node holding y with {_show(end_y)}"
                )
    return None
