"""`router.cluster.clocks` and `router.service.clocks` without a server: the offset arithmetic, the
choice of the shortest round trip, the levels against `[clocks]`, one log line per change of level, the
links it holds, and the config."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from router.apply.clock import LinkClockView, NoClock
from router.apply.state import LinkCondition, LinkHold, LinkState, Liveness
from router.cluster.clocks import (
    ClockLevel,
    Sample,
    best,
    decides_by_time,
    level_of,
    measure,
    node_clock,
    sample,
)
from router.config.model import ClocksSection, Config, parse_config
from router.errors import ConfigError
from router.service.clocks import ClockWatch, LinkClock

CONFIG = """\
[cluster]
name = "demo"

[[nodes]]
name = "a"
dsn = "host=10.0.0.1 dbname=app"

[[nodes]]
name = "b"
dsn = "host=10.0.0.2 dbname=app"
"""


def config(extra: str = "") -> Config:
    return parse_config(CONFIG + extra)


def test_offset_is_the_server_time_minus_the_midpoint_of_the_round_trip() -> None:
    found = sample(sent=100.0, server=103.5, received=101.0)
    assert found == Sample(offset=3.0, round_trip=1.0)
    behind = sample(sent=100.0, server=97.25, received=100.5)
    assert behind.offset == pytest.approx(-3.0) and behind.round_trip == pytest.approx(0.5)


def test_best_keeps_the_shortest_round_trip() -> None:
    samples = [Sample(2.0, 0.3), Sample(2.9, 0.01), Sample(1.0, 0.5)]
    assert best(samples) == Sample(2.9, 0.01)
    assert best([]) is None


async def test_measure_times_each_query_on_the_given_clock_and_keeps_the_tightest() -> None:
    # the router's clock reads 0, 1, 2, ...; the server answers 10 s ahead of the midpoint, the second
    # query after a long wait (its round trip is 5 ticks): the others (1 tick) are kept
    ticks: Iterator[float] = iter([0, 1, 2, 7, 8, 9])
    answers = iter([10.5, 14.5, 18.5])

    async def query(sql: str) -> list[tuple[Any, ...]]:
        assert "clock_timestamp()" in sql
        return [(next(answers),)]  # seconds since the epoch, as CLOCK_SQL answers

    found = await measure(query, clock=lambda: next(ticks), tries=3)
    assert found.round_trip == 1.0
    assert found.offset == pytest.approx(10.0)


def test_levels_against_the_bounds() -> None:
    bounds = ClocksSection(warn_offset_ms=50, max_offset_ms=500)
    assert level_of(0.0, bounds) is ClockLevel.OK
    assert level_of(-0.050, bounds) is ClockLevel.OK  # at the bound: still within
    assert level_of(0.051, bounds) is ClockLevel.WARN
    assert level_of(-0.4, bounds) is ClockLevel.WARN
    assert level_of(-0.501, bounds) is ClockLevel.OVER
    assert level_of(3.0, bounds) is ClockLevel.OVER


def test_one_log_line_per_change_of_level(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="router.service.clocks")
    watch = ClockWatch(config())
    for offset in (0.001, 0.002, 0.08, 0.09, 0.07, 3.0, 3.1, 0.01, 0.02):
        watch.record("b", Sample(offset, 0.001))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "node b" in lines[0] and "+80.0 ms" in lines[0] and "warn_offset_ms = 50" in lines[0]
    assert caplog.records[0].levelno == logging.WARNING
    assert "node b" in lines[1] and "+3000.0 ms" in lines[1] and "max_offset_ms = 500" in lines[1]
    assert caplog.records[1].levelno == logging.ERROR
    assert "within" in lines[2]
    assert watch.levels == {"a": ClockLevel.UNKNOWN, "b": ClockLevel.OK}


def test_a_failed_refresh_keeps_the_last_offset_and_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    watch = ClockWatch(config())
    watch.record("a", Sample(-0.2, 0.001))
    watch.record("a", None, "connection refused")
    watch.record("a", None, "connection refused")
    assert len([r for r in caplog.records if "cannot measure" in r.getMessage()]) == 1
    assert watch.offset("a") == -0.2 and watch.offset("b") == 0.0
    shown = {c.node: c for c in watch.report()}
    assert shown["a"].offset_ms == -200.0 and shown["a"].error == "connection refused"
    assert shown["a"].level == "warn" and shown["b"].level == "unknown"
    assert "not measured" in shown["b"].describe()


def test_links_through_a_node_beyond_the_bound_hold_and_run_again() -> None:
    watch = ClockWatch(config('\n[clocks]\nmax_offset_ms = 1000\n'))
    into, out_of = watch.link("a", "b"), watch.link("b", "a")
    condition = LinkCondition("a -> b")
    condition.to(Liveness.CONNECTING)
    condition.to(Liveness.STREAMING)
    into.report_to(condition)
    watch.record("b", Sample(-3.0, 0.001))
    assert into.offset() == -3.0 and out_of.offset() == 0.0
    for link in (into, out_of):
        reason = link.skewed()
        assert reason is not None
        assert "node b" in reason and "-3000.0 ms" in reason and "max_offset_ms = 1000" in reason
    into.show()
    assert condition.state is LinkState.CLOCK_SKEW and "node b" in (condition.last_error or "")
    assert watch.problems() and "node b" in watch.problems()[0]
    watch.record("b", Sample(-0.9, 0.001))  # back under the bound
    assert into.skewed() is None and out_of.skewed() is None
    into.show()
    assert (condition.state, condition.last_error) == (LinkState.STREAMING, None)


def test_a_paused_or_failed_link_is_left_as_it_is() -> None:
    watch = ClockWatch(config())
    link = watch.link("a", "b")
    condition = LinkCondition("a -> b")
    condition.add_hold(LinkHold.PAUSE, "paused by the operator")
    link.report_to(condition)
    watch.record("a", Sample(5.0, 0.001))
    link.show()
    assert condition.state is LinkState.PAUSED


def test_only_links_deciding_by_commit_times_hold() -> None:
    assert decides_by_time(config())  # last_update_wins by default
    keep = config('\n[conflicts]\nresolver = "keep_local"\nallow_divergence = true\n')
    assert not decides_by_time(keep)
    typed = config(
        '\n[conflicts]\nresolver = "keep_local"\nallow_divergence = true\n'
        '[conflicts.types]\ninsert_exists = "last_update_wins"\n'
    )
    assert decides_by_time(typed)
    watch = ClockWatch(keep)
    watch.record("b", Sample(9.0, 0.001))
    assert watch.link("a", "b").skewed() is None
    assert LinkClock(None, "a", "b").skewed() is None and LinkClock(None, "a", "b").offset() == 0.0
    no_clock: LinkClockView = NoClock()  # the applier's default without a watch
    assert no_clock.skewed() is None and no_clock.offset() == 0.0


def test_status_text_of_a_node_clock() -> None:
    bounds = ClocksSection()
    over = node_clock("b", Sample(-3.0, 0.0004), bounds)
    assert (over.level, over.offset_ms, over.bound_ms) == ("over", -3000.0, 500)
    assert over.describe().startswith("-3000.0 ms from the router's (round trip 0.4 ms), beyond [clocks]"
                                      " max_offset_ms = 500")
    assert node_clock("a", Sample(0.0001, 0.0002), bounds).describe() == (
        "+0.1 ms from the router's (round trip 0.2 ms)"
    )


def test_clocks_config_defaults_and_validation() -> None:
    assert config().clocks == ClocksSection(warn_offset_ms=50, max_offset_ms=500)
    assert config("\n[clocks]\nwarn_offset_ms = 10\nmax_offset_ms = 10\n").clocks.max_offset_ms == 10
    cases = {
        "warn_offset_ms = 0": "clocks.warn_offset_ms: must be >= 1",
        "warn_offset_ms = 100\nmax_offset_ms = 50": "clocks.max_offset_ms: must be >= warn_offset_ms (100)",
        "max_offset_ms = 20": "clocks.max_offset_ms: must be >= warn_offset_ms (50)",
        "max_offset_ms = \"1s\"": "clocks.max_offset_ms",
        "skew_ms = 5": "unknown key 'skew_ms'",
    }
    for body, wanted in cases.items():
        with pytest.raises(ConfigError) as info:
            config(f"\n[clocks]\n{body}\n")
        assert wanted in str(info.value), (body, str(info.value))
        assert "config.toml:" in str(info.value)
