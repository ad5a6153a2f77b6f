"""`router.ops.control` without a server: what `pgmesh conflicts --since` accepts.

`pgmesh conflicts` over real nodes: tests/integration/test_conflict_catalog.py.
"""

from __future__ import annotations

import datetime as dt

import pytest

from router.errors import PgmeshError
from router.ops.control import parse_since


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
