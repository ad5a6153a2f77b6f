"""router.apply.state: a link's state moves by one setter along its table; its counters are one struct."""

from __future__ import annotations

import logging

import pytest

from router.apply.state import TRANSITIONS, LinkCondition, LinkState, LinkStats, LinkView


def test_every_state_has_its_transitions() -> None:
    assert set(TRANSITIONS) == set(LinkState)
    for state, targets in TRANSITIONS.items():
        assert LinkState.ERROR in targets and LinkState.DOWN in targets
        assert (LinkState.PAUSED in targets) is (state is not LinkState.ERROR)


def test_a_link_held_on_an_error_is_not_paused_over_it() -> None:
    link = LinkCondition("a -> b")
    link.move(LinkState.ERROR, "node b: no column w")
    with pytest.raises(RuntimeError, match="no move from error to paused"):
        link.move(LinkState.PAUSED, None)
    assert (link.state, link.last_error) == (LinkState.ERROR, "node b: no column w")


def test_move_records_the_error_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    link = LinkCondition("a -> b")
    assert (link.state, link.last_error) == (LinkState.DOWN, None)
    with caplog.at_level(logging.DEBUG, logger="router.apply.state"):
        link.move(LinkState.DOWN, "connection refused")
        link.move(LinkState.DOWN, "connection refused")  # no news: not logged again
        link.move(LinkState.ERROR, "node b: no column w")
        link.move(LinkState.ERROR, None)  # `pgmesh resume` clears the error: no news either
        link.move(LinkState.STREAMING)
        link.move(LinkState.STREAMING)
    assert [r.getMessage() for r in caplog.records] == [
        "link a -> b is down: connection refused; retrying",
        "link a -> b paused: node b: no column w (fix it, then `pgmesh resume`)",
        "link a -> b streaming",
    ]
    assert (link.state, link.last_error) == (LinkState.STREAMING, None)


def test_keep_error_leaves_the_last_error() -> None:
    link = LinkCondition("a -> b")
    link.move(LinkState.PAUSED, "held for a join")
    link.move(LinkState.STREAMING, keep_error=True)
    assert link.last_error == "held for a join"


def test_a_move_outside_the_table_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(TRANSITIONS, LinkState.DOWN, frozenset({LinkState.STREAMING}))  # type: ignore[arg-type]
    link = LinkCondition("a -> b")
    with pytest.raises(RuntimeError, match="no move from down to error"):
        link.move(LinkState.ERROR, "boom")
    assert link.state is LinkState.DOWN


class _Link(LinkView):
    def __init__(self) -> None:
        self.stats = LinkStats()
        self.condition = LinkCondition("a -> b")


def test_the_counters_read_on_the_link() -> None:
    link = _Link()
    link.stats.conflicts += 2
    link.stats.applied_rows += 10
    link.stats.last_commit_time = 5
    stats = link.stats
    assert (stats.conflicts, stats.applied_rows, link.last_commit_time, stats.retries) == (2, 10, 5, 0)
    assert link.state is LinkState.DOWN and link.last_error is None
