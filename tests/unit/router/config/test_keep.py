"""`[conflicts] keep` and `keep_rows` (router.conflicts.history): the duration's seconds, the defaults, and
a refused value as one line naming the key and its line."""

from __future__ import annotations

import pytest

from router.config.model import parse_config
from router.config.sections import duration_seconds
from router.errors import ConfigError

MINIMAL = """\
[cluster]
name = "demo"

[[nodes]]
name = "a"
dsn = "host=10.0.0.1 dbname=app"

[[nodes]]
name = "b"
dsn = "host=10.0.0.2 dbname=app"
"""


def with_conflicts(lines: str) -> str:
    return MINIMAL + "\n[conflicts]\n" + lines  # [conflicts] on line 12, its first key on 13


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_defaults_keep_seven_days_and_cap_ten_million_rows() -> None:
    section = parse_config(MINIMAL).conflicts
    assert (section.keep, section.keep_s, section.keep_rows) == ("7d", 7 * 86_400, 10_000_000)


@pytest.mark.parametrize(("text", "seconds"), [
    ("2s", 2), ("90s", 90), ("15m", 900), ("1.5h", 5_400), ("12h", 43_200), ("7d", 604_800),
    ("30d", 2_592_000), ("1500ms", 1.5),
])
def test_keep_accepts_a_number_and_a_unit(text: str, seconds: float) -> None:
    assert duration_seconds(text) == seconds
    assert parse_config(with_conflicts(f'keep = "{text}"\n')).conflicts.keep_s == seconds


def test_keep_rows_zero_means_no_cap() -> None:
    assert parse_config(with_conflicts("keep_rows = 0\n")).conflicts.keep_rows == 0


@pytest.mark.parametrize("text", ["7", "7 d", "7days", "d", "-1d", "7D", "1w", "", "1h30m", " 7d"])
def test_keep_refuses_what_is_not_a_duration_naming_key_and_line(text: str) -> None:
    message = error_of(with_conflicts(f'resolver = "last_update_wins"\nkeep = "{text}"\n'))
    assert message == (f"config.toml:14: conflicts.keep: {text!r} is not a duration: a number and ms, s,"
                       " m, h or d, e.g. '12h' or '7d'")


@pytest.mark.parametrize("text", ["0s", "500ms", "0.5s"])
def test_keep_refuses_less_than_a_second(text: str) -> None:
    assert error_of(with_conflicts(f'keep = "{text}"\n')) == (
        f"config.toml:13: conflicts.keep: {text!r} is too short: at least 1s (e.g. '7d')")


def test_keep_of_the_wrong_type_and_a_negative_cap_name_their_keys() -> None:
    assert error_of(with_conflicts("keep = 7\n")).startswith("config.toml:13: conflicts.keep: Expected `str`")
    assert error_of(with_conflicts("keep_rows = -1\n")) == "config.toml:13: conflicts.keep_rows: must be >= 0"
