"""The initial copy's pure parts: planning (sizes -> ctid ranges), the SQL of a task, the Spark master
with retries, the task error record and the progress line. No server, no Spark."""

from __future__ import annotations

import io
import itertools

import pytest

from router.cluster.copy.plan import (
    SMALL_TABLE_BYTES,
    TASK_BYTES,
    BlockRange,
    Leaf,
    block_ranges,
    plan_tasks,
    task_count,
)
from router.cluster.copy.progress import CopyProgress, ProgressBar
from router.cluster.copy.spark import local_parallelism, with_retries
from router.cluster.copy.worker import TaskFailure, between, copy_in_sql, copy_out_sql

BLOCK = 8192
MB = 1024 * 1024


def blocks_of(nbytes: int) -> int:
    return nbytes // BLOCK


def covers(ranges: list[BlockRange], nblocks: int) -> bool:
    """Contiguous from block 0, each range non-empty, the last one open-ended."""
    if ranges[0].first != 0 or ranges[-1].end is not None:
        return False
    for left, right in itertools.pairwise(ranges):
        if left.end != right.first or left.end is None or left.end <= left.first:
            return False
    return ranges[-1].first <= max(0, nblocks - 1) or nblocks == 0


@pytest.mark.parametrize(
    ("nblocks", "count", "expected"),
    [
        (0, 1, [(0, None)]),
        (0, 4, [(0, None)]),
        (1, 4, [(0, None)]),
        (10, 1, [(0, None)]),
        (10, 2, [(0, 5), (5, None)]),
        (10, 3, [(0, 3), (3, 6), (6, None)]),
        (2, 5, [(0, 1), (1, None)]),
        (15385, 4, [(0, 3846), (3846, 7692), (7692, 11538), (11538, None)]),
    ],
)
def test_block_ranges(nblocks: int, count: int, expected: list[tuple[int, int | None]]) -> None:
    ranges = block_ranges(nblocks, count)
    assert [(r.first, r.end) for r in ranges] == expected
    assert covers(ranges, nblocks)
    assert sum(r.blocks(nblocks) for r in ranges) == nblocks


@pytest.mark.parametrize("nblocks", [1, 7, 100, 12_345, 1_000_003])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 16, 64])
def test_block_ranges_cover_every_block_once_and_are_balanced(nblocks: int, count: int) -> None:
    ranges = block_ranges(nblocks, count)
    assert len(ranges) == min(count, nblocks)
    assert covers(ranges, nblocks)
    sizes = [r.blocks(nblocks) for r in ranges]
    assert sum(sizes) == nblocks
    assert max(sizes) - min(sizes) <= 1


def test_block_ranges_rejects_negative_sizes() -> None:
    with pytest.raises(ValueError):
        block_ranges(-1, 2)


def test_the_open_ended_range_also_counts_blocks_added_after_planning() -> None:
    last = block_ranges(100, 4)[-1]
    assert last == BlockRange(75, None)
    assert last.blocks(100) == 25
    assert last.blocks(130) == 55  # rows in blocks added later are still in the last range


def test_task_count_small_tables_get_one_task() -> None:
    assert task_count(0, parallelism=8) == 1
    assert task_count(SMALL_TABLE_BYTES - 1, parallelism=8) == 1


def test_task_count_large_tables_get_one_task_per_core_and_none_over_task_bytes() -> None:
    assert task_count(SMALL_TABLE_BYTES, parallelism=2) == 1  # a second task would be under 8 MB
    assert task_count(120 * MB, parallelism=2) == 2
    assert task_count(120 * MB, parallelism=32) == 15  # each task keeps >= 8 MB
    assert task_count(10 * TASK_BYTES, parallelism=2) == 10
    assert task_count(10 * TASK_BYTES + 1, parallelism=2) == 11


def test_task_count_takes_an_explicit_request_as_is() -> None:
    assert task_count(0, requested=4) == 4
    assert task_count(100 * TASK_BYTES, requested=3, parallelism=64) == 3


def test_plan_small_table_is_one_unbounded_task() -> None:
    tasks = plan_tasks([Leaf(0, "public", "small", blocks_of(MB))], [("id", "v")], parallelism=4)
    assert len(tasks) == 1
    task = tasks[0]
    assert (task.schema, task.name, task.columns) == ("public", "small", ("id", "v"))
    assert task.range == BlockRange(0, None)
    assert task.blocks == blocks_of(MB)


