"""The metrics registry, the families it holds and the text prometheus_client renders from them (pure: no
server, no loop)."""

from __future__ import annotations

import math
import re

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.service.metrics import (
    CONTENT_TYPE,
    LINK_STATES,
    Counter,
    Gauge,
    Metrics,
    Registry,
)


def test_small_registry_renders_exactly() -> None:
    registry = Registry()
    applied = registry.counter("demo_applied_total", "Transactions applied.", ("source", "target"))
    lag = registry.gauge("demo_lag_seconds", "Seconds behind.", ("source", "target"))
    up = registry.gauge("demo_up", "1 while running.")
    registry.counter("demo_empty_total", "Nothing yet.", ("node",))
    applied.labels(source="b", target="a").inc()
    applied.labels(source="a", target="b").inc(41)
    applied.labels(source="a", target="b").inc()
    lag.labels(source="a", target="b").set(0.25)
    up.labels().set(1)

    assert registry.render() == (
        "# HELP demo_applied_total Transactions applied.\n"
        "# TYPE demo_applied_total counter\n"
        'demo_applied_total{source="a",target="b"} 42.0\n'
        'demo_applied_total{source="b",target="a"} 1.0\n'
        "# HELP demo_empty_total Nothing yet.\n"
        "# TYPE demo_empty_total counter\n"
        "# HELP demo_lag_seconds Seconds behind.\n"
        "# TYPE demo_lag_seconds gauge\n"
        'demo_lag_seconds{source="a",target="b"} 0.25\n'
        "# HELP demo_up 1 while running.\n"
        "# TYPE demo_up gauge\n"
        "demo_up 1.0\n"
    )


def test_empty_registry_renders_nothing() -> None:
    assert Registry().render() == ""


def test_unlabelled_family_exposes_zero_until_touched() -> None:
    registry = Registry()
    registry.counter("demo_total", "Demo.")
    assert registry.render().splitlines()[-1] == "demo_total 0.0"


def test_label_values_are_escaped() -> None:
    registry = Registry()
    family = registry.gauge("demo", "Demo.", ("table",))
    family.labels(table='we\\ird "t"\nname').set(1)
    assert registry.render().splitlines()[-1] == 'demo{table="we\\\\ird \\"t\\"\\nname"} 1.0'


def test_help_text_is_escaped() -> None:
    registry = Registry()
    registry.gauge("demo", 'back\\slash\nnew line, "quotes" kept')
    assert registry.render().splitlines()[0] == '# HELP demo back\\\\slash\\nnew line, "quotes" kept'


def test_labels_render_sorted_by_name_whatever_the_declared_order() -> None:
    registry = Registry()
    family = registry.counter("demo_total", "Demo.", ("target", "source", "type"))
    family.labels(type="insert_exists", source="a", target="b").inc()
    assert registry.render().splitlines()[-1] == 'demo_total{source="a",target="b",type="insert_exists"} 1.0'


def test_label_values_are_converted_to_text() -> None:
    family = Gauge("demo", "Demo.", ("n",))
    family.labels(n=3).set(1)
    assert family.labels(n="3").get() == 1


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0.0"),
        (42, "42.0"),
        (-3.0, "-3.0"),
        (0.5, "0.5"),
        (1e300, "1e+300"),
        (1.5e-07, "1.5e-07"),
        (2.0**53, "9.007199254740992e+15"),
        (math.inf, "+Inf"),
        (-math.inf, "-Inf"),
        (math.nan, "NaN"),
    ],
)
def test_values_format_like_prometheus(value: float, text: str) -> None:
    registry = Registry()
    registry.gauge("demo", "Demo.").labels().set(value)
    assert registry.render().splitlines()[-1] == f"demo {text}"


def test_children_sort_stably_by_label_values() -> None:
    family = Counter("demo_total", "Demo.", ("node",))
    for node in ("c", "a", "b"):
        family.labels(node=node).inc()
    assert [key for key, _ in family.samples()] == [("a",), ("b",), ("c",)]


