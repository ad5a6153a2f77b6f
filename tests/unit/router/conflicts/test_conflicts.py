"""The pure resolver over every (conflict type x resolver) pair, ties and unknown commit times included."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.conflicts.resolve import (
    ConflictType,
    Decision,
    Outcome,
    Policy,
    Resolver,
    Version,
    merge_deltas,
    resolve,
)
from router.conflicts.symmetry import Resolvers, asymmetry, sample_rows
from router.errors import ConfigError

A, K, R = Outcome.APPLY_REMOTE, Outcome.KEEP_LOCAL, Outcome.ERROR
WITH_LOCAL = [
    ConflictType.INSERT_EXISTS,
    ConflictType.INSERT_DELETED,
    ConflictType.UPDATE_ORIGIN_DIFFERS,
    ConflictType.UPDATE_DELETED,
    ConflictType.DELETE_ORIGIN_DIFFERS,
]
# scenario -> (local version, remote version)
SCENARIOS = {
    "remote newer": (Version(100, "b"), Version(200, "a")),
    "remote older": (Version(200, "a"), Version(100, "b")),
    "tie, remote name larger": (Version(100, "a"), Version(100, "b")),
    "tie, remote name smaller": (Version(100, "b"), Version(100, "a")),
    "local time unknown": (Version(None, "c"), Version(5, "a")),
}
# resolver -> outcome per scenario, in SCENARIOS order (node_priority: ["a", "b", "c"], no window)
EXPECTED = {
    Resolver.LAST_UPDATE_WINS: [A, K, A, K, A],
    Resolver.FIRST_UPDATE_WINS: [K, A, K, A, K],
    Resolver.NODE_PRIORITY: [A, K, K, A, A],  # ties go to the higher-ranked node, a
    Resolver.KEEP_LOCAL: [K, K, K, K, K],
    Resolver.APPLY_REMOTE: [A, A, A, A, A],
    Resolver.ERROR: [R, R, R, R, R],
}
MISSING = {  # resolver -> (update_missing, delete_missing)
    Resolver.LAST_UPDATE_WINS: (A, K),
    Resolver.FIRST_UPDATE_WINS: (A, K),
    Resolver.NODE_PRIORITY: (A, K),
    Resolver.KEEP_LOCAL: (K, K),
    Resolver.APPLY_REMOTE: (A, K),
    Resolver.ERROR: (R, R),
}


def policy(resolver: Resolver, **kw: Any) -> Policy:
    return Policy(resolver=resolver, node_priority=("a", "b", "c"), **kw)


@pytest.mark.parametrize("conflict", WITH_LOCAL, ids=str)
@pytest.mark.parametrize("resolver", list(EXPECTED), ids=str)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_pair_with_a_local_version(conflict: ConflictType, resolver: Resolver, scenario: str) -> None:
    local, remote = SCENARIOS[scenario]
    decision = resolve(conflict, local, remote, policy(resolver))
    expected = EXPECTED[resolver][list(SCENARIOS).index(scenario)]
    assert decision.outcome is expected, decision.reason
    assert decision.resolver == resolver.value and decision.reason


@pytest.mark.parametrize("resolver", list(MISSING), ids=str)
def test_every_pair_without_a_local_row(resolver: Resolver) -> None:
    remote = Version(100, "a")
    update, delete = MISSING[resolver]
    assert resolve(ConflictType.UPDATE_MISSING, None, remote, policy(resolver)).outcome is update
    assert resolve(ConflictType.DELETE_MISSING, None, remote, policy(resolver)).outcome is delete


def test_node_priority_orders_by_rank_within_a_window_and_by_time_across() -> None:
    windowed = policy(Resolver.NODE_PRIORITY, window_us=1_000)
    # same window: rank decides, even against time
    assert (
        resolve(
            ConflictType.UPDATE_ORIGIN_DIFFERS, Version(1_100, "a"), Version(1_900, "c"), windowed
        ).outcome
        is K
    )
    assert (
        resolve(
            ConflictType.UPDATE_ORIGIN_DIFFERS, Version(1_900, "c"), Version(1_100, "a"), windowed
        ).outcome
        is A
    )
    # a later window wins whatever the rank
    assert (
        resolve(
            ConflictType.UPDATE_ORIGIN_DIFFERS, Version(1_100, "a"), Version(2_100, "c"), windowed
        ).outcome
        is A
    )


def test_tie_is_decided_alike_on_both_nodes() -> None:
    """Node a holds a's version and receives b's; node b the other way round: both keep the same one."""
    va, vb = Version(100, "a"), Version(100, "b")
    for resolver in (Resolver.LAST_UPDATE_WINS, Resolver.FIRST_UPDATE_WINS, Resolver.NODE_PRIORITY):
        on_a = resolve(ConflictType.UPDATE_ORIGIN_DIFFERS, va, vb, policy(resolver))
        on_b = resolve(ConflictType.UPDATE_ORIGIN_DIFFERS, vb, va, policy(resolver))
        kept_on_a = vb if on_a.outcome is A else va
        kept_on_b = va if on_b.outcome is A else vb
        assert kept_on_a == kept_on_b, resolver


versions = st.builds(Version, st.one_of(st.none(), st.integers(0, 50)), st.sampled_from(["a", "b", "c", "d"]))


@given(
    st.lists(versions, min_size=1, max_size=6, unique=True),
    st.sampled_from([Resolver.LAST_UPDATE_WINS, Resolver.FIRST_UPDATE_WINS, Resolver.NODE_PRIORITY]),
    st.integers(0, 20),
)
def test_order_of_arrival_does_not_matter(vs: list[Version], resolver: Resolver, window: int) -> None:
    """A row's versions reaching a node in any order leave the same winner: the resolver is a total order."""
    rules = policy(resolver, window_us=window)
    finals = set()
    for order in itertools.islice(itertools.permutations(vs), 24):
        kept = order[0]
        for incoming in order[1:]:
            if resolve(ConflictType.UPDATE_ORIGIN_DIFFERS, kept, incoming, rules).outcome is A:
                kept = incoming
        finals.add(kept)
    assert len(finals) == 1


