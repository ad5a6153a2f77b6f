"""What a running router reports: its status (`pgmesh status`, /status) and its /metrics.

`Reporter.status` builds the `StatusReport` from the router's links, sources, logs and watches;
`Reporter.export` brings the Prometheus metrics up to date with the same (counters as increments since
the last export). Reads the router's public state; changes nothing in it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec

from protocol.lsn import format_lsn, pg_us_to_datetime
from router.apply.applier import Applier
from router.apply.recorder import TombstoneRecorder
from router.apply.state import LinkState, LinkStats
from router.config.model import Config
from router.config.parts import describe_part
from router.ddl.drift import DriftWatch, drifted_nodes
from router.progress.positions import LinkProgress, SourceProgress
from router.service.clocks import ClockWatch
from router.service.lease import Lease
from router.service.logs import RouterLogs
from router.service.metrics import Metrics, raise_to
from router.service.monitor import MonitorTarget
from router.service.status import (
    LinkStatus,
    LogStatus,
    RecorderStatus,
    SourceStatus,
    StatusReport,
    SynchronousStatus,
)
from router.service.synchronous import synchronous_status
from router.service.verify.verifier import Verifier
from router.stream.fanout import SourcePump
from router.stream.log.store import SourceLog
from router.stream.source import ReplicationSource
from router.stream.state import SourceState

__all__ = ["Reporter"]


class Router(Protocol):
    """What the report reads of the router (router.service.supervisor.Router)."""

    clock: Callable[[], float]
    running: bool
    config: Config
    metrics: Metrics
    appliers: dict[tuple[str, str], Applier]
    pumps: dict[str, SourcePump]
    progress: dict[str, SourceProgress]
    targets: dict[str, MonitorTarget]
    recorders: dict[str, TombstoneRecorder]
    clocks: ClockWatch
    drift: DriftWatch
    logs: RouterLogs
    lease: Lease | None
    verify: Verifier | None


class Reporter:
    """Status and metrics of one router run; keeps each link's counters as last exported."""

    def __init__(self) -> None:
        self.exported: dict[tuple[str, str], LinkStats] = {}

    def export(self, router: Router) -> None:
        """Bring the metrics up to date with the appliers' and sources' own counters."""
        m = router.metrics
        status = {(link.source, link.target): link for link in self.status(router).links}
        for key, applier in router.appliers.items():
            labels = {"source": key[0], "target": key[1]}
            m.observe_link(key[0], key[1], applier.stats, self.exported.get(key))
            self.exported[key] = msgspec.structs.replace(applier.stats)  # a copy, as they are now
            link = status[key]
            if link.lag_bytes is not None:
                m.lag_bytes.labels(**labels).set(link.lag_bytes)
            m.lag_seconds.labels(**labels).set(link.lag_seconds or 0.0)
            m.queue_transactions.labels(**labels).set(link.queued)
            m.set_link_state(key[0], key[1], link.state.replace(" ", "_"))
        for (source, target), applier in router.appliers.items():
            for (table, kind), count in applier.conflict_counts().items():
                child = m.conflicts_total.labels(source=source, target=target, table=table, type=kind)
                raise_to(child, count)
        for node, lost in _lost_inserts(router).items():
            for table, count in lost.items():
                raise_to(m.lost_inserts_total.labels(node=node, table=table), count)
        for node, pump in router.pumps.items():
            m.observe_source(node, pump.stats)
            retained = router.targets[node].retained if node in router.targets else None
            if retained is not None:
                m.retained_wal_bytes.labels(node=node).set(retained.bytes)
                if retained.safe_wal_size is not None:
                    m.retained_wal_safe_bytes.labels(node=node).set(retained.safe_wal_size)
            log = router.logs.logs.get(node)
            if log is not None:
                m.router_log_bytes.labels(node=node).set(log.size)
                m.router_log_cap_bytes.labels(node=node).set(log.cap_bytes)
                m.router_log_full.labels(node=node).set(int(not log.appending))
                m.router_log_readers.labels(node=node).set(len(router.progress[node].logging()))
            m.synchronous_k.labels(node=node).set(router.progress[node].synchronous)
            synchronous = self._synchronous(router, node)
            if synchronous is not None:
                m.synchronous_satisfied.labels(node=node).set(int(synchronous.satisfied))
        for node, recorder in router.recorders.items():
            m.observe_recorder(node, recorder.recorded, recorder.late)
        if router.lease is not None:  # [ha] (docs/ha.md)
            me = router.lease.holder
            m.lease_term.labels(router=me).set(router.lease.term)
            m.lease_active.labels(router=me).set(int(router.lease.role == "active"))
            m.lease_valid_seconds.labels(router=me).set(router.lease.valid_for())
        for setting in router.config.divergent_resolvers():
            m.divergence_allowed.labels(setting=setting).set(1)
        router.clocks.export(m.clock_offset_seconds)
        if router.verify is not None:  # [verify]: pgmesh_divergent_rows
            router.verify.export(m)
        m.quarantined_changes.clear()  # (a table replayed or discarded goes)
        for node, pending in _quarantined(router).items():
            for table, count in pending.items():
                m.quarantined_changes.labels(node=node, table=table).set(count)
        m.schema_drift.clear()
        for node, tables in drifted_nodes(router.drift.drifted).items():
            for item in tables:
                m.schema_drift.labels(node=node, table=item.table).set(1)


    def conflicts_decided(self, router: Router) -> int:
        """Conflicts decided since the start: by the links, and late by the tombstone recorders (each is
        one row of pgmesh.conflict_history on the node that decided it; a late decision that replaced a
        link's record of the same change counts once)."""
        return (sum(applier.stats.conflicts for applier in router.appliers.values())
                + sum(recorder.late - recorder.replaced for recorder in router.recorders.values()))

    def health(self, router: Router) -> tuple[bool, str]:
        """Whether the router is well, and if not why; a standby ([ha]) is well while it waits."""
        if router.lease is not None and router.lease.role != "active":
            return True, f"standby: {router.lease.why}"
        if not router.running:
            return False, "the router is not running"
        bad = [f"node {node}: {why}" for node, why in _nodes_down(router).items()]
        bad += [f"link {a.name}: {a.last_error}" for a in router.appliers.values()
                if a.state is LinkState.ERROR]
        bad += [f"schema drift: {d.describe()}" for d in router.drift.drifted.values()]
        bad += router.clocks.problems()
        return (not bad, "; ".join(bad) if bad else "ok")

    def status(self, router: Router) -> StatusReport:
        now = router.clock()
        links = [self._link_status(router, key, applier, now) for key, applier in router.appliers.items()]
        sources = [
            SourceStatus(
                node=node, state=pump.source.state.value, received_lsn=format_lsn(pump.source.received_lsn),
                confirmed_lsn=format_lsn(pump.source.confirmed_lsn), transactions=pump.stats.transactions,
                echoes=pump.stats.echoes, applied_notes=pump.stats.applied_notes,
                reconnects=pump.stats.reconnects, last_error=pump.source.last_error,
                retained=router.targets[node].retained if node in router.targets else None,
                log=_log_status(router.logs.logs.get(node), router.progress[node]),
                synchronous=self._synchronous(router, node),
            )
            for node, pump in router.pumps.items()
        ]
        return StatusReport(
            router.config.cluster.name, router.running, links, sources, router.config.divergent_resolvers(),
            [d.describe() for d in router.drift.drifted.values()], router.clocks.report(),
            [RecorderStatus(node, format_lsn(r.progress.flushed), r.recorded, r.late, r.error)
             for node, r in router.recorders.items()],
            [n.name for n in router.config.nodes if n.receive_only],
            None if router.lease is None else router.lease.report(),
            {n.name: describe_part(n) for n in router.config.nodes if describe_part(n)},
            lost_inserts=_lost_inserts(router),
            verify=None if router.verify is None else router.verify.report(),
            quarantined=_quarantined(router),
        )

    def _synchronous(self, router: Router, node: str) -> SynchronousStatus | None:
        return synchronous_status(router.progress[node].synchronous, node, router.progress[node],
                                  router.pumps[node].source, router.appliers, router.targets)

    def _link_status(self, router: Router, key: tuple[str, str], applier: Applier, now: float) -> LinkStatus:
        source = router.pumps[key[0]].source
        link = applier.progress
        pending = applier.oldest_pending_commit_time()
        lag_seconds = max(0.0, now - pg_us_to_datetime(pending).timestamp()) if pending is not None else 0.0
        state, last_error = applier.state, applier.last_error
        if link.detached and state in (LinkState.STREAMING, LinkState.CATCHING_UP):
            state = LinkState.CATCHING_UP
        down = _nodes_down(router)
        cut = [n for n in (key[1], key[0]) if n in down]  # the target first: its own word on why
        # nothing can move over it; a link retrying its connection meanwhile (router.service.supervisor
        # makes the links into a node that stopped answering connect again) shows the node's word too
        if cut and state in (LinkState.STREAMING, LinkState.CATCHING_UP, LinkState.DOWN):
            state, last_error = LinkState.DOWN, f"node {cut[0]}: {down[cut[0]]}"
        stats = applier.stats
        last = stats.last_commit_time
        return LinkStatus(
            source=key[0], target=key[1], state=state.value,
            applied_lsn=format_lsn(link.applied), flushed_lsn=format_lsn(link.flushed),
            last_commit_time=pg_us_to_datetime(last).isoformat() if last is not None else None,
            lag_bytes=_lag_bytes(source, link, router.logs.confirmed.get(key[0], 0)),
            lag_seconds=round(lag_seconds, 3), queued=applier.pending,
            applied_transactions=stats.applied_transactions, applied_rows=stats.applied_rows,
            retries=stats.retries, last_error=last_error,
            synced_lsn=format_lsn(source.idle_position(link.synced(router.progress[key[0]].seen))),
        )