def test_counter_and_gauge_children() -> None:
    counter = Counter("demo_total", "Demo.", ("node",))
    child = counter.labels(node="a")
    child.inc()
    child.inc(2.5)
    assert counter.labels(node="a") is child
    assert child.get() == 3.5
    with pytest.raises(ValueError, match="only goes up"):
        child.inc(-1)
    gauge = Gauge("demo", "Demo.", ("node",)).labels(node="a")
    gauge.set(10)
    gauge.inc(2)
    gauge.dec(5)
    assert gauge.get() == 7


def test_a_counter_name_ends_with_total() -> None:
    with pytest.raises(ValueError, match="a counter's name ends with _total"):
        Counter("demo_applied", "Demo.")


@pytest.mark.parametrize("labels", [{}, {"source": "a"}, {"source": "a", "target": "b", "x": "c"}])
def test_labels_must_match_the_declared_names(labels: dict[str, str]) -> None:
    family = Counter("demo_total", "Demo.", ("source", "target"))
    with pytest.raises(ValueError, match=r"demo_total takes labels \['source', 'target'\]"):
        family.labels(**labels)


@pytest.mark.parametrize(
    ("name", "labelnames"),
    [("1bad", ()), ("bad-name", ()), ("ok", ("bad-label",)), ("ok", ("__reserved",)), ("ok", ("a", "a"))],
)
def test_invalid_names_are_refused(name: str, labelnames: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match=r"invalid|duplicate"):
        Gauge(name, "Demo.", labelnames)
    with pytest.raises(ValueError, match=r"invalid|duplicate"):
        Counter(name + "_total", "Demo.", labelnames)


def test_a_name_registers_once() -> None:
    registry = Registry()
    registry.counter("demo_total", "Demo.")
    with pytest.raises(ValueError, match="registered twice"):
        registry.gauge("demo_total", "Demo.")


def test_remove_and_clear() -> None:
    family = Gauge("demo", "Demo.", ("source", "target"))
    family.labels(source="a", target="b").set(1)
    family.labels(source="b", target="a").set(2)
    family.labels(source="b", target="c").set(3)
    family.remove(source="a", target="b")
    family.remove(source="x", target="y")  # unknown: ignored
    assert [key for key, _ in family.samples()] == [("b", "a"), ("b", "c")]
    family.remove_where("target", "a")
    assert [key for key, _ in family.samples()] == [("b", "c")]
    assert family.find(source="b", target="c") is not None
    assert family.find(source="c", target="b") is None
    family.clear()
    assert list(family.samples()) == []


EXPECTED_PGMESH_METRICS = {
    "pgmesh_applied_transactions_total": ("counter", ("source", "target")),
    "pgmesh_applied_rows_total": ("counter", ("source", "target")),
    "pgmesh_apply_retries_total": ("counter", ("source", "target")),
    "pgmesh_apply_errors_total": ("counter", ("source", "target")),
    "pgmesh_skipped_transactions_total": ("counter", ("source", "target")),
    "pgmesh_early_transactions_total": ("counter", ("source", "target")),
    "pgmesh_early_rolled_back_total": ("counter", ("source", "target")),
    "pgmesh_echo_transactions_total": ("counter", ("node",)),
    "pgmesh_applied_notes_total": ("counter", ("node",)),
    "pgmesh_divergence_allowed": ("gauge", ("setting",)),
    "pgmesh_schema_drift": ("gauge", ("node", "table")),
    "pgmesh_divergent_rows": ("gauge", ("node", "table")),
    "pgmesh_quarantined_changes": ("gauge", ("node", "table")),
    "pgmesh_tombstones": ("gauge", ("node",)),
    "pgmesh_tombstones_pruned_total": ("counter", ("node",)),
    "pgmesh_tombstones_recorded_total": ("counter", ("node",)),
    "pgmesh_tombstone_late_decisions_total": ("counter", ("node",)),
    "pgmesh_tombstone_horizon_age_seconds": ("gauge", ("node",)),
    "pgmesh_conflict_history_rows": ("gauge", ("node",)),
    "pgmesh_conflict_history_oldest_seconds": ("gauge", ("node",)),
    "pgmesh_conflict_history_pruned_total": ("counter", ("node",)),
    "pgmesh_quarantine_pruned_total": ("counter", ("node",)),
    "pgmesh_lag_bytes": ("gauge", ("source", "target")),
    "pgmesh_lag_seconds": ("gauge", ("source", "target")),
    "pgmesh_queue_transactions": ("gauge", ("source", "target")),
    "pgmesh_link_state": ("gauge", ("source", "target", "state")),
    "pgmesh_source_received_bytes_total": ("counter", ("node",)),
    "pgmesh_source_reconnects_total": ("counter", ("node",)),
    "pgmesh_retained_wal_bytes": ("gauge", ("node",)),
    "pgmesh_router_log_bytes": ("gauge", ("node",)),
    "pgmesh_router_log_cap_bytes": ("gauge", ("node",)),
    "pgmesh_retained_wal_safe_bytes": ("gauge", ("node",)),
    "pgmesh_router_log_full": ("gauge", ("node",)),
    "pgmesh_router_log_readers": ("gauge", ("node",)),
    "pgmesh_synchronous_k": ("gauge", ("node",)),
    "pgmesh_synchronous_satisfied": ("gauge", ("node",)),
    "pgmesh_lease_term": ("gauge", ("router",)),
    "pgmesh_lease_active": ("gauge", ("router",)),
    "pgmesh_lease_valid_seconds": ("gauge", ("router",)),
    "pgmesh_conflicts_total": ("counter", ("source", "target", "table", "type")),
    "pgmesh_lost_inserts_total": ("counter", ("node", "table")),
    "pgmesh_clock_offset_seconds": ("gauge", ("node",)),
}


