"""Synchronous replication (`synchronous` = k > 0, docs/synchronous.md): confirming at each commit, and
what status shows of it.

A node with k > 0 names the router's replication connection in its `synchronous_standby_names` (stock
synchronous replication, set by `pgmesh init`): a commit there returns once the router reports its
position flushed, which it does only once k targets have durably applied it and the slot may be
confirmed that far (router.progress.positions `SourceProgress.flush_position`). The progress tick alone would
add
up to `status_interval_ms` to every such commit, so `CommitConfirm` confirms at each commit instead: the
appliers' commits are durable when they return (their sessions commit with synchronous_commit local or
stronger: `Config.apply_synchronous_commit`), so each one moves its link's flushed position at once, and
the source's flush position is recomputed and sent (`ReplicationSource.confirm`, whose nudge sends a
status update now). The tombstone recorder's commits do the same (`recorded`), and so does each group
fsync of the source's log while a target is down (`watch_log`).

Must not: read positions from a node, apply anything, or report a position flushed that
`flush_position` does not allow.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from protocol.lsn import format_lsn
from protocol.transactions import Transaction
from router.apply.applier import Applier
from router.progress.positions import SourceProgress
from router.service.logs import RouterLogs
from router.service.monitor import MonitorTarget
from router.service.status import SynchronousStatus
from router.stream.log.store import SourceLog
from router.stream.source import ReplicationSource

__all__ = ["CommitConfirm", "synchronous_status"]

AppliedHook = Callable[[Applier, Transaction], None]


class CommitConfirm:
    """One source with k > 0: each durable commit of one of its links (or its recorder) confirms the
    source as far as `flush_position` allows, at once. `progress` and `source` are set once built."""

    __slots__ = ("progress", "source", "then")

    def __init__(self, then: AppliedHook | None = None) -> None:
        self.then = then  # the router's own hook (tests), called after
        self.progress: SourceProgress | None = None
        self.source: ReplicationSource | None = None

    def applied(self, applier: Applier, txn: Transaction) -> None:
        """An applier's commit returned: durable on its target (synchronous_commit local or stronger)."""
        applier.progress.on_flushed(txn.end_lsn)
        self.recorded()
        if self.then is not None:
            self.then(applier, txn)

    def watch_log(self, logs: RouterLogs, node: str, log: SourceLog) -> None:
        """With a link behind, the source's log encodes at each append, and each group fsync confirms at
        once (else a commit would wait for a progress tick while a target is down)."""
        log.eager = True
        log.on_durable = lambda: self._logged(logs, node)

    def _logged(self, logs: RouterLogs, node: str) -> None:
        if self.progress is not None:
            logs.durable(node, self.progress)
            self.recorded()

    def recorded(self) -> None:
        """A link's durable position moved: report the source's flush position now."""
        if self.progress is not None and self.source is not None:
            self.source.confirm(self.progress.flush_position())


def synchronous_status(
    k: int, node: str, progress: SourceProgress, source: ReplicationSource,
    appliers: Mapping[tuple[str, str], Applier], targets: Mapping[str, MonitorTarget],
) -> SynchronousStatus | None:
    """What status shows of `node`'s synchronous replication (None when k = 0): which of its targets are
    applying now (the link running, the node answering), and whether that is at least k."""
    if k <= 0:
        return None
    applying = sorted(
        link.target for link in progress.links
        if appliers[(node, link.target)].ready_for_more and targets[link.target].down_since is None
        and targets[link.target].error is None
    )
    return SynchronousStatus(k, applying, len(applying) >= k, format_lsn(source.flush_position()))
