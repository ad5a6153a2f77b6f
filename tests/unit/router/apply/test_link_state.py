"""router.apply.state: a link's liveness moves by one setter along its table, its holds are a set beside
it, what the operator sees is derived from both; its counters are one struct."""

from __future__ import annotations

import logging

import pytest

from router.apply.state import (
    RUNNING,
    TRANSITIONS,
    LinkCondition,
    LinkHold,
    LinkState,
    LinkStats,
    LinkView,
    Liveness,
)


def test_every_state_has_its_transitions() -> None:
    assert set(TRANSITIONS) == set(Liveness)
    for state, targets in TRANSITIONS.items():
        if state is not Liveness.ERROR:  # every live state may fail, retried or for good
            assert Liveness.ERROR in targets and Liveness.DOWN in targets
    # nothing runs straight out of DOWN or ERROR: only through CONNECTING (ERROR: once resumed)
    assert TRANSITIONS[Liveness.ERROR] == {Liveness.ERROR, Liveness.CONNECTING}
    assert not RUNNING & TRANSITIONS[Liveness.DOWN]
    assert all(Liveness.CONNECTING not in TRANSITIONS[s] for s in RUNNING)


def test_a_link_held_on_an_error_is_not_paused_over_it() -> None:
    link = LinkCondition("a -> b")
    link.to(Liveness.ERROR, "node b: no column w")
    link.add_hold(LinkHold.PAUSE, None)
    with pytest.raises(RuntimeError, match="no move from error to streaming"):
        link.to(Liveness.STREAMING)
    assert (link.state, link.last_error) == (LinkState.ERROR, "node b: no column w")


def test_move_records_the_error_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    link = LinkCondition("a -> b")
    assert (link.state, link.last_error) == (LinkState.DOWN, None)
    with caplog.at_level(logging.DEBUG, logger="router.apply.state"):
        link.to(Liveness.DOWN, "connection refused")
        link.to(Liveness.DOWN, "connection refused")  # no news: not logged again
        link.to(Liveness.ERROR, "node b: no column w")
        link.to(Liveness.ERROR, None)  # `pgmesh resume` clears the error: no news either
        link.to(Liveness.CONNECTING)  # shown "down", no news either
        link.to(Liveness.STREAMING)
        link.to(Liveness.STREAMING)
    assert [r.getMessage() for r in caplog.records] == [
        "link a -> b is down: connection refused; retrying",
        "link a -> b paused: node b: no column w (fix it, then `pgmesh resume`)",
        "link a -> b streaming",
    ]
    assert (link.state, link.last_error) == (LinkState.STREAMING, None)


def test_keep_error_leaves_the_last_error() -> None:
    link = LinkCondition("a -> b")
    link.to(Liveness.DOWN, "held for a join")
    link.to(Liveness.CONNECTING, keep_error=True)
    assert link.last_error == "held for a join"


def test_a_move_outside_the_table_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(TRANSITIONS, Liveness.DOWN, frozenset({Liveness.STREAMING}))  # type: ignore[arg-type]
    link = LinkCondition("a -> b")
    with pytest.raises(RuntimeError, match="no move from down to error"):
        link.to(Liveness.ERROR, "boom")
    assert link.state is LinkState.DOWN


def test_what_is_shown_error_then_drift_then_pause_then_clock_skew() -> None:
    link = LinkCondition("a -> b")
    link.add_hold(LinkHold.CLOCK, "clock of b")
    assert link.state is LinkState.DOWN  # clock skew shows only on a link that runs
    link.to(Liveness.CONNECTING)
    link.to(Liveness.CATCHING_UP)
    assert (link.state, link.last_error) == (LinkState.CLOCK_SKEW, "clock of b")
    link.add_hold(LinkHold.PAUSE, None)
    assert (link.state, link.last_error) == (LinkState.PAUSED, None)
    link.add_hold(LinkHold.DRIFT, "table t differs")
    assert (link.state, link.last_error) == (LinkState.SCHEMA_DRIFT, "table t differs")
    link.to(Liveness.ERROR, "node b: no column w")
    assert (link.state, link.last_error) == (LinkState.ERROR, "node b: no column w")
    link.to(Liveness.CONNECTING)  # resumed: the holds show again
    assert link.state is LinkState.SCHEMA_DRIFT
    for hold, then in ((LinkHold.DRIFT, LinkState.PAUSED), (LinkHold.PAUSE, LinkState.DOWN)):
        link.drop_hold(hold)
        assert link.state is then
    link.to(Liveness.STREAMING)
    assert link.state is LinkState.CLOCK_SKEW
    link.drop_hold(LinkHold.CLOCK)
    assert (link.state, link.last_error) == (LinkState.STREAMING, None)


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
