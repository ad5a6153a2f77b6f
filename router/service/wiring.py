"""How the router is wired from the config and what the nodes say: one `ReplicationSource` +
`SourcePump` per node (with its router log and tombstone recorder), one `Applier` per link (source ->
target) with its progress, queue and `LinkClock`, and the watchers beside them (schema drift, clocks,
tombstone and history pruning), built again after every hold or lost lease.

`Wiring` is the router's parts and how they are built (`_load_state` reads flushed origin positions,
paused links and the nodes down; `_build` makes the parts); the supervisor (router.service.supervisor)
runs them. The schema drift watch reports to the links it holds (`Applier.add_hold` / `drop_hold`).

Must not: start or stop a task, or move a link's state (the appliers do; watchers report holds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

import msgspec
import psycopg

from protocol.lsn import parse_lsn
from protocol.transactions import Transaction
from router.apply.applier import Applier
from router.apply.encode import Encoder
from router.apply.quarantine import QuarantineIndex
from router.apply.recorder import RECORDED_SQL, TombstoneRecorder
from router.apply.state import LinkHold
from router.config.model import Config
from router.conflicts.history import HistoryPruner
from router.conflicts.pruning import TombstonePruner
from router.ddl.drift import DriftWatch, TableDrift, drifted_nodes
from router.errors import ConfigError, describe
from router.progress.positions import LinkProgress, SourceProgress
from router.service.clocks import ClockWatch
from router.service.logs import MARK_KEY, RouterLogs
from router.service.metrics import Metrics
from router.service.monitor import MonitorTarget
from router.service.report import Reporter
from router.service.synchronous import CommitConfirm
from router.service.verify.verifier import Verifier, applied_through
from router.stream.fanout import SourcePump
from router.stream.items import SourceOptions
from router.stream.linkqueue import LinkQueue
from router.stream.seen import origin_nodes
from router.stream.source import ReplicationSource
from router.stream.spool import Spool

__all__ = ["Wiring"]

logger = logging.getLogger(__name__)

_SYSTEM_ID_SQL = "SELECT system_identifier::text FROM pg_catalog.pg_control_system()"
# the router log this node's slot counted on (router.service.logs), and how far the slot is confirmed
_LOG_MARK_SQL = (f"SELECT (SELECT value FROM pgmesh.node_info WHERE key = '{MARK_KEY}'), (SELECT"
                 " confirmed_flush_lsn::text FROM pg_catalog.pg_replication_slots WHERE slot_name = %s)")


class Wiring:
    """The router's parts: sources, links, their progress and the watchers, built from the config."""

    pins: dict[str, int]  # node -> slot position a joining node pinned (router.cluster.joining)

    def __init__(
        self,
        config: Config,
        *,
        source_options: SourceOptions | None = None,
        clock: Callable[[], float] = time.time,
        on_applied: Callable[[Applier, Transaction], None] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.metrics = metrics or Metrics()
        self.reporter = Reporter()  # status and /metrics (router.service.report)
        self.source_options = source_options or SourceOptions(
            status_interval=max(1.0, config.replication.status_interval_ms / 1000), binary=False,
            application_name=config.standby_name, skip_echo_rows=True, origin_none=True,
            spill_bytes=config.replication.spill_mb << 20, early_spilled=config.replication.early_apply,
            early_streamed=config.replication.early_apply,
        )
        self.spool = Spool(config.replication.spool_dir or None, cluster=config.cluster.name)
        self.logs = RouterLogs(config, self.spool)  # each source's router log (router.service.logs)
        self._on_applied_hook = on_applied
        self.targets = {n.name: MonitorTarget(config, n) for n in config.nodes}
        self.appliers: dict[tuple[str, str], Applier] = {}
        # each target's pending quarantine keys, shared by the links into it (router.apply.quarantine)
        self.quarantines = {n.name: QuarantineIndex(n.name) for n in config.nodes}
        self.pumps: dict[str, SourcePump] = {}
        self.progress: dict[str, SourceProgress] = {}
        self.not_members: set[str] = set()  # nodes in the config without pgmesh yet (a join to come)
        # Schema drift (router.ddl.drift): the members' replicated tables compared, on connections of its own
        self.drift = DriftWatch({}, publication=config.publication_name, slot=config.slot_name,
                                on_change=self._drift_changed)
        self._drift_targets: list[MonitorTarget] = []
        self.clocks = ClockWatch(config)  # each node's clock offset; the links' guard and hold
        self._ddl_seen = 0  # DDL commands replayed by every link, when the drift watch was last poked
        # Each node's tombstone recorder (router.apply.recorder) and where it had got to at start
        self.recorders: dict[str, TombstoneRecorder] = {}
        self._recorded: dict[str, int | None] = {}
        self._sysids: dict[str, str] = {}
        self._lost: list[tuple[str, str, int, str]] = []  # links a lost router log may have left short
        self.verify: Verifier | None = None  # [verify]: continuous verification (router.service.verify)

    async def _load_state(
        self,
    ) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], str | None], set[str]]:
        """Flushed origin positions, paused links, and the nodes that could not be reached.

        A node that is down does not stop the others: the links into it start detached (position
        unknown, so they hold their sources' slots) and catch up when it answers again.
        """
        flushed: dict[tuple[str, str], int] = {}
        paused: dict[tuple[str, str], str | None] = {}
        down: set[str] = set()
        self.not_members = set()
        timeout = self.config.replication.node_timeout_ms / 1000  # a node cut off counts as down
        for name, target in self.targets.items():
            try:
                async with asyncio.timeout(timeout):
                    await target.origin_progress()
            except psycopg.errors.UndefinedTable:
                self.not_members.add(name)  # listed, not installed: a node still to be joined
                await target.close()
                target.conn = None
            except (psycopg.Error, TimeoutError):
                target.drop()  # reported below
        if self.not_members:
            if len(self.not_members) == len(self.targets) or len(self.targets) - len(self.not_members) < 2:
                missing = ", ".join(sorted(self.not_members))
                raise ConfigError(f"pgmesh is not installed on {missing}; run `pgmesh init`")
            logger.warning("pgmesh is not installed on %s: left out until `pgmesh join` (or init) adds it",
                           ", ".join(sorted(self.not_members)))
        for name, target in self.targets.items():
            if name in self.not_members:
                continue
            try:
                async with asyncio.timeout(timeout):
                    progress = await target.origin_progress()
                    held = await target.paused_sources()
                    recorded = await target.query(RECORDED_SQL)  # router.apply.recorder
                    ident = await target.query(_SYSTEM_ID_SQL)
                    mark, confirmed = (await target.query(_LOG_MARK_SQL, [self.config.slot_name]))[0]
            except psycopg.errors.UndefinedTable as exc:
                raise ConfigError(f"node {name}: pgmesh is not installed here; run `pgmesh init`") from exc
            except psycopg.errors.UndefinedColumn as exc:  # e.g. links.applied (router.progress.applied)
                raise ConfigError(
                    f"node {name}: pgmesh's objects here are older than this router ({describe(exc)});"
                    " run `pgmesh init`, which adds what is missing"
                ) from exc
            except (psycopg.OperationalError, TimeoutError) as exc:
                why = f"no answer within {timeout:g} s" if isinstance(exc, TimeoutError) else describe(exc)
                logger.warning("node %s is not reachable (%s): its links start detached and catch up later",
                               name, why)
                target.drop()
                target.error = why if isinstance(exc, TimeoutError) else f"not reachable: {why}"
                target.down_since = self.clock()  # shown down until it answers (`_progress_of`)
                down.add(name)
                continue
            except psycopg.Error as exc:
                raise ConfigError(f"node {name}: cannot read pgmesh's state: {describe(exc)}") from exc
            self._recorded[name] = parse_lsn(recorded[0][0]) if recorded else None
            self._sysids[name] = str(ident[0][0])  # the router's log of it is for this server only
            self.logs.marks[name] = mark
            self.logs.confirmed[name] = parse_lsn(confirmed) if confirmed else 0
            for source in self.config.node_names:
                if source == name or source in self.not_members:
                    continue
                if source not in progress:
                    raise ConfigError(
                        f"node {name}: replication origin {self.config.origin_name(source)} is missing;"
                        " run `pgmesh init`"
                    )
                flushed[(source, name)] = progress[source]
                if source in held:
                    paused[(source, name)] = held[source]
        if len(down) == len(self.targets) - len(self.not_members):
            why = "; ".join(f"{n}: {self.targets[n].error}" for n in sorted(down))  # (a wrong CA...)
            raise ConfigError(f"no node is reachable ({why}); check the DSNs and that the servers are up")
        return flushed, paused, down

    def _build(
        self, flushed: dict[tuple[str, str], int], paused: dict[tuple[str, str], str | None], down: set[str]
    ) -> None:
        queue_max = self.config.replication.queue_max_transactions
        self.recorders = {}
        self.clocks = ClockWatch(self.config)
        members = [n for n in self.config.nodes if n.name not in self.not_members]
        self.pruner = TombstonePruner(self.config, members, lambda: self.appliers, metrics=self.metrics,
                                      clock=self.clock)  # router.conflicts.pruning
        # [conflicts] keep: each node's conflict history and resolved quarantine (router.conflicts.history)
        self.history = HistoryPruner(self.config, members, self._counted, metrics=self.metrics)
        # origin name -> node: each source's echoes tell what it had applied (Transaction.seen)
        origins = origin_nodes(self.config.node_names, self.config.origin_name(""),
                               self.config.early_origin_name(""))
        for source_node in members:
            links: list[LinkProgress] = []
            queues: dict[str, LinkQueue] = {}
            log = self.logs.open(source_node.name, self._seen_of(source_node.name),
                                 self._sysids.get(source_node.name))
            stored = self.logs.stored(source_node.name)  # a node down now: where it was at the last tick
            k = self.config.synchronous(source_node.name)  # > 0: confirmed at each commit (.synchronous)
            confirm = CommitConfirm(self._on_applied_hook) if k else None
            encoder = Encoder()  # its transactions encoded once for all its links (router.apply.encode)
            for target_node in members:
                if target_node is source_node or source_node.receive_only:  # (router.cluster.receive)
                    continue
                key = (source_node.name, target_node.name)
                link = LinkProgress(source_node.name, target_node.name,
                                    flushed.get(key, stored.get(target_node.name, 0)))
                if target_node.name in down:
                    link.detach(0)  # its position is unknown until the node answers
                queue = LinkQueue(queue_max, self.config.replication.queue_max_mb << 20)
                target_clock = self.clocks.link(*key)
                applier = Applier(self.config, source_node.name, target_node, queue, link,
                                  on_applied=confirm.applied if confirm else self._on_applied_hook,
                                  clock=self.clock, target_clock=target_clock,
                                  quarantine=self._quarantine(target_node.name), encoder=encoder)
                target_clock.report_to(applier.condition)
                if key in paused:
                    applier.pause(paused[key] or "paused by the operator")
                links.append(link)
                queues[target_node.name] = queue
                self.appliers[key] = applier
            start = self._recorded.get(source_node.name)
            if start is None:  # never recorded (or the node is down): from where its links are
                start = min((link.flushed for link in links), default=0)
            recording = LinkProgress(source_node.name, source_node.name, start)
            recorder_queue = LinkQueue(queue_max, self.config.replication.queue_max_mb << 20)
            self.recorders[source_node.name] = TombstoneRecorder(
                self.config, source_node, recording, recorder_queue, confirm.recorded if confirm else None)
            progress = SourceProgress(source_node.name, links, recording, synchronous=k)
            self.logs.place(source_node.name, progress, down)
            self._lost += [(source_node.name, *x) for x in self.logs.lost(source_node.name, progress, down)]
            self._drift_targets.append(MonitorTarget(self.config, source_node))
            source = ReplicationSource(
                source_node.name, source_node.dsn, self.config.slot_name, [self.config.publication_name],
                options=msgspec.structs.replace(self.source_options, synchronous=k > 0), clock=self.clock,
                spool=self.spool,
                ceiling=self.pins.get(source_node.name),  # a joining node's pin (router.cluster.joining)
                start_lsn=progress.start_position(None if log is None else log.end),
            )
            if confirm is not None:
                confirm.progress, confirm.source = progress, source
                if log is not None:
                    confirm.watch_log(self.logs, source_node.name, log)
            self.progress[source_node.name] = progress
            self.pumps[source_node.name] = SourcePump(source, progress, queues, origins=origins,
                                                      recorder=recorder_queue, log=log,
                                                      log_hold_s=self.config.log.hold_s)
        self.drift = DriftWatch(
            {t.node.name: t.query for t in self._drift_targets}, publication=self.config.publication_name,
            slot=self.config.slot_name, on_change=self._drift_changed,
            synced=self._synced,
        )
        self.verify = None if self.config.verify is None else Verifier(  # its findings carry on
            self.config, members, self._synced, visible=self._visible, clock=self.clock, previous=self.verify)

    def _synced(self, node: str) -> int:
        """The position of `node` up to which every other node has flushed everything (drift's barrier)."""
        if node not in self.progress:
            return 1 << 62
        return self.pumps[node].source.idle_position(self.progress[node].synced())

    def _counted(self) -> dict[tuple[str, str], int | None]:
        """Each link's conflict_history id counted up to (router.conflicts.history keeps what is above)."""
        return {key: applier.link.history_at for key, applier in self.appliers.items()}

    def _visible(self, node: str) -> int:
        """The position of `node` up to which every other node has committed everything (verification's
        staggered snapshots: router.service.verify.verifier)."""
        if node not in self.progress:
            return 1 << 62
        progress = self.progress[node]
        committed = min((applied_through(link, progress.seen) for link in progress.links),
                        default=progress.seen)
        return self.pumps[node].source.idle_position(committed)

    def _quarantine(self, node: str) -> QuarantineIndex:
        """The pending quarantine keys of target `node`, shared by its appliers (a node that joined since
        the router started gets its own on the first wiring after the join)."""
        index = self.quarantines.get(node)
        if index is None:
            index = self.quarantines[node] = QuarantineIndex(node)
        return index

    def _seen_of(self, node: str) -> Callable[[], int]:
        return lambda: self.progress[node].seen

    def _drift_changed(self, drift: Mapping[str, TableDrift]) -> None:
        """Hold the links into and out of every node a replicated table differs on; run the others."""
        nodes = drifted_nodes(drift)
        for (source, target), applier in self.appliers.items():
            found = {item.table: item for item in [*nodes.get(source, ()), *nodes.get(target, ())]}
            if found:
                applier.add_hold(LinkHold.DRIFT, "; ".join(item.describe() for item in found.values()))
            else:
                applier.drop_hold(LinkHold.DRIFT)
