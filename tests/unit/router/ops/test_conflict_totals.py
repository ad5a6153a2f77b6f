"""`pgmesh conflicts`'s totals by node: each node's conflicts by table and type, the time span they
cover, and how long the history is kept ([conflicts] keep, router.conflicts.history)."""

from __future__ import annotations

import datetime as dt

from router.ops.control import render_node_totals


def at(minute: int) -> dt.datetime:
    return dt.datetime(2026, 12, 6, 10, minute, tzinfo=dt.UTC)


def test_each_node_its_counts_and_span_busiest_first() -> None:
    per_node = {
        "a": {("public.kv", "update_origin_differs"): (7, at(1), at(9)),
              ("public.kv", "insert_exists"): (90, at(0), at(30))},
        "b": {},
    }
    lines = render_node_totals(per_node, "7d", 10_000_000).splitlines()
    assert lines[0] == ("by node (history kept 7d, at most 10,000,000 rows a node: [conflicts] keep,"
                        " keep_rows):")
    assert lines[1].split() == ["node", "table", "type", "count", "from", "(UTC)", "to", "(UTC)"]
    assert lines[2].split() == ["a", "public.kv", "insert_exists", "90", "2026-12-06", "10:00:00.000",
                                "2026-12-06", "10:30:00.000"]
    assert lines[3].split()[:4] == ["a", "public.kv", "update_origin_differs", "7"]
    assert lines[4].split() == ["b", "-", "-", "0", "-", "-"]
    assert render_node_totals(per_node, "2s", 0).splitlines()[0] == (
        "by node (history kept 2s: [conflicts] keep):")
