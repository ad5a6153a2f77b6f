"""Every metric pgmesh exports, the families that hold their values, and the collector that hands them
to prometheus_client at scrape time.

Owns: the name, type, help text and label names of each `pgmesh_*` metric (all of them are declared
in `Metrics.__init__`, nowhere else) and the counter and gauge families that keep their values. The
text exposition format is prometheus_client's (`generate_latest` on a private `CollectorRegistry` that
holds only this `Registry`, a custom collector read whole at each scrape; no `_created` series).
Must not: do I/O, register anything in prometheus_client's global registry, start tasks or read
clocks. The router creates one `Metrics` and passes it to whoever updates or serves it (the admin
listener).

The router runs on one event loop, so families and children take no locks. Families are collected
sorted by name and children by label values, so the same state always renders the same text.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Final, Generic, TypeVar

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

if TYPE_CHECKING:
    from router.apply.state import LinkStats
    from router.stream.state import SourceStats

__all__ = [
    "CONTENT_TYPE",
    "LINK_LABELS",
    "LINK_STATES",
    "Counter",
    "CounterChild",
    "Gauge",
    "GaugeChild",
    "Metrics",
    "Registry",
    "raise_to",
]

logger = logging.getLogger(__name__)

CONTENT_TYPE: Final = CONTENT_TYPE_PLAIN_0_0_4  # text/plain; version=0.0.4; charset=utf-8
PREFIX: Final = "pgmesh_"
LINK_LABELS: Final = ("source", "target")
LINK_STATES: Final = ("streaming", "paused", "catching_up", "down", "error", "schema_drift", "clock_skew")

_METRIC_NAME_RE: Final = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME_RE: Final = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


class CounterChild:
    """One labelled counter: only goes up (until the process restarts)."""

    __slots__ = ("_value",)

    def __init__(self) -> None:
        self._value = 0.0

    def inc(self, n: float = 1) -> None:
        if n < 0:
            raise ValueError(f"a counter only goes up: inc({n!r})")
        self._value += n

    def get(self) -> float:
        return self._value


class GaugeChild:
    """One labelled gauge: a value that can go up and down."""

    __slots__ = ("_value",)

    def __init__(self) -> None:
        self._value = 0.0

    def inc(self, n: float = 1) -> None:
        self._value += n

    def dec(self, n: float = 1) -> None:
        self._value -= n

    def set(self, value: float) -> None:
        self._value = float(value)

    def get(self) -> float:
        return self._value


ChildT = TypeVar("ChildT", CounterChild, GaugeChild)


class _Family(Generic[ChildT]):
    """A metric name with its help text, label names and one child per distinct set of label values."""

    __slots__ = ("_children", "help", "labelnames", "name")
    kind: str = "untyped"

    def __init__(self, name: str, help: str, labelnames: Iterable[str] = ()) -> None:
        self.name = name
        self.help = help
        self.labelnames: tuple[str, ...] = tuple(labelnames)
        _check_names(name, self.labelnames)
        self._children: dict[tuple[str, ...], ChildT] = {}
        if not self.labelnames:
            # A family without labels always exposes its one sample, 0 until touched.
            self._children[()] = self._new_child()

    def _new_child(self) -> ChildT:
        raise NotImplementedError

    def _exported(self) -> CounterMetricFamily | GaugeMetricFamily:
        raise NotImplementedError

    def labels(self, **labels: object) -> ChildT:
        """The child for these label values (created at 0 on first use). Every label name is required."""
        key = self._key(labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        return child

    def find(self, **labels: object) -> ChildT | None:
        """The child for these label values if it exists; never creates one."""
        return self._children.get(self._key(labels))

    def remove(self, **labels: object) -> None:
        """Forget one child (a node that left the cluster); unknown label values are ignored."""
        self._children.pop(self._key(labels), None)

    def remove_where(self, label: str, value: str) -> None:
        """Forget every child whose `label` is `value` (no-op when the family has no such label)."""
        if label not in self.labelnames:
            return
        index = self.labelnames.index(label)
        for key in [key for key in self._children if key[index] == value]:
            del self._children[key]

    def clear(self) -> None:
        """Forget every child (a family without labels keeps its one sample, back at 0)."""
        self._children.clear()
        if not self.labelnames:
            self._children[()] = self._new_child()

    def _key(self, labels: dict[str, object]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"metric {self.name} takes labels {list(self.labelnames)}, got {sorted(labels)}")
        return tuple(str(labels[name]) for name in self.labelnames)

    def samples(self) -> Iterator[tuple[tuple[str, ...], float]]:
        """(label values, value) for each child, sorted by label values."""
        for key in sorted(self._children):
            yield key, self._children[key].get()

    def collect(self) -> Metric:
        """The family as prometheus_client exposes it: its children as they are now."""
        exported = self._exported()
        for key, value in self.samples():
            exported.add_metric(list(key), value)
        return exported


def _check_names(name: str, labelnames: tuple[str, ...]) -> None:
    if not _METRIC_NAME_RE.match(name):
        raise ValueError(f"invalid metric name {name!r}")
    for label in labelnames:
        if not _LABEL_NAME_RE.match(label) or label.startswith("__"):
            raise ValueError(f"metric {name}: invalid label name {label!r}")
    if len(set(labelnames)) != len(labelnames):
        raise ValueError(f"metric {name}: duplicate label names {list(labelnames)}")


class Counter(_Family[CounterChild]):
    """A family of counters (its name ends with `_total`, as prometheus_client exposes counters)."""

    __slots__ = ()
    kind = "counter"

    def __init__(self, name: str, help: str, labelnames: Iterable[str] = ()) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"invalid metric name {name!r}: a counter's name ends with _total")
        super().__init__(name, help, labelnames)

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def _exported(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.help, labels=self.labelnames)


class Gauge(_Family[GaugeChild]):
    """A family of gauges."""

    __slots__ = ()
    kind = "gauge"

    def _new_child(self) -> GaugeChild:
        return GaugeChild()

    def _exported(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self.name, self.help, labels=self.labelnames)


class Registry:
    """A set of families with unique names: a prometheus_client collector, read whole at each scrape
    through a private `CollectorRegistry` (never the global one)."""

    __slots__ = ("_exposition", "_families")

    def __init__(self) -> None:
        self._families: dict[str, Counter | Gauge] = {}
        self._exposition = CollectorRegistry(auto_describe=False)
        self._exposition.register(self)

    def counter(self, name: str, help: str, labelnames: Iterable[str] = ()) -> Counter:
        family = Counter(name, help, labelnames)
        self._add(family)
        return family

    def gauge(self, name: str, help: str, labelnames: Iterable[str] = ()) -> Gauge:
        family = Gauge(name, help, labelnames)
        self._add(family)
        return family

    def _add(self, family: Counter | Gauge) -> None:
        if family.name in self._families:
            raise ValueError(f"metric {family.name} is registered twice")
        self._families[family.name] = family

    def families(self) -> list[Counter | Gauge]:
        """Every family, sorted by name."""
        return [self._families[name] for name in sorted(self._families)]

    def collect(self) -> Iterator[Metric]:
        """prometheus_client's collector protocol: every family as it is now, sorted by name."""
        for family in self.families():
            yield family.collect()

    def render(self) -> str:
        """The whole registry in the Prometheus text exposition format 0.0.4 (prometheus_client's)."""
        return generate_latest(self._exposition).decode("utf-8")


