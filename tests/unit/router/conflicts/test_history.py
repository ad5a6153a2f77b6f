"""router.conflicts.history's pure parts: how often it prunes, and which ids each link has counted."""

from __future__ import annotations

import pytest

from router.conflicts.history import (
    PRUNE_CAP_SQL,
    PRUNE_OLD_SQL,
    PRUNE_QUARANTINE_SQL,
    counted_ids,
    prune_interval,
)


@pytest.mark.parametrize(("keep_s", "interval"),
                         [(2, 1.0), (10, 1.0), (60, 6.0), (600, 60.0), (604_800, 60.0)])
def test_a_round_every_tenth_of_keep_between_one_second_and_a_minute(keep_s: float, interval: float) -> None:
    assert prune_interval(keep_s) == interval


def test_counted_ids_are_those_of_the_links_into_the_target_that_have_read_their_start() -> None:
    counted = {("a", "b"): 120, ("c", "b"): None, ("b", "a"): 7, ("c", "a"): 0}
    assert counted_ids(counted, "b") == {"a": 120}  # c -> b has not read its start: no limit
    assert counted_ids(counted, "a") == {"b": 7, "c": 0}
    assert counted_ids(counted, "c") == {}


def test_every_deletion_picks_its_rows_without_waiting_and_never_a_pending_entry() -> None:
    for text in (PRUNE_OLD_SQL, PRUNE_CAP_SQL, PRUNE_QUARANTINE_SQL):
        assert "FOR UPDATE SKIP LOCKED" in text and "LIMIT %(limit)s" in text
    for text in (PRUNE_OLD_SQL, PRUNE_CAP_SQL):
        assert "%(counted)s::jsonb ->> h.source" in text  # a row no link has counted yet stays
    # checked when picked and again when deleted
    assert PRUNE_QUARANTINE_SQL.count("q.state <> 'pending' AND q.resolved_at <") == 2