def test_pgmesh_metrics_are_all_declared_with_their_types_and_labels() -> None:
    metrics = Metrics()
    declared = {f.name: (f.kind, f.labelnames) for f in metrics.registry.families()}
    assert declared == EXPECTED_PGMESH_METRICS
    for name in EXPECTED_PGMESH_METRICS:
        family = getattr(metrics, name.removeprefix("pgmesh_"))
        assert family.name == name


def test_fresh_metrics_render_help_and_type_only() -> None:
    lines = Metrics().render().splitlines()
    assert len(lines) == 2 * len(EXPECTED_PGMESH_METRICS)
    assert all(line.startswith(("# HELP pgmesh_", "# TYPE pgmesh_")) for line in lines)
    assert [line.split()[2] for line in lines if line.startswith("# TYPE")] == sorted(EXPECTED_PGMESH_METRICS)


def test_link_state_is_one_hot() -> None:
    metrics = Metrics()
    assert metrics.link_state_of("a", "b") is None
    metrics.set_link_state("a", "b", "catching_up")
    metrics.set_link_state("a", "b", "streaming")
    assert metrics.link_state_of("a", "b") == "streaming"
    samples = [line for line in metrics.render().splitlines() if line.startswith("pgmesh_link_state{")]
    assert samples == [
        f'pgmesh_link_state{{source="a",state="{state}",target="b"}} {float(state == "streaming")}'
        for state in sorted(LINK_STATES)
    ]
    with pytest.raises(ValueError, match="unknown link state 'stuck'"):
        metrics.set_link_state("a", "b", "stuck")


def test_forget_node_drops_every_series_naming_it() -> None:
    metrics = Metrics()
    metrics.applied_transactions_total.labels(source="a", target="b").inc()
    metrics.applied_transactions_total.labels(source="b", target="c").inc()
    metrics.lag_bytes.labels(source="c", target="a").set(5)
    metrics.echo_transactions_total.labels(node="a").inc()
    metrics.set_link_state("a", "c", "down")
    metrics.forget_node("a")
    samples = [line for line in metrics.render().splitlines() if not line.startswith("#")]
    assert samples == ['pgmesh_applied_transactions_total{source="b",target="c"} 1.0']


def test_metrics_do_not_share_state() -> None:
    first, second = Metrics(), Metrics()
    first.apply_retries_total.labels(source="a", target="b").inc()
    assert second.apply_retries_total.find(source="a", target="b") is None


def test_content_type_is_the_text_format() -> None:
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")


