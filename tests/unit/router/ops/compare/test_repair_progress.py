"""router.ops.compare.progress: the repair's progress line, its estimate, hints and summary."""

from __future__ import annotations

import io

from router.ops.compare.progress import RepairProgress


def test_progress_lines_count_rate_and_time_left_then_a_summary() -> None:
    now = [0.0]
    out = io.StringIO()
    tally = RepairProgress(out, 0, clock=lambda: now[0])
    now[0] = 30.0  # the comparison: not counted in the rate
    tally.start(1000)
    now[0] = 31.0
    tally.decided(1000)
    tally.plan(1000)
    now[0] = 32.0
    tally.written(500)
    tally.hint("consider --from c")
    now[0] = 33.0
    tally.written(500)
    tally.finish()
    lines = out.getvalue().splitlines()
    assert lines[0] == "repair: 1,000/1,000 keys decided, 0/0 rows written, 1,000/s, 1.0 s, about - left"
    assert lines[1] == ("repair: 1,000/1,000 keys decided, 500/1,000 rows written, 750/s, 2.0 s,"
                        " about 1 s left")
    assert lines[2] == "hint: consider --from c"
    assert lines[-1].startswith("repair: 1,000 keys decided, 1,000 rows written in 3.0 s")


def test_nothing_printed_without_a_stream() -> None:
    tally = RepairProgress(None, 10)
    tally.decided(10)
    tally.hint("x")
    tally.finish()
