"""WAL positions and PostgreSQL timestamps.

An LSN is a 64-bit byte position in the WAL, written `X/Y` (two hexadecimal 32-bit halves). PostgreSQL
timestamps on the wire are microseconds since 2000-01-01 00:00:00 UTC. This module converts both; it
holds no state and reads no clock.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

__all__ = [
    "INVALID_LSN",
    "LSN",
    "PG_EPOCH",
    "datetime_to_pg_us",
    "format_lsn",
    "parse_lsn",
    "pg_us_to_datetime",
    "unix_seconds_to_pg_us",
]

PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
_UNIX_TO_PG_US = 946_684_800 * 1_000_000
INVALID_LSN = 0


def format_lsn(value: int) -> str:
    """`0x16B3748` -> `'0/16B3748'`."""
    return f"{(value >> 32) & 0xFFFFFFFF:X}/{value & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> LSN:
    """`'0/16B3748'` -> LSN. Raises ValueError on anything else."""
    hi, sep, lo = text.strip().partition("/")
    if not sep or not hi or not lo or len(hi) > 8 or len(lo) > 8:
        raise ValueError(f"not an LSN: {text!r}")
    return LSN((int(hi, 16) << 32) | int(lo, 16))


class LSN(int):
    """An int that prints as PostgreSQL does (`X/Y`)."""

    __slots__ = ()

    def __new__(cls, value: int | str = 0) -> LSN:
        if isinstance(value, str):
            return parse_lsn(value)
        if not 0 <= value < 1 << 64:
            raise ValueError(f"LSN out of range: {value}")
        return super().__new__(cls, value)

    def __str__(self) -> str:
        return format_lsn(self)

    def __repr__(self) -> str:
        return f"LSN('{format_lsn(self)}')"


def pg_us_to_datetime(us: int) -> datetime:
    """Microseconds since the PostgreSQL epoch -> aware UTC datetime."""
    return PG_EPOCH + timedelta(microseconds=us)


def datetime_to_pg_us(moment: datetime) -> int:
    """Aware datetime -> microseconds since the PostgreSQL epoch."""
    delta = moment - PG_EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def unix_seconds_to_pg_us(seconds: float) -> int:
    """`time.time()` style seconds -> microseconds since the PostgreSQL epoch."""
    return int(seconds * 1_000_000) - _UNIX_TO_PG_US