# Captured from the hand-written registry this one replaced (every family given one sample), before the
# change: each series' name, type and label names, as Prometheus sees them (labels sorted by name).
BEFORE_PROMETHEUS_CLIENT = [
    ("pgmesh_applied_notes_total", "counter", ("node",)),
    ("pgmesh_applied_rows_total", "counter", ("source", "target")),
    ("pgmesh_applied_transactions_total", "counter", ("source", "target")),
    ("pgmesh_apply_errors_total", "counter", ("source", "target")),
    ("pgmesh_apply_retries_total", "counter", ("source", "target")),
    ("pgmesh_clock_offset_seconds", "gauge", ("node",)),
    ("pgmesh_conflicts_total", "counter", ("source", "table", "target", "type")),
    ("pgmesh_divergence_allowed", "gauge", ("setting",)),
    ("pgmesh_early_rolled_back_total", "counter", ("source", "target")),
    ("pgmesh_early_transactions_total", "counter", ("source", "target")),
    ("pgmesh_echo_transactions_total", "counter", ("node",)),
    ("pgmesh_lag_bytes", "gauge", ("source", "target")),
    ("pgmesh_lag_seconds", "gauge", ("source", "target")),
    ("pgmesh_link_state", "gauge", ("source", "state", "target")),
    ("pgmesh_lost_inserts_total", "counter", ("node", "table")),
    ("pgmesh_queue_transactions", "gauge", ("source", "target")),
    ("pgmesh_retained_wal_bytes", "gauge", ("node",)),
    ("pgmesh_retained_wal_safe_bytes", "gauge", ("node",)),
    ("pgmesh_router_log_bytes", "gauge", ("node",)),
    ("pgmesh_router_log_cap_bytes", "gauge", ("node",)),
    ("pgmesh_router_log_full", "gauge", ("node",)),
    ("pgmesh_router_log_readers", "gauge", ("node",)),
    ("pgmesh_schema_drift", "gauge", ("node", "table")),
    ("pgmesh_skipped_transactions_total", "counter", ("source", "target")),
    ("pgmesh_source_received_bytes_total", "counter", ("node",)),
    ("pgmesh_source_reconnects_total", "counter", ("node",)),
    ("pgmesh_synchronous_k", "gauge", ("node",)),
    ("pgmesh_synchronous_satisfied", "gauge", ("node",)),
    ("pgmesh_tombstone_horizon_age_seconds", "gauge", ("node",)),
    ("pgmesh_tombstone_late_decisions_total", "counter", ("node",)),
    ("pgmesh_tombstones", "gauge", ("node",)),
    ("pgmesh_tombstones_pruned_total", "counter", ("node",)),
    ("pgmesh_tombstones_recorded_total", "counter", ("node",)),
]


def every_series(metrics: Metrics) -> str:
    """The exposition with one sample in every family."""
    for family in metrics.registry.families():
        child = family.labels(**{name: "x" for name in family.labelnames})
        child.inc()
    return metrics.render()


def series_of(text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """(sample name, its family's type, label names) of each sample line, read with the Prometheus
    text parser of prometheus_client."""
    found = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.append((sample.name, family.type, tuple(sorted(sample.labels))))
    return sorted(found)


# Families added since, each with its own name (none renamed or changed).
ADDED_SINCE = [
    ("pgmesh_lease_active", "gauge", ("router",)),
    ("pgmesh_lease_term", "gauge", ("router",)),
    ("pgmesh_lease_valid_seconds", "gauge", ("router",)),
    ("pgmesh_conflict_history_oldest_seconds", "gauge", ("node",)),
    ("pgmesh_conflict_history_pruned_total", "counter", ("node",)),
    ("pgmesh_conflict_history_rows", "gauge", ("node",)),
    ("pgmesh_quarantine_pruned_total", "counter", ("node",)),
    ("pgmesh_divergent_rows", "gauge", ("node", "table")),
    ("pgmesh_quarantined_changes", "gauge", ("node", "table")),
]


def test_the_exposition_keeps_every_name_type_and_label_it_had() -> None:
    text = every_series(Metrics())
    assert series_of(text) == sorted(BEFORE_PROMETHEUS_CLIENT + ADDED_SINCE)
    types = re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE)
    assert sorted(types) == sorted((name, kind) for name, kind, _ in BEFORE_PROMETHEUS_CLIENT + ADDED_SINCE)


def test_no_created_series_and_nothing_in_the_global_registry() -> None:
    text = every_series(Metrics())
    assert "_created" not in text
    assert b"pgmesh_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)
