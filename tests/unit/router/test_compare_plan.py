"""Key ranges of `pgmesh compare` (router.cluster.compare.plan): pure."""

from __future__ import annotations

from router.cluster.compare.plan import RangeTask, bound_ranges, integer_ranges, partitions
from router.cluster.compare.worker import BUCKETS, differences


def test_integer_ranges_cover_every_key_and_their_spans_meet() -> None:
    tasks = integer_ranges(0, 1, 1000, 4)
    assert tasks[0].lo is None and tasks[-1].hi is None  # keys beyond the first node's ends are read too
    assert [t.hi for t in tasks[:-1]] == [t.lo for t in tasks[1:]]
    assert tasks[0].span == (1, int(tasks[0].hi or 0)) and tasks[-1].span == (int(tasks[-1].lo or 0), 1001)
    assert all(t.step(BUCKETS) * BUCKETS >= t.span[1] - t.span[0] for t in tasks if t.span)


def test_a_small_or_narrow_table_is_one_range() -> None:
    assert integer_ranges(0, 5, 7, 8) == [RangeTask(0, None, None, (5, 8))]
    assert bound_ranges(["a"], 4) == [(None, None)]


def test_histogram_ranges_are_open_at_both_ends() -> None:
    ranges = bound_ranges([str(i) for i in range(100)], 5)
    assert ranges[0][0] is None and ranges[-1][1] is None and len(ranges) == 5


def test_partitions_deal_round_robin() -> None:
    tasks = [RangeTask(0, str(i), None) for i in range(5)]
    assert [len(p) for p in partitions(tasks, 2)] == [3, 2]


def test_differences_name_missing_and_changed_rows_only() -> None:
    a = {"(1)": ('{"id": 1}', 10), "(2)": ('{"id": 2}', 20)}
    b = {"(1)": ('{"id": 1}', 10), "(2)": ('{"id": 2}', 21), "(3)": ('{"id": 3}', 30)}
    found = differences(0, [a, b])
    assert [(d.key, d.hashes) for d in found] == [("(2)", (20, 21)), ("(3)", (None, 30))]