def _nodes_down(router: Router) -> dict[str, str]:
    """The nodes the router cannot work with now, and why: a node that does not answer its monitoring
    probe, or cannot be connected to (router.service.supervisor `_progress_of`), and a node whose
    replication stream is lost or stopped on an error (being reconnected): nothing moves into or out of it."""
    out = {name: str(t.error) for name, t in router.targets.items() if t.down_since is not None}
    for node, pump in router.pumps.items():
        source = pump.source
        if node in out:
            continue
        if source.lost_since is not None:
            out[node] = (f"replication connection lost {router.clock() - source.lost_since:.0f} s ago"
                         f" ({source.last_error}); reconnecting")
        elif source.state in (SourceState.ERROR, SourceState.FAILED):
            out[node] = f"replication stream stopped: {source.last_error}"
    return out


def _lag_bytes(source: ReplicationSource, link: LinkProgress, slot_start: int) -> int | None:
    """WAL between what the source sent and what this link applied, when it has work pending. A link
    that never applied anything (its position 0/0) counts from where the source's slot stood when the
    router started (`slot_start`; every link had what came before): never from 0/0."""
    if not link.detached and link.enqueued <= link.applied:
        return 0
    start = link.applied or max(slot_start, source.confirmed_lsn)
    if not start:
        return None  # nothing known to count from (the node was down at start): unknown, not 0
    return max(0, source.received_lsn - start)


def _quarantined(router: Router) -> dict[str, dict[str, int]]:
    """node -> table -> changes pending in its quarantine (router.apply.quarantine), nodes with any."""
    out: dict[str, dict[str, int]] = {}
    for (_, target), applier in router.appliers.items():
        if applier.quarantine.counts:
            out[target] = dict(applier.quarantine.counts)
    return out


def _lost_inserts(router: Router) -> dict[str, dict[str, int]]:
    """Node -> table -> inserts lost there to key collisions, over the links into it (router.apply.link)."""
    out: dict[str, dict[str, int]] = {}
    for (_, target), applier in router.appliers.items():
        for table, count in applier.link.lost_inserts.items():
            tables = out.setdefault(target, {})
            tables[table] = tables.get(table, 0) + count
    return out


def _log_status(log: SourceLog | None, progress: SourceProgress) -> LogStatus | None:
    if log is None:
        return None
    return LogStatus(
        bytes=log.size, cap_bytes=log.cap_bytes, state="appending" if log.appending else "full",
        first_lsn=format_lsn(log.first), end_lsn=format_lsn(log.end), durable_lsn=format_lsn(log.durable),
        readers=[link.target for link in progress.logging()],
    )
