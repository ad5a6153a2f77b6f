"""router.cluster.compare.verdict: who wins a differing key, by the conflict path's versions and rules."""

from __future__ import annotations

from router.cluster.compare.verdict import Policies, State, decide
from router.conflicts.resolve import Policy, Resolver, Version

LWW = Policies(Policy(), Policy())


def row(t: int, node: str, h: int) -> State:
    return State(f'{{"v": {h}}}', Version(t, node), h)


def test_a_newer_tombstone_deletes_the_row_everywhere() -> None:
    states = {"a": State(None, Version(300, "a")), "b": row(200, "b", 2), "c": row(100, "c", 1)}
    verdict = decide("(1)", states, LWW)
    assert verdict is not None and verdict.row is None and verdict.winner == "a"
    assert verdict.version == Version(300, "a")


def test_an_older_tombstone_gives_way_to_the_row() -> None:
    states = {"a": State(None, Version(100, "a")), "b": row(200, "b", 2), "c": row(50, "c", 1)}
    verdict = decide("(1)", states, LWW)
    assert verdict is not None and verdict.winner == "b" and verdict.row is not None and verdict.hash == 2
    assert verdict.lacking == ()


def test_a_node_with_no_record_of_a_deletion_gets_the_row_and_is_named() -> None:
    states = {"a": row(100, "a", 1), "b": row(100, "a", 1), "c": State(None, None)}
    verdict = decide("(1)", states, LWW)
    assert verdict is not None and verdict.winner == "a" and verdict.lacking == ("c",)


def test_copies_of_a_row_do_not_outvote_a_newer_one() -> None:
    old = [row(100, "a", 1), row(100, "a", 1), row(100, "a", 1)]
    states = {"a": old[0], "b": old[1], "c": old[2], "d": row(101, "d", 9)}
    verdict = decide("(1)", states, LWW)
    assert verdict is not None and verdict.winner == "d"


def test_from_a_node_takes_its_row_or_its_absence() -> None:
    states = {"a": State(None, None), "b": row(200, "b", 2)}
    verdict = decide("(1)", states, LWW, source="a")
    assert verdict is not None and verdict.row is None and verdict.winner == "a"


def test_the_tables_rule_decides_rows_and_tombstones() -> None:
    keep_deletes = Policies(Policy(), Policy(resolver=Resolver.KEEP_LOCAL))
    states = {"a": State(None, Version(1, "a")), "b": row(200, "b", 2)}
    verdict = decide("(1)", states, keep_deletes)
    assert verdict is not None and verdict.row is None  # update_deleted = keep_local: the deletion stays
    refuse = Policies(Policy(resolver=Resolver.ERROR), Policy())
    assert decide("(1)", {"a": row(1, "a", 1), "b": row(2, "b", 2)}, refuse) is None
