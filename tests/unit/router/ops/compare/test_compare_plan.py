"""Key ranges of `pgmesh compare` (router.cluster.compare.plan): pure; and what a task's failure says."""

from __future__ import annotations

import pytest

from router.cluster.compare.plan import (
    CompareTable,
    RangeTask,
    bound_ranges,
    integer_ranges,
    partitions,
    sub_task,
)
from router.cluster.compare.worker import BUCKETS, CompareJob, differences, run_partition
from router.errors import PgmeshError
from router.ops.compare.job import task_error
from router.testing.mesh import free_port


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


def test_a_task_that_cannot_reach_a_node_names_it_and_never_its_dsn() -> None:
    port = free_port()  # nothing listens there
    dsn = f"host=127.0.0.1 port={port} user=postgres password=secret dbname=app"
    job = CompareJob(("a", "b"), (dsn, dsn), ("", ""), (CompareTable("public", "t", ("id",), "bigint"),))
    with pytest.raises(PgmeshError) as caught:
        list(run_partition(job, [RangeTask(0, None, None)]))
    assert caught.value.node in ("a", "b") and "cannot connect" in str(caught.value)
    assert "secret" not in str(caught.value)


def test_the_driver_reports_the_task_error_line_with_its_node() -> None:
    spark_said = (
        "An error occurred while calling o42.collect.\n: org.apache.spark.SparkException: Job aborted\n"
        "Traceback (most recent call last):\n  File \"worker.py\", line 1\n"
        "router.errors.PgmeshError: node b, table public.t, SQLSTATE 42501: reading a key range failed: no\n"
        "\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException\n"
    )
    assert task_error(RuntimeError(spark_said)) == (
        "node b, table public.t, SQLSTATE 42501: reading a key range failed: no"
    )
    assert task_error(RuntimeError("x\nValueError: bad")) == "ValueError: bad"


def test_a_bucket_of_an_integer_span_is_cut_again_until_one_key() -> None:
    task = integer_ranges(0, 1, 1_000_000, 1)[0]
    inner = sub_task(task, 3, BUCKETS)
    assert inner is not None and inner.span is not None
    step = task.step(BUCKETS)
    assert inner.span == (1 + 3 * step, 1 + 4 * step)
    assert (inner.lo, inner.hi) == (str(1 + 3 * step), str(1 + 4 * step))
    assert sub_task(task, -1, BUCKETS) is None and sub_task(task, BUCKETS, BUCKETS) is None  # beyond the ends
    assert sub_task(RangeTask(0, None, None), 3, BUCKETS) is None  # hash buckets
    assert sub_task(RangeTask(0, "5", "69", (5, 69)), 1, BUCKETS) is None  # one key per bucket


def test_the_range_queue_projects_what_is_left_and_closes() -> None:
    from router.cluster.compare.plan import RangeTask
    from router.ops.compare.lanes import RangeQueue

    queue = RangeQueue([RangeTask(0, i, i + 1) for i in range(10)])
    assert queue.left_after(1.0, 0) == float("inf")  # nothing done yet
    taken = [queue.take() for _ in range(4)]
    assert all(t is not None for t in taken) and queue.taken == 4
    # 4 taken, 2 still being read: 2 done in 1 s, 6 left -> 3 s
    assert queue.left_after(1.0, 2) == 3.0
    rest = queue.close()
    assert [t.lo for t in rest] == [4, 5, 6, 7, 8, 9]
    assert queue.take() is None and list(queue.stream()) == []
    assert queue.left_after(1.0, 0) == 0.0
