"""The tombstone horizon's arithmetic (router.conflicts.pruning), with a fake clock: no server."""

from __future__ import annotations

import math

import pytest

from protocol.lsn import unix_seconds_to_pg_us
from router.config.model import parse_config
from router.conflicts.pruning import HorizonTracker, LinkReport, horizon, link_safe_time, prune_before
from router.errors import ConfigError

S = 1_000_000  # one second in microseconds
T0 = 800_000_000 * S  # some commit time (microseconds since 2000)


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_an_applied_commit_time_counts_once_flushed_on_the_target() -> None:
    assert link_safe_time((500, T0), flushed=None, caught_up=None) is None
    assert link_safe_time((500, T0), flushed=499, caught_up=None) is None  # might be lost in a crash
    assert link_safe_time((500, T0), flushed=500, caught_up=None) == T0
    assert link_safe_time(None, flushed=900, caught_up=None) is None  # nothing applied since the start


def test_the_later_of_applied_and_caught_up_counts() -> None:
    assert link_safe_time((500, T0), flushed=600, caught_up=T0 + 5 * S) == T0 + 5 * S
    assert link_safe_time((500, T0 + 9 * S), flushed=600, caught_up=T0 + 5 * S) == T0 + 9 * S
    assert link_safe_time((500, T0 + 9 * S), flushed=10, caught_up=T0 + 5 * S) == T0 + 5 * S
    assert link_safe_time(None, flushed=None, caught_up=T0) == T0


def test_horizon_is_the_least_safe_time_minus_the_margin() -> None:
    assert horizon([T0 + 10 * S, T0 + 3 * S], margin_us=2 * S) == T0 + 1 * S
    assert horizon([T0], margin_us=0) == T0


def test_one_silent_link_stops_the_horizon() -> None:
    assert horizon([T0 + 10 * S, None], margin_us=S) is None
    assert horizon([], margin_us=S) is None  # no incoming link: nothing known


def _links(running_from_a: bool = True) -> list[LinkReport]:
    return [
        LinkReport("a", "c", running_from_a), LinkReport("b", "c", True),
        LinkReport("c", "a", True), LinkReport("b", "a", True),
    ]


def test_tracker_horizon_per_target() -> None:
    tracker = HorizonTracker(margin_ms=1000, clock=FakeClock(0))
    tracker.note_applied("a", "c", 100, T0 + 20 * S)
    tracker.note_applied("b", "c", 200, T0 + 30 * S)
    flushed = {"a": 100, "b": 200}
    assert tracker.horizon_for("c", _links(), flushed) == T0 + 19 * S
    # a's transactions: not yet flushed on c -> no word from a -> no horizon on c
    assert tracker.horizon_for("c", _links(), {"a": 99, "b": 200}) is None
    # a (whose links into a are c -> a and b -> a) has heard nothing from c: no horizon there
    assert tracker.horizon_for("a", _links(), {"c": 0, "b": 0}) is None


def test_a_paused_link_stops_its_targets_horizon_only() -> None:
    tracker = HorizonTracker(margin_ms=0, clock=FakeClock(0))
    for source, target in (("a", "c"), ("b", "c"), ("c", "a"), ("b", "a")):
        tracker.note_applied(source, target, 10, T0)
    flushed = {"a": 10, "b": 10, "c": 10}
    assert tracker.horizon_for("c", _links(running_from_a=False), flushed) is None
    assert tracker.horizon_for("a", _links(running_from_a=False), flushed) == T0


def test_caught_up_source_moves_the_horizon_while_it_writes_nothing() -> None:
    tracker = HorizonTracker(margin_ms=500, clock=FakeClock(0))
    tracker.note_applied("b", "c", 200, T0)
    tracker.note_caught_up("a", T0 + 60 * S)  # a wrote nothing, its slot is confirmed up to its WAL
    assert tracker.horizon_for("c", [LinkReport("a", "c", True), LinkReport("b", "c", True)],
                               {"b": 200}) == T0 - S // 2
    tracker.note_caught_up("b", T0 + 61 * S)
    assert tracker.horizon_for("c", [LinkReport("a", "c", True), LinkReport("b", "c", True)],
                               {"b": 200}) == T0 + 60 * S - S // 2
    tracker.note_caught_up("a", T0)  # an older reading never moves it back
    assert tracker.safe_time("a", "c", None) == T0 + 60 * S