def test_plan_large_table_splits_by_cores_with_an_open_last_range() -> None:
    nblocks = blocks_of(120 * MB)
    tasks = plan_tasks([Leaf(0, "public", "big", nblocks)], [("id",)], parallelism=2)
    ranges = sorted((t.range for t in tasks), key=lambda r: r.first)
    assert [(r.first, r.end) for r in ranges] == [(0, nblocks // 2), (nblocks // 2, None)]


def test_plan_partitioned_table_plans_each_leaf_and_orders_largest_first() -> None:
    leaves = [
        Leaf(0, "public", "small", 10),
        Leaf(1, "app", "events_2024", blocks_of(40 * MB)),
        Leaf(1, "app", "events_2025", blocks_of(100 * MB)),
        Leaf(2, "public", "empty", 0),
    ]
    columns = [("id",), ("id", "at", "payload"), ("k",)]
    tasks = plan_tasks(leaves, columns, parallelism=2)
    by_leaf: dict[str, list[BlockRange]] = {}
    for task in tasks:
        assert task.columns == columns[task.table]
        by_leaf.setdefault(f"{task.schema}.{task.name}", []).append(task.range)
    assert {name: len(r) for name, r in by_leaf.items()} == {
        "public.small": 1, "app.events_2024": 2, "app.events_2025": 2, "public.empty": 1
    }
    for name, leaf in (("app.events_2024", leaves[1]), ("app.events_2025", leaves[2])):
        assert covers(sorted(by_leaf[name], key=lambda r: r.first), leaf.nblocks)
    sizes = [t.blocks for t in tasks]
    assert sizes == sorted(sizes, reverse=True)
    assert tasks[0].name == "events_2025"
    assert tasks[-1].name == "empty"


def test_plan_explicit_partitions_apply_to_each_relation() -> None:
    leaves = [Leaf(0, "public", "a", 1000), Leaf(0, "public", "b", 3), Leaf(1, "public", "c", 0)]
    tasks = plan_tasks(leaves, [("x",), ("y",)], requested=4)
    counts = {name: sum(1 for t in tasks if t.name == name) for name in ("a", "b", "c")}
    assert counts == {"a": 4, "b": 3, "c": 1}  # never more ranges than blocks


def render(composed: object) -> str:
    return composed.as_string(None)  # type: ignore[attr-defined,no-any-return]


def test_task_sql_uses_tid_ranges_and_quotes_identifiers() -> None:
    leaves = [Leaf(0, "My Schema", 'we"ird', 300)]
    first, middle, last = sorted(
        plan_tasks(leaves, [("id", "Select")], requested=3), key=lambda t: t.range.first
    )
    assert render(copy_out_sql(first)) == (
        'COPY (SELECT "id", "Select" FROM ONLY "My Schema"."we""ird"'
        " WHERE ctid < '(100,0)'::tid) TO STDOUT (FORMAT binary)"
    )
    assert "WHERE ctid >= '(100,0)'::tid AND ctid < '(200,0)'::tid)" in render(copy_out_sql(middle))
    out = render(copy_out_sql(last))
    assert "WHERE ctid >= '(200,0)'::tid)" in out and "ctid <" not in out
    assert render(copy_in_sql(last)) == (
        'COPY "My Schema"."we""ird" ("id", "Select") FROM STDIN (FORMAT binary)'
    )
    single = plan_tasks([Leaf(0, "public", "t", 5)], [("id",)])[0]
    assert "WHERE" not in render(copy_out_sql(single))


def test_binary_copy_only_between_servers_of_one_major_version() -> None:
    task = plan_tasks([Leaf(0, "public", "t", 5)], [("id",)])[0]
    assert task.binary
    assert between(task, 150018, 150004) is task  # minor versions differ: still binary
    assert between(task, 180006, 180006) is task
    for donor, target in ((150018, 180006), (180006, 150018), (160014, 170010)):
        copied = between(task, donor, target)
        assert not copied.binary, (donor, target)
        assert "(FORMAT text)" in render(copy_out_sql(copied))
        assert "(FORMAT text)" in render(copy_in_sql(copied))
    text_only = plan_tasks([Leaf(0, "public", "t", 5, binary=False)], [("id",)])[0]
    assert not between(text_only, 180006, 180006).binary  # a type binary COPY cannot carry: text anyway


@pytest.mark.parametrize(
    ("master", "failures", "expected"),
    [
        ("local", 4, "local[1,4]"),
        ("local[*]", 4, "local[*,4]"),
        ("local[2]", 3, "local[2,3]"),
        ("local[2,7]", 3, "local[2,7]"),
        ("spark://host:7077", 4, "spark://host:7077"),
    ],
)
def test_master_gets_local_retry_syntax(master: str, failures: int, expected: str) -> None:
    assert with_retries(master, failures) == expected


def test_local_parallelism() -> None:
    assert local_parallelism("local[3]") == 3
    assert local_parallelism("local[2,4]") == 2
    assert local_parallelism("local") == 1
    assert (local_parallelism("local[*]") or 0) >= 1
    assert local_parallelism("yarn") is None


def test_task_failure_record_survives_a_wrapping_error_text() -> None:
    failure = TaskFailure("target", "public.t", 'relation "t" does not exist', "42P01", None)
    wrapped = (
        "An error occurred while calling o42.collectAndServe.\n: org.apache.spark.SparkException: Job aborted"
        f"\nTraceback (most recent call last):\n  ...\nrouter.sync.worker.TaskFailure: {failure}\n\tat org..."
    )
    assert TaskFailure.last_in(wrapped) == failure.record
    assert TaskFailure.last_in("no record here") is None


def test_progress_bar_renders_one_line_and_ends_it_when_final() -> None:
    out = io.StringIO()
    bar = ProgressBar(out)
    p = CopyProgress(3, 5, 41, 64, int(812.3 * MB), 7_100_000, elapsed=20.0, copy_elapsed=10.0)
    bar(p)
    assert out.getvalue() == "\rcopy  3/5 tables  41/64 tasks  812.3 MB  7,100,000 rows  81.2 MB/s"
    bar(CopyProgress(5, 5, 64, 64, 10, 10, elapsed=21.0, copy_elapsed=11.0, final=True))
    assert out.getvalue().endswith("\n")
    assert "\n" not in out.getvalue()[:-1]