def raise_to(child: CounterChild, value: float) -> None:
    """Bring a counter up to `value`, a count kept elsewhere and read whole (never down)."""
    if value > child.get():
        child.inc(value - child.get())


class Metrics:
    """Every metric pgmesh exports. The router creates one and passes it to sources, appliers and admin.

    Link metrics carry `source` (the node a transaction was committed on) and `target` (the node it is
    applied to); node metrics carry `node`.
    """

    __slots__ = (
        "applied_notes_total",
        "applied_rows_total",
        "applied_transactions_total",
        "apply_errors_total",
        "apply_retries_total",
        "clock_offset_seconds",
        "conflict_history_oldest_seconds",
        "conflict_history_pruned_total",
        "conflict_history_rows",
        "conflicts_total",
        "divergence_allowed",
        "divergent_rows",
        "early_rolled_back_total",
        "early_transactions_total",
        "echo_transactions_total",
        "lag_bytes",
        "lag_seconds",
        "lease_active",
        "lease_term",
        "lease_valid_seconds",
        "link_state",
        "lost_inserts_total",
        "quarantine_pruned_total",
        "quarantined_changes",
        "queue_transactions",
        "registry",
        "retained_wal_bytes",
        "retained_wal_safe_bytes",
        "router_log_bytes",
        "router_log_cap_bytes",
        "router_log_full",
        "router_log_readers",
        "schema_drift",
        "skipped_transactions_total",
        "source_received_bytes_total",
        "source_reconnects_total",
        "synchronous_k",
        "synchronous_satisfied",
        "tombstone_horizon_age_seconds",
        "tombstone_late_decisions_total",
        "tombstones",
        "tombstones_pruned_total",
        "tombstones_recorded_total",
    )

    def __init__(self) -> None:
        self.registry = Registry()
        self._declare_link_metrics()
        self._declare_node_metrics()

    def _declare_link_metrics(self) -> None:
        counter, gauge, link = self.registry.counter, self.registry.gauge, LINK_LABELS
        self.applied_transactions_total = counter(
            PREFIX + "applied_transactions_total", "Transactions committed on the target.", link
        )
        self.applied_rows_total = counter(
            PREFIX + "applied_rows_total", "Row changes applied on the target.", link
        )
        self.apply_retries_total = counter(
            PREFIX + "apply_retries_total",
            "Transactions retried on the target after a deadlock, serialization failure or lost connection.",
            link,
        )
        self.apply_errors_total = counter(
            PREFIX + "apply_errors_total", "Apply failures that paused or stopped the link.", link
        )
        self.skipped_transactions_total = counter(
            PREFIX + "skipped_transactions_total",
            "Transactions not applied because the target had already applied them (resent after a restart).",
            link,
        )
        self.early_transactions_total = counter(
            PREFIX + "early_transactions_total",
            "Large transactions whose apply on the target began before their commit arrived"
            " (replication.early_apply).",
            link,
        )
        self.early_rolled_back_total = counter(
            PREFIX + "early_rolled_back_total",
            "Of those, the ones rolled back on the target before their commit (aborted or resent by the"
            " source, or applied the normal way at their commit).",
            link,
        )
        self.lag_bytes = gauge(
            PREFIX + "lag_bytes",
            "WAL bytes from the target's applied position up to the source's last received position.",
            link,
        )
        self.lag_seconds = gauge(
            PREFIX + "lag_seconds", "Seconds since the source committed the last transaction applied.", link
        )
        self.queue_transactions = gauge(
            PREFIX + "queue_transactions", "Transactions queued in memory for the target.", link
        )
        self.link_state = gauge(
            PREFIX + "link_state",
            "1 for the link's current state, 0 for the others (" + ", ".join(LINK_STATES) + ").",
            (*link, "state"),
        )
        self.conflicts_total = counter(
            PREFIX + "conflicts_total",
            "Conflicts detected and resolved on the target, by table and conflict type.",
            (*link, "table", "type"),
        )
        self.lost_inserts_total = counter(
            PREFIX + "lost_inserts_total",
            "Inserts lost to key collisions, as the node decided them: insert_exists between two different"
            " rows (two nodes made the same key at once; the losing row is only in conflict_history). Every"
            " node sees each collision: do not add nodes up. Fix: `pgmesh sequences convert`.",
            ("node", "table"),
        )

    def _declare_node_metrics(self) -> None:
        counter = self.registry.counter
        self.quarantined_changes = self.registry.gauge(
            PREFIX + "quarantined_changes",
            "Changes the node refused and set aside (on_refused = \"quarantine\"), with the later changes of"
            " their keys, pending in pgmesh.quarantine: `pgmesh quarantine list`, fix, then replay.",
            ("node", "table"),
        )
        self.divergence_allowed = self.registry.gauge(
            PREFIX + "divergence_allowed",
            "1 for each resolver setting that can leave nodes with different rows, accepted only under"
            " [conflicts] allow_divergence = true (none: the cluster's resolvers converge).",
            ("setting",),
        )
        self.schema_drift = self.registry.gauge(
            PREFIX + "schema_drift",
            "1 for each node and replicated table whose columns differ from the other nodes' (the links"
            " into and out of the node hold until they agree; router.ddl.drift).",
            ("node", "table"),
        )
        self.divergent_rows = self.registry.gauge(
            PREFIX + "divergent_rows",
            "Rows the node holds apart from the other nodes in the table, as continuous verification last"
            " found them ([verify]; still different after every link applied past the first read; 0: the"
            " table was found identical). Repair: `pgmesh repair` (docs/verify.md).",
            ("node", "table"),
        )
        self.clock_offset_seconds = self.registry.gauge(
            PREFIX + "clock_offset_seconds",
            "Seconds the node's clock is ahead of the router's (negative: behind), measured every 10 s"
            " (router.cluster.clocks); beyond [clocks] max_offset_ms its links deciding by commit times"
            " hold.",
            ("node",),
        )
        self.echo_transactions_total = counter(
            PREFIX + "echo_transactions_total",
            "Transactions decoded from the node that carried a replication origin, so were not fanned out.",
            ("node",),
        )
        self.applied_notes_total = counter(
            PREFIX + "applied_notes_total",
            "pgmesh.applied messages decoded from the node (PostgreSQL 16+: what appliers committed there;"
            " its echoes are never sent).",
            ("node",),
        )
        self.source_received_bytes_total = counter(
            PREFIX + "source_received_bytes_total",
            "Replication stream bytes received from the node.",
            ("node",),
        )
        self.source_reconnects_total = counter(
            PREFIX + "source_reconnects_total", "Replication connections to the node opened again.", ("node",)
        )
        self.retained_wal_bytes = self.registry.gauge(
            PREFIX + "retained_wal_bytes",
            "WAL the node keeps for pgmesh's slot (from its restart_lsn to the node's WAL end), read every"
            " status tick; it grows while a link from the node is down or behind (docs/limits.md).",
            ("node",),
        )
        self.router_log_bytes = self.registry.gauge(
            PREFIX + "router_log_bytes",
            "Bytes of the router's log of the node on disk: transactions kept for links that fell behind"
            " (docs/scale.md); at its cap ([log] cap_mb) it stops growing and the node's slot keeps WAL.",
            ("node",),
        )
        self.router_log_cap_bytes = self.registry.gauge(
            PREFIX + "router_log_cap_bytes", "The cap of the router's log of the node ([log] cap_mb).",
            ("node",),
        )
        self.retained_wal_safe_bytes = self.registry.gauge(
            PREFIX + "retained_wal_safe_bytes",
            "WAL the node can still write before pgmesh's slot loses WAL (PostgreSQL's safe_wal_size, with"
            " max_slot_wal_keep_size set; absent without a limit): alert well before it reaches 0.",
            ("node",),
        )
        self.router_log_full = self.registry.gauge(
            PREFIX + "router_log_full",
            "1 while the router's log of the node is at its cap ([log] cap_mb): links that fall behind"
            " re-read the node and its slot keeps the WAL (the policy, docs/scale.md).",
            ("node",),
        )
        self.router_log_readers = self.registry.gauge(
            PREFIX + "router_log_readers", "Links out of the node reading the router's log (fell behind).",
            ("node",),
        )
        self.synchronous_k = self.registry.gauge(
            PREFIX + "synchronous_k", "How many other nodes a commit on the node waits for (synchronous;"
            " 0: asynchronous; docs/synchronous.md).", ("node",),
        )
        self.synchronous_satisfied = self.registry.gauge(
            PREFIX + "synchronous_satisfied", "With synchronous > 0: 1 while at least k of the node's targets"
            " are applying; 0: commits on the node wait (as PostgreSQL's own synchronous replication).",
            ("node",),
        )
        self.tombstones = self.registry.gauge(
            PREFIX + "tombstones",
            "Tombstones kept on the node (pgmesh.tombstones: the statistics' live tuples, read after each"
            " prune).",
            ("node",),
        )
        self.tombstones_pruned_total = counter(
            PREFIX + "tombstones_pruned_total",
            "Tombstones deleted on the node behind its horizon (router.conflicts.pruning).",
            ("node",),
        )
        self.tombstones_recorded_total = counter(
            PREFIX + "tombstones_recorded_total",
            "Tombstones of the node's own deletes written by its recorder from its stream"
            " (router.apply.recorder).",
            ("node",),
        )
        self.tombstone_late_decisions_total = counter(
            PREFIX + "tombstone_late_decisions_total",
            "Remote changes the node's recorder found on a key the node had deleted before recording it,"
            " decided then (conflict_history reason 'late: ...').",
            ("node",),
        )
        self.tombstone_horizon_age_seconds = self.registry.gauge(
            PREFIX + "tombstone_horizon_age_seconds",
            "Seconds from the node's tombstone horizon to now (+Inf: none yet; it grows while an incoming"
            " link is paused, down or silent, and nothing newer is pruned there).",
            ("node",),
        )
        # Bounded history (router.conflicts.history): [conflicts] keep and keep_rows
        self.conflict_history_rows = self.registry.gauge(
            PREFIX + "conflict_history_rows",
            "Rows of pgmesh.conflict_history on the node (the statistics' live tuples, read after each"
            " pruning round).", ("node",),
        )
        self.conflict_history_oldest_seconds = self.registry.gauge(
            PREFIX + "conflict_history_oldest_seconds",
            "Age of the oldest row of pgmesh.conflict_history on the node (0: none); about [conflicts] keep"
            " once the history is that old.", ("node",),
        )
        self.conflict_history_pruned_total = counter(
            PREFIX + "conflict_history_pruned_total",
            "Rows of pgmesh.conflict_history the router deleted on the node: older than [conflicts] keep,"
            " or over keep_rows.", ("node",),
        )
        self.quarantine_pruned_total = counter(
            PREFIX + "quarantine_pruned_total",
            "Entries of pgmesh.quarantine the router deleted on the node: replayed or discarded longer"
            " than [conflicts] keep ago (pending entries are never pruned).", ("node",),
        )

        # [ha] (router.service.lease), labelled with this router's name in the lease; none without [ha]
        gauge = self.registry.gauge
        self.lease_term = gauge(PREFIX + "lease_term", "The lease term this router holds (0: none).",
                                ("router",))
        self.lease_active = gauge(PREFIX + "lease_active",
                                  "1 on the router that holds the lease and applies, 0 on a standby.",
                                  ("router",))
        self.lease_valid_seconds = gauge(PREFIX + "lease_valid_seconds",
                                         "How long this router's lease stays valid unrenewed (0: a standby).",
                                         ("router",))

    def observe_source(self, node: str, stats: SourceStats) -> None:
        """Bring the node metrics of `node` up to its source's counters (read whole, as they are now)."""
        for family, new in ((self.echo_transactions_total, stats.echoes),
                            (self.applied_notes_total, stats.applied_notes),
                            (self.source_received_bytes_total, stats.bytes_received),
                            (self.source_reconnects_total, stats.reconnects)):
            raise_to(family.labels(node=node), new)

    def observe_recorder(self, node: str, recorded: int, late: int) -> None:
        """Bring the node metrics of `node` up to its tombstone recorder's counters (router.conflicts.
        recorder: tombstones written, late decisions)."""
        raise_to(self.tombstones_recorded_total.labels(node=node), recorded)
        raise_to(self.tombstone_late_decisions_total.labels(node=node), late)

    def observe_link(self, source: str, target: str, stats: LinkStats, before: LinkStats | None) -> None:
        """Add to the link metrics of source -> target what its applier counted (read whole) since
        `before`, its counters when last observed (None: since it started). The metrics carry on when
        the router builds its appliers again (a hold and release), whose counters start from zero. Every
        link's series exist from its first observation, at 0 until something counts (so that `rate()`
        and `increase()` see the first error, retry or skip)."""
        families = (self.applied_transactions_total, self.applied_rows_total, self.apply_retries_total,
                    self.apply_errors_total, self.skipped_transactions_total, self.early_transactions_total,
                    self.early_rolled_back_total)
        old = _link_counts(before) if before is not None else (0,) * len(families)
        for family, new, was in zip(families, _link_counts(stats), old, strict=True):
            child = family.labels(source=source, target=target)  # created at 0 on first use
            if new > was:
                child.inc(new - was)

    def set_link_state(self, source: str, target: str, state: str) -> None:
        """Mark `state` as the link's current state: 1 for it, 0 for every other state."""
        if state not in LINK_STATES:
            raise ValueError(f"unknown link state {state!r}; expected one of {', '.join(LINK_STATES)}")
        for candidate in LINK_STATES:
            self.link_state.labels(source=source, target=target, state=candidate).set(
                1 if candidate == state else 0
            )

    def link_state_of(self, source: str, target: str) -> str | None:
        """The state last set for the link, or None when none was."""
        for candidate in LINK_STATES:
            child = self.link_state.find(source=source, target=target, state=candidate)
            if child is not None and child.get() == 1:
                return candidate
        return None

    def forget_node(self, node: str) -> None:
        """Drop every series naming `node` as source, target or node (it left the cluster)."""
        for family in self.registry.families():
            for label in ("source", "target", "node"):
                family.remove_where(label, node)

    def render(self) -> str:
        """Every pgmesh metric in the Prometheus text exposition format 0.0.4."""
        return self.registry.render()


def _link_counts(stats: LinkStats) -> tuple[int, ...]:
    """A link's counters in the order of `Metrics.observe_link`'s families (early: both kinds)."""
    return (stats.applied_transactions, stats.applied_rows, stats.retries, stats.errors, stats.skipped,
            stats.early_transactions + stats.early_streams,
            stats.abandoned_transactions + stats.early_streams_dropped)