def test_a_source_reading_counts_once_its_slot_is_confirmed_past_it() -> None:
    tracker = HorizonTracker(margin_ms=0, clock=FakeClock(0))
    tracker.note_source("a", T0, flushed=1000, confirmed=900)  # a busy source: not there yet
    assert tracker.safe_time("a", "b", None) is None
    tracker.note_source("a", T0 + 10 * S, flushed=2000, confirmed=1000)  # the first reading reached
    assert tracker.safe_time("a", "b", None) == T0
    tracker.note_source("a", T0 + 20 * S, flushed=3000, confirmed=3000)  # idle: both reached at once
    assert tracker.safe_time("a", "b", None) == T0 + 20 * S


def test_a_source_keeps_a_bounded_number_of_readings() -> None:
    tracker = HorizonTracker(margin_ms=0, clock=FakeClock(0))
    for i in range(500):  # a slot that never moves (a link held): the oldest readings go
        tracker.note_source("a", T0 + i * S, flushed=1000 + i, confirmed=0)
    assert tracker.safe_time("a", "b", None) is None
    tracker.note_source("a", T0 + 500 * S, flushed=2000, confirmed=1450)
    assert tracker.safe_time("a", "b", None) == T0 + 450 * S


def test_a_target_that_lost_commits_waits_until_they_are_applied_again() -> None:
    tracker = HorizonTracker(margin_ms=0, clock=FakeClock(0))
    tracker.note_applied("a", "b", 1000, T0 + 50 * S)  # applied, not yet flushed; then b crashed
    links = [LinkReport("a", "b", True)]
    assert tracker.horizon_for("b", links, {"a": 700}) is None
    tracker.note_applied("a", "b", 800, T0 + 40 * S)  # applied again after the restart
    assert tracker.horizon_for("b", links, {"a": 800}) == T0 + 40 * S


def test_horizon_age_on_the_routers_clock() -> None:
    clock = FakeClock(1_700_000_000.0)
    tracker = HorizonTracker(margin_ms=0, clock=clock)
    at = unix_seconds_to_pg_us(clock.now) - 90 * S
    assert tracker.age_seconds(at) == pytest.approx(90.0)
    clock.now += 10
    assert tracker.age_seconds(at) == pytest.approx(100.0)
    assert tracker.age_seconds(None) == math.inf
    assert tracker.age_seconds(at + 200 * S) == 0.0  # a source clock ahead of the router's


_CONFIG = """
[cluster]
name = "t"
[[nodes]]
name = "a"
dsn = "host=x"
[[nodes]]
name = "b"
dsn = "host=y"
[conflicts]
"""


def test_config_defaults_and_bounds() -> None:
    config = parse_config(_CONFIG)
    assert config.conflicts.tombstone_margin_ms == 60_000
    assert config.conflicts.tombstone_prune_interval_ms == 10_000
    with pytest.raises(ConfigError, match="tombstone_margin_ms"):
        parse_config(_CONFIG + "tombstone_margin_ms = -1\n")
    with pytest.raises(ConfigError, match="tombstone_prune_interval_ms"):
        parse_config(_CONFIG + "tombstone_prune_interval_ms = 0\n")
    assert config.conflicts.tombstone_keep_s == 3600.0
    assert parse_config(_CONFIG + 'tombstone_keep = "0s"\n').conflicts.tombstone_keep_s == 0.0
    with pytest.raises(ConfigError, match="tombstone_keep"):
        parse_config(_CONFIG + 'tombstone_keep = "an hour"\n')


def test_tombstones_past_the_horizon_stay_for_tombstone_keep() -> None:
    hour = 3_600_000_000
    now = 100 * hour
    assert prune_before(now - 10, now, hour) == now - hour  # the horizon is recent: keep decides
    assert prune_before(now - 2 * hour, now, hour) == now - 2 * hour  # a horizon held back decides
    assert prune_before(now - 10, now, 0) == now - 10  # "0s": at the horizon, as before
