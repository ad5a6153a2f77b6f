from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.lsn import (
    LSN,
    datetime_to_pg_us,
    format_lsn,
    parse_lsn,
    pg_us_to_datetime,
    unix_seconds_to_pg_us,
)


def test_lsn_text_round_trip() -> None:
    assert format_lsn(0x16B3748) == "0/16B3748"
    assert parse_lsn("1/0") == 1 << 32
    assert str(LSN("A/FF")) == "A/FF" and repr(LSN(5)) == "LSN('0/5')"
    for bad in ("", "1", "/1", "x/1", "123456789/0"):
        with pytest.raises(ValueError):
            parse_lsn(bad)
    with pytest.raises(ValueError):
        LSN(-1)


@given(st.integers(0, (1 << 64) - 1))
def test_lsn_round_trip_any(value: int) -> None:
    assert parse_lsn(format_lsn(value)) == value


def test_pg_epoch_times() -> None:
    moment = datetime(2024, 1, 2, 3, 4, 5, 678, tzinfo=UTC)
    assert pg_us_to_datetime(datetime_to_pg_us(moment)) == moment
    assert datetime_to_pg_us(datetime(2000, 1, 1, tzinfo=UTC)) == 0
    assert unix_seconds_to_pg_us(946_684_800.5) == 500_000
