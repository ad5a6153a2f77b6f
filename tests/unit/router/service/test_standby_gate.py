"""`router.service.monitor.StandbyGate` (no server): origin positions read on a node pass only once the
standbys it waits for have flushed the node's WAL they were read at; without such standbys, at once."""

from __future__ import annotations

from router.service.monitor import StandbyGate


def test_without_standbys_positions_pass_as_read() -> None:
    gate = StandbyGate()
    assert gate.let_through({"a": 100, "c": 7}, 0, None) == {"a": 100, "c": 7}


def test_positions_wait_for_the_standby_to_reach_the_wal_they_were_read_at() -> None:
    gate = StandbyGate()
    assert gate.let_through({"a": 100}, 1000, 900) == {"a": 0}  # read at WAL 1000; the standby has 900
    assert gate.let_through({"a": 150}, 1100, 999) == {"a": 0}
    assert gate.let_through({"a": 180}, 1200, 1000) == {"a": 100}  # the first sample is on the standby now
    assert gate.let_through({"a": 200}, 1300, 1250) == {"a": 180}
    assert gate.let_through({"a": 200}, 1300, 1300) == {"a": 200}


def test_never_above_what_was_just_read_and_never_backwards() -> None:
    gate = StandbyGate()
    assert gate.let_through({"a": 100}, 1000, 1000) == {"a": 100}
    # the node lost unflushed commits (read lower now): what passes is not above what it has
    assert gate.let_through({"a": 90}, 1100, 1000) == {"a": 90}
    assert gate.let_through({"a": 120}, 1200, 1200) == {"a": 120}


def test_a_standby_that_never_answers_holds_everything_back() -> None:
    gate = StandbyGate()
    for i in range(2000):  # more samples than it keeps: the oldest go, nothing is released early
        assert gate.let_through({"a": i}, 1000 + i, 0) == {"a": 0}
    assert gate.let_through({"a": 5000}, 5000, 5000)["a"] == 5000
