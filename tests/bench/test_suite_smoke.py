"""Smoke test of `python -m bench --all` (bench/suite/): the report from made-up numbers, and one tiny
real run of the native system (fresh nodes, a few hundred transactions; about 15 s)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.harness.runs import plan_workloads
from bench.harness.workloads import Measurement
from bench.suite import runner as suite
from router.testing.localnodes import LocalNodeError, find_pg_bindir


def _made_up() -> list[Measurement]:
    return [
        Measurement("native", "tpcb", 0, {"tx/s": 1000.0}),
        Measurement("pgmesh2", "tpcb", 0, {"tx/s": 500.0}),
        Measurement("pgmesh3", "tpcb", 0, {"tx/s": 350.0, "tx/s a->b": 450.0, "tx/s a->c": 350.0}),
        Measurement("native3", "tpcb", 0, {"tx/s": 700.0, "tx/s a->b": 700.0, "tx/s a->c": 710.0}),
        Measurement("native", "lag", 0, {"p50 ms": 1.0, "p99 ms": 4.0},
                    {"targets": ["b"], "series": [[0.0, [1.0]], [0.05, [2.0]]]}),
        Measurement("pgmesh2", "lag", 0, {"p50 ms": 2.0, "p99 ms": 8.0},
                    {"targets": ["b"], "series": [[0.0, [2.0]], [0.05, [3.0]]]}),
        Measurement("pgmesh2", "multimaster", 0, {"tx/s": 300.0, "conflicts": 12.0}),
        Measurement("bucardo", "multimaster", 0, {"tx/s": 150.0, "conflicts": 3.0}),
    ]


def test_summary_ratios_are_higher_is_better_and_per_link() -> None:
    summary = suite.summary(_made_up(), suite.SYSTEM_ORDER)
    rows = {(r["system"], r["workload"], r["metric"]): r for r in summary}
    assert rows[("pgmesh2", "tpcb", "tx/s")]["ratio"] == pytest.approx(0.5)
    assert rows[("pgmesh2", "lag", "p50 ms")]["ratio"] == pytest.approx(0.5)  # native / system
    assert rows[("pgmesh3", "tpcb", "tx/s a->b")]["ratio"] == pytest.approx(0.45)  # against native's tx/s
    assert rows[("bucardo", "multimaster", "tx/s")]["ratio"] == pytest.approx(0.5)  # against pgmesh2
    assert rows[("pgmesh2", "multimaster", "conflicts")]["ratio"] is None
    links = suite.link_check(list(rows.values()))
    links.sort(key=lambda r: (r["system"] != "pgmesh3", r["metric"]))
    assert [(r["system"], r["metric"], r["within_20pct"]) for r in links] == [
        ("pgmesh3", "tx/s a->b", True), ("pgmesh3", "tx/s a->c", False),  # against pgmesh2's 500
        ("native3", "tx/s a->b", False), ("native3", "tx/s a->c", False),  # against native's 1000
    ]
    assert [round(r["vs_two_nodes"], 2) for r in links] == [0.9, 0.7, 0.7, 0.71]


def test_report_lists_not_run_and_errors(tmp_path: Path) -> None:
    planned, not_run = plan_workloads(suite.SYSTEM_ORDER, suite.WORKLOADS, include_slow=False)
    assert "multimaster" not in planned["native"] and "bulk" not in planned["bucardo"]
    failures = [suite.Failure("pglogical", "tpcb", 0, "setup: RuntimeError: boom")]
    args = suite.parse_args([])
    doc = suite.build_doc(args, "cmd", suite.Sizes.for_scale(1.0), suite.SYSTEM_ORDER, suite.WORKLOADS,
                          _made_up(), failures, 1.0, not_run=not_run, system_seconds=[])
    text = suite.render_markdown(doc, "results")
    assert "| native | multimaster | tx/s | n/a | n/a | one-way replication only |" in text
    assert "| pgmesh2 | tpcb | tx/s | 500 | 500 | 0.50x |" in text
    assert "- pglogical: not run: setup: RuntimeError: boom" in text
    problems = suite.write_plots(doc, tmp_path)
    if not problems:  # matplotlib installed
        assert (tmp_path / "lag.png").stat().st_size > 0 and (tmp_path / "throughput.png").stat().st_size > 0


def _have_postgres() -> bool:
    try:
        return os.access(find_pg_bindir() / "pgbench", os.X_OK)
    except LocalNodeError:
        return False


@pytest.mark.skipif(not _have_postgres(), reason="needs PostgreSQL 15+ binaries with pgbench")
def test_tiny_real_run(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    argv = ["--scale", "0.01", "--runs", "1", "--only-system", "native", "--only-workload", "tpcb",
            "--only-workload", "visibility", "--out", str(out)]
    assert suite.main(argv) == 0
    doc = json.loads((tmp_path / "results" / "suite.json").read_text())
    assert doc["failures"] == []
    assert {m["workload"] for m in doc["measurements"]} == {"tpcb", "visibility"}
    assert "| native | tpcb | tx/s |" in out.read_text()


@pytest.mark.skipif(not _have_postgres(), reason="needs PostgreSQL 15+ binaries with pgbench")
def test_tiny_run_over_delayed_links(tmp_path: Path) -> None:
    """native3 (two subscribers) and pgmesh2 with their replication connections through the delaying
    proxies: both replicate through them, and native3's links get the 3-against-2 table."""
    out = tmp_path / "RESULTS.md"
    argv = ["--scale", "0.01", "--runs", "1", "--rtt-ms", "1", "--only-system", "native", "--only-system",
            "native3", "--only-system", "pgmesh2", "--only-workload", "tpcb", "--out", str(out)]
    assert suite.main(argv) == 0
    doc = json.loads((tmp_path / "results" / "suite.json").read_text())
    assert doc["failures"] == [] and doc["rtt_ms"] == 1.0
    assert {m["system"] for m in doc["measurements"]} == {"native", "native3", "pgmesh2"}
    links = {(r["system"], r["metric"]) for r in doc["links"]}
    assert links == {("native3", "tx/s a->b"), ("native3", "tx/s a->c")}
    assert "1 ms added to their round trip" in out.read_text()
