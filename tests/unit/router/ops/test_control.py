"""`router.ops.control` without a server: what `pgmesh conflicts --since` accepts, its totals, and the
lag `pgmesh status` shows without a router.

`pgmesh conflicts` over real nodes: tests/integration/test_conflict_catalog.py.
"""

from __future__ import annotations

import datetime as dt
import re

import pytest

from router.errors import PgmeshError
from router.ops.control import offline_lag, parse_since, render_status, render_totals
from router.service.status import LinkStatus, SourceStatus, StatusReport


def test_since_takes_ages_and_iso_timestamps() -> None:
    now = dt.datetime(2024, 5, 1, 12, 0, tzinfo=dt.UTC)
    assert parse_since("10m", now) == now - dt.timedelta(minutes=10)
    assert parse_since("2h", now) == now - dt.timedelta(hours=2)
    assert parse_since("1d", now) == now - dt.timedelta(days=1)
    assert parse_since("2024-04-30T08:00:00+00:00", now) == dt.datetime(2024, 4, 30, 8, tzinfo=dt.UTC)
    assert parse_since("2024-04-30 08:00:00Z", now) == dt.datetime(2024, 4, 30, 8, tzinfo=dt.UTC)
    assert parse_since("2024-04-30", now).tzinfo is not None  # no zone: local time
    with pytest.raises(PgmeshError, match="neither an ISO timestamp nor an age"):
        parse_since("10 parsecs", now)


def test_conflict_totals_say_how_many_more_and_how_to_see_them() -> None:
    totals = {("public.kv", "insert_exists"): 90, ("public.kv", "update_origin_differs"): 7}
    text = render_totals(totals, shown=5, limit=5)
    assert text.splitlines()[0] == ("97 conflict(s) recorded; 5 shown, 92 more: --limit 97 shows them all,"
                                    " --since narrows, by table and type:")
    assert text.splitlines()[1].split() == ["public.kv", "insert_exists", "90"]
    assert render_totals(totals, shown=97, limit=100).startswith("97 conflict(s) recorded, by table")


def _link(source: str, target: str, applied: str) -> LinkStatus:
    return LinkStatus(source, target, "down", applied, applied, None, None, None, 0, 0, 0, 0,
                      "router not running")


def testoffline_lag_counts_from_the_link_or_the_slot_never_from_0_0() -> None:
    """Without a router: the source's WAL written since what the target applied, or since the slot when
    it never applied any (0/0); unknown ('-') when the source did not answer."""
    sources = [SourceStatus("a", "down", "0/3000000", "0/2000000", 0, 0, 0, 0, "router not running"),
               SourceStatus("b", "down", "?", "?", 0, 0, 0, 0, "connection refused")]
    links = offline_lag([_link("a", "b", "0/2800000"), _link("a", "c", "0/0"), _link("b", "a", "0/1")],
                         sources)
    assert [lk.lag_bytes for lk in links] == [0x800000, 0x1000000, None]
    text = render_status(StatusReport("t", False, links, sources, []))
    assert re.search(r"b -> a\s+down\s+0/1\s+-\s+-\s+-", text), text
