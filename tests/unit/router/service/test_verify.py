"""Continuous verification's pure parts (router.service.verify): which nodes hold a key apart, a table's
finding and its merge, the status line, the [verify] section's durations, and how far a link has
committed (what the staggered snapshots wait for)."""

from __future__ import annotations

import pytest

from router.config.model import parse_config
from router.config.sections import duration_seconds
from router.errors import ConfigError
from router.progress.positions import LinkProgress
from router.service.status import VerifyStatus
from router.service.verify.findings import FIRST_KEYS, apart, finding, merged
from router.service.verify.verifier import applied_through


def test_the_node_outside_the_largest_group_holds_the_key_apart() -> None:
    assert apart([1, 1, 2]) == [2]
    assert apart([None, 5, 5]) == [0]
    assert apart([1, 2]) == [0, 1]  # two nodes: no majority, both count
    assert apart([1, 2, 3]) == [0, 1, 2]
    assert apart([1, 1, 2, 2]) == [0, 1, 2, 3]  # a tie


def test_a_finding_counts_rows_per_node_and_names_the_first_keys() -> None:
    keys = [(f"({i})", (1, 1, 100 + i)) for i in range(10)]
    found = finding("public.t", ["a", "b", "c"], keys)
    assert found.rows == {"a": 0, "b": 0, "c": 10}
    assert found.total == 10 and found.keys == [f"({i})" for i in range(FIRST_KEYS)]
    identical = finding("public.t", ["a", "b", "c"], [])
    assert identical.rows == {"a": 0, "b": 0, "c": 0} and identical.total == 0


def test_a_table_compared_twice_in_a_pass_adds_up() -> None:
    full = finding("public.t", ["a", "b"], [("(1)", (1, 2))])
    part = finding("public.t", ["a", "p"], [("(2)", (3, None))], unsettled=1)
    both = merged(full, part)
    assert both.rows == {"a": 2, "b": 1, "p": 1} and both.total == 2 and both.unsettled == 1
    assert merged(None, full) == full


def test_the_status_line() -> None:
    quiet = VerifyStatus(600.0, 0, None, None, 0, {})
    assert quiet.describe() == "verify: every 10 min; no full pass yet: 0 divergent rows"
    found = VerifyStatus(5.0, 3, "2026-12-06T10:00:00+00:00", 1.5, 2, {"public.t": {"b": 1}},
                         {"public.t": 1}, {"public.t": ["(42)"]})
    line = found.describe()
    assert line.startswith("verify: every 5 s; last full pass ended 2026-12-06T10:00:00+00:00 (1.5 s,"
                           " 2 table(s))")
    assert "DIVERGENT ROWS: public.t 1 key(s), rows apart: b 1, first: (42)" in line


def _config(verify: str) -> str:
    return ('[cluster]\nname = "x"\n[[nodes]]\nname = "a"\ndsn = "host=a"\n[[nodes]]\nname = "b"\n'
            f'dsn = "host=b"\n{verify}')


def test_the_verify_section() -> None:
    assert parse_config(_config("")).verify is None  # absent: off
    section = parse_config(_config('[verify]\ninterval = "90s"\ntables = ["t", "s.u"]\n')).verify
    assert section is not None and section.interval_s == 90.0 and section.rows_per_second == 50_000
    assert parse_config(_config("[verify]\n")).verify.interval_s == 600.0  # type: ignore[union-attr]
    assert [duration_seconds(d) for d in ("500ms", "2h", "7d", "1.5m")] == [0.5, 7200.0, 604800.0, 90.0]
    with pytest.raises(ConfigError, match=r"verify\.interval"):
        parse_config(_config('[verify]\ninterval = "10 minutes"\n'))


def test_a_link_has_committed_up_to_its_applied_position_or_all_it_was_given() -> None:
    link = LinkProgress("a", "b", flushed=100)
    assert applied_through(link, seen=500) == 500  # nothing pending: everything the source passed
    link.enqueued = 300
    link.on_applied(200)
    assert applied_through(link, seen=500) == 200  # committed there so far (flushed or not)
    link.on_applied(300)
    assert applied_through(link, seen=500) == 500
    link.missed_until = 400  # detached, to re-read: only what it applied
    assert applied_through(link, seen=500) == 300