def _pick_higher_qty(conflict: str, local: dict[str, Any], remote: dict[str, Any], lv: Any, rv: Any) -> Any:
    if conflict == "delete_missing":
        return "keep_local"
    return remote if remote.get("qty", 0) >= local.get("qty", 0) else None


def test_custom_resolver_gets_rows_and_versions() -> None:
    custom = "tests.unit.router.conflicts.test_conflicts:_pick_higher_qty"
    rules = Policy(resolver=Resolver.CUSTOM, custom=custom)
    win = resolve(
        ConflictType.UPDATE_ORIGIN_DIFFERS,
        Version(1, "a"),
        Version(2, "b"),
        rules,
        local_row={"qty": 1},
        remote_row={"qty": 5},
    )
    assert win == Decision(
        Outcome.USE_ROW,
        "custom tests.unit.router.conflicts.test_conflicts:_pick_higher_qty",
        "the custom resolver returned a row",
        {"qty": 5},
    )
    lose = resolve(
        ConflictType.UPDATE_ORIGIN_DIFFERS,
        Version(1, "a"),
        Version(2, "b"),
        rules,
        local_row={"qty": 9},
        remote_row={"qty": 5},
    )
    assert lose.outcome is K
    with pytest.raises(ConfigError, match="cannot be loaded"):
        resolve(
            ConflictType.INSERT_EXISTS,
            None,
            Version(1, "a"),
            Policy(resolver=Resolver.CUSTOM, custom="no.such:f"),
        )


def test_delta_columns_add_up() -> None:
    # stock 10 everywhere; node a sells 3 (10 -> 7), node b sells 2 (10 -> 8), concurrently
    on_a = merge_deltas({"qty": 7, "name": "x"}, {"qty": 10}, {"qty": 8, "name": "x"}, ["qty"])
    on_b = merge_deltas({"qty": 8, "name": "x"}, {"qty": 10}, {"qty": 7, "name": "x"}, ["qty"])
    assert on_a["qty"] == on_b["qty"] == 5


# ---------------------------------------------------------------------------------------------------------
# init's symmetry check for custom resolvers (router.conflicts.symmetry)

COLUMNS = {"id": "integer", "qty": "numeric(10,2)", "note": "text"}


def _later_wins(conflict: str, local: dict[str, Any], remote: dict[str, Any], lv: Any, rv: Any) -> Any:
    """Symmetric: the later version wins, as last_update_wins."""
    if lv is not None and lv.order() > rv.order():
        return dict(local) if local else "keep_local"
    return dict(remote) if conflict in ("update_origin_differs", "insert_exists") else "apply_remote"


def _larger_qty(conflict: str, local: dict[str, Any], remote: dict[str, Any], lv: Any, rv: Any) -> Any:
    """Symmetric on rows (typed compare of the text); a delete loses to any update."""
    if not local:
        return "apply_remote"
    if conflict == "delete_origin_differs":
        return "keep_local"
    mine, theirs = float(local["qty"] or 0), float(remote["qty"] or 0)
    return local if (mine, local["note"]) > (theirs, remote["note"]) else remote


def _remote_always(conflict: str, local: dict[str, Any], remote: dict[str, Any], lv: Any, rv: Any) -> Any:
    return "apply_remote"


def _typed_ids(conflict: str, local: dict[str, Any], remote: dict[str, Any], lv: Any, rv: Any) -> Any:
    return int(local["id"]) + int(remote["id"])  # not a valid result either way


def _everywhere(function: Any, only: ConflictType | None = None) -> Resolvers:
    """Each conflict type's (policy, function): `function` for `only` (None: every type), else the default."""
    custom = (Policy(Resolver.CUSTOM, custom="m:f"), function)
    return {k: custom if only in (None, k) else (Policy(), None) for k in ConflictType}


def test_a_symmetric_custom_resolver_passes() -> None:
    assert asymmetry(_everywhere(_later_wins), COLUMNS) is None
    assert asymmetry(_everywhere(_larger_qty), COLUMNS) is None


def test_only_pairs_a_custom_resolver_decides_are_played() -> None:
    """_remote_always for delete_missing only: every node does nothing there, whatever it returns."""
    assert asymmetry(_everywhere(_remote_always, ConflictType.DELETE_MISSING), COLUMNS) is None
    why = asymmetry(_everywhere(_remote_always, ConflictType.UPDATE_DELETED), COLUMNS)
    assert why is not None and why.startswith("update against delete"), why


def test_an_asymmetric_custom_resolver_is_named_with_the_pair() -> None:
    why = asymmetry(_everywhere(_remote_always), COLUMNS)
    assert why is not None and why.startswith("update against update, x = {'id': '1'"), why
    assert "the node holding x ends with {'id': '2'" in why, why


def test_a_custom_resolver_that_fails_on_a_pair_is_reported() -> None:
    why = asymmetry(_everywhere(_typed_ids), COLUMNS)
    assert why is not None and "returned 3" in why, why


def test_sample_rows_are_text_as_the_applier_gives_them() -> None:
    first, second = sample_rows(COLUMNS)
    assert first == {"id": "1", "qty": "1.5", "note": "a"}
    assert second == {"id": "2", "qty": "2.25", "note": "b"}
