"""`pgmesh run`: the router. Owns every long-lived task, the progress tick and the ordered shutdown.

It builds its parts through `Wiring` (router.service.wiring: from the config and from what the nodes say,
one `ReplicationSource` + `SourcePump` per node and one `Applier` per link) and runs them all in one
`TaskGroup` on one event loop. A tick every `status_interval_ms` reads each target's flushed origin
positions, confirms each source's slot up to the least durable of its links (never further), and
re-attaches detached links by re-reading their source; a node with `synchronous` = k > 0 is confirmed
at each commit too, and only as far as k targets applied (router.service.synchronous). A hold (`POST
/hold`, a join) stops streaming until released, then builds everything again. Stopping (SIGTERM,
Ctrl-C) stops the sources first, then the appliers, then does a last shielded progress tick so the
slots are confirmed as far as the targets durably got.

Must not: build a part itself (router.service.wiring does), or move a link's state (the appliers do).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import psycopg

from protocol.lsn import format_lsn
from protocol.transactions import Transaction
from router.apply.applier import Applier
from router.apply.skip import parse_skip, record_skip
from router.cluster.joining import read_pins
from router.cluster.members import members_only
from router.config.model import Config
from router.errors import ConfigError, ConnectionLost, PgmeshError, describe
from router.service.admin import AdminServer
from router.service.lease import lease_for
from router.service.metrics import Metrics
from router.service.monitor import MonitorTarget
from router.service.report import Reporter
from router.service.status import LinkStatus, SourceStatus, StatusReport
from router.service.tasks import cancel_all, freeze_startup_objects
from router.service.wiring import Wiring
from router.stream.fanout import SourcePump
from router.stream.items import SourceOptions

__all__ = ["LinkStatus", "Router", "SourceStatus", "StatusReport"]

logger = logging.getLogger(__name__)

# How long a stopping router waits for each link's batch in hand to commit before cutting it short.
STOP_WAIT_S = 5.0
HOLD_MAX_S = 600.0  # a join holds for well under a second each time (docs/join.md)


class Router(Wiring):
    """The whole mesh in one process."""

    def __init__(
        self,
        config: Config,
        *,
        source_options: SourceOptions | None = None,
        clock: Callable[[], float] = time.time,
        on_applied: Callable[[Applier, Transaction], None] | None = None,
        metrics: Metrics | None = None,
        admin: bool = True,
        reload: Callable[[], Config] | None = None,
    ) -> None:
        super().__init__(config, source_options=source_options, clock=clock, on_applied=on_applied,
                         metrics=metrics)
        self.admin: AdminServer | None = None
        self._admin_enabled = admin
        self.stop_wait_s = STOP_WAIT_S
        self.hold_max_s = HOLD_MAX_S  # a hold nobody releases ends by itself after this long
        self.running = False
        self.started = asyncio.Event()
        # A hold (`pgmesh join` with the router running): stop streaming, keep the admin listener,
        # then re-read the config and start again on release.
        self._reload = reload
        self._hold = asyncio.Event()
        self._held = asyncio.Event()
        self._release = asyncio.Event()
        self.lease = lease_for(config)  # [ha]: standby routers (docs/ha.md)

    async def _stop_lost(self) -> None:
        """Stop every link a lost router log may have left short (router.service.logs), and record it as
        paused with the reason on its target (when it answers), so that a restart does not forget it."""
        timeout = self.config.replication.node_timeout_ms / 1000
        for source, target, position, why in self._lost:
            logger.error("%s", why)
            self.appliers[(source, target)].fail(PgmeshError(why, node=target, lsn=position))
            with contextlib.suppress(psycopg.Error, OSError, TimeoutError):
                async with asyncio.timeout(timeout):
                    await self.targets[target].set_paused(source, True, why)

    # ------------------------------------------------------------ running

    async def run(self, stop: asyncio.Event) -> None:
        """Run until `stop` is set; then shut down in order. A hold stops streaming until release."""
        self.spool.remove_stale()
        try:
            while True:
                if self.lease is not None:  # [ha]: a standby until it holds the lease (router.service.lease)
                    await self._start_admin()
                    if not await self.lease.acquire(stop):
                        break
                self.pins, joining = await read_pins(self.config)  # node -> slot pinned (cluster.joining)
                self.config = await members_only(self.config, self.targets, joining)  # (router.ops.part)
                flushed, paused, down = await self._load_state()
                self._lost = []
                self._build(flushed, paused, down)
                await self._stop_lost()
                self.running = True
                await self._start_admin()
                logger.info("%s", self._running_line(down))
                freeze_startup_objects()
                await self._stream(stop)
                self.spool.close()  # what was still queued is read again from the slots
                self.running = False
                if self.lease is not None and self.lease.lost.is_set() and not stop.is_set():
                    await self._start_over()  # lost the lease: a standby again
                    continue
                if stop.is_set() or not await self._wait_release(stop):
                    break
        finally:
            self.running = False
            self.spool.close()
            if self.lease is not None:  # every applier has stopped: a standby may take over at once
                await self.lease.give_up()
                await self.lease.close()
            if self.admin is not None:
                await self.admin.close()
            for target in [*self.targets.values(), *self._drift_targets]:
                await target.close()
            logger.info("cluster %s: router stopped", self.config.cluster.name)

    def _running_line(self, down: set[str]) -> str:
        """The start's one line: cluster, nodes (those down now), links, where the admin listener is."""
        nodes = ", ".join(n + (" (down)" if n in down else "") for n in self.pumps)
        admin = "no admin listener"
        if self.admin is not None:
            admin = f"admin on {self.admin.host}:{self.admin.port}" + (
                f" and {self.admin.unix}" if self.admin.unix else "")
        return (f"cluster {self.config.cluster.name}: router running: nodes {nodes}; {len(self.appliers)}"
                f" links; {admin}")

    async def _start_admin(self) -> None:
        if self._admin_enabled and self.admin is None:
            self.admin = AdminServer.for_router(  # [admin]: listen, socket, TLS, the token
                self.config, metrics=self.metrics, status=self.status, pause=self.pause,
                resume=self.resume, health=self.health, hold=self.hold, release=self.release,
                skip=self.skip,
            )
            await self.admin.start()

    async def _stream(self, stop: asyncio.Event) -> None:
        async with asyncio.TaskGroup() as group:
            applier_tasks = [
                group.create_task(a.run(), name=f"apply {a.name}") for a in self.appliers.values()
            ]
            pump_tasks = [
                group.create_task(self._pump_forever(p), name=f"source {p.node}")
                for p in self.pumps.values()
            ]
            ticker = group.create_task(self._tick_forever(), name="progress")
            logs = self.logs.run(group)
            drift = group.create_task(self.drift.run(), name="schema drift")
            clocks = group.create_task(self.clocks.run(), name="clocks")
            pruner = group.create_task(self.pruner.run(), name="tombstone pruning")
            verify = [group.create_task(self.verify.run(), name="verify")] if self.verify else []  # [verify]
            history = group.create_task(self.history.run(), name="history pruning")  # [conflicts] keep
            recorders = [group.create_task(r.run(), name=f"tombstones {r.node.name}")
                         for r in self.recorders.values()]
            self.started.set()
            waits = [asyncio.create_task(stop.wait()), asyncio.create_task(self._hold.wait())]
            if self.lease is not None:
                waits.append(asyncio.create_task(self.lease.lost.wait()))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waits:
                    waiter.cancel()
            await cancel_all([drift, clocks, pruner, history, *recorders],
                             "schema drift, clocks, tombstones and history")
            await cancel_all(verify, "verification")
            await self._shutdown(pump_tasks, [*applier_tasks, *logs], ticker)

    async def _wait_release(self, stop: asyncio.Event) -> bool:
        """Held: slots released, admin still up. On release, re-read the config and rebuild."""
        logger.info("cluster %s: held for `pgmesh join` or `part` (replication waits; writes go on) until"
                    " released, at most %.0f s", self.config.cluster.name, self.hold_max_s)
        since = time.monotonic()
        self._hold.clear()
        self._held.set()
        waits = [asyncio.create_task(stop.wait()), asyncio.create_task(self._release.wait())]
        try:
            done, _ = await asyncio.wait(waits, timeout=self.hold_max_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waits:
                waiter.cancel()
        if not done:  # whatever held it (a join) is gone: its pins still keep a joining node out
            logger.error("cluster %s: held for %.0f s and never released: streaming again",
                         self.config.cluster.name, self.hold_max_s)
        self._held.clear()
        self._release.clear()
        if stop.is_set():
            return False
        if done:
            logger.info("cluster %s: released after %.1f s; streaming again", self.config.cluster.name,
                        time.monotonic() - since)
        await self._start_over()
        return True

    async def _start_over(self) -> None:
        """After a hold or a lost lease: re-read the config, and build everything again from the nodes."""
        for target in [*self.targets.values(), *self._drift_targets]:
            await target.close()
        self._drift_targets = []
        if self._reload is not None:
            self.config = self._reload()
        self.targets = {n.name: MonitorTarget(self.config, n) for n in self.config.nodes}
        self.appliers, self.pumps, self.progress, self.reporter = {}, {}, {}, Reporter()

    async def hold(self, _target: str | None = None) -> list[str]:
        """Stop streaming (every slot is left idle and confirmed to what the targets flushed)."""
        if not self._held.is_set():
            self._hold.set()
            await asyncio.wait_for(self._held.wait(), 120)
        return ["held"]

    async def release(self, _target: str | None = None) -> list[str]:
        self._release.set()
        return ["released"]

    async def _shutdown(self, pumps: list[asyncio.Task[None]], appliers: list[asyncio.Task[None]],
                        ticker: asyncio.Task[None]) -> None:
        logger.info("cluster %s: stopping", self.config.cluster.name)
        await cancel_all(pumps, "sources")  # 1. stop reading the sources
        # 2. stop applying, each batch in hand committed first if it can be within `stop_wait_s` (what is
        # not committed is simply applied again after a restart)
        finishing = asyncio.gather(*(a.finish() for a in self.appliers.values()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(finishing, self.stop_wait_s)
        await cancel_all([*appliers, ticker], "appliers")
        for applier in self.appliers.values():
            await applier.close()
        # 3. the last word: confirm what the targets flushed, then close the sources
        await asyncio.shield(self._final_tick())
        left = sum(applier.pending for applier in self.appliers.values())
        logger.info("cluster %s: streaming stopped; slots confirmed to what the targets flushed (%s); %d"
                    " transaction(s) not applied yet are kept by the slots for the next start",
                    self.config.cluster.name, ", ".join(f"{node} {format_lsn(pump.source.confirmed_lsn)}"
                                                        for node, pump in self.pumps.items()), left)

    async def _final_tick(self) -> None:
        with contextlib.suppress(Exception):
            await self.tick(rewind=False)
        await self.logs.close()
        for pump in self.pumps.values():
            with contextlib.suppress(Exception):
                await pump.source.send_status()
            await pump.source.close()

    async def _pump_forever(self, pump: SourcePump) -> None:
        """A source that fails for good is reported and retried; the other nodes keep flowing."""
        while True:
            try:
                await pump.run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await pump.source.close()  # closed first: the state says "error" until the retry
                pump.source.mark_error(describe(exc), detail="retrying in 5 s")
                await asyncio.sleep(5.0)

    async def _tick_forever(self) -> None:
        interval = self.config.replication.status_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("progress tick failed")

    async def tick(self, *, rewind: bool = True) -> None:
        """Read flushed positions (every node at once, each within `node_timeout_ms`), confirm sources,
        re-attach detached links."""
        names = [name for name in self.targets if name not in self.not_members]
        answers = await asyncio.gather(*(self._progress_of(name) for name in names))
        for name, positions in zip(names, answers, strict=True):
            for source, lsn in positions.items():
                applier = self.appliers.get((source, name))
                if applier is not None:
                    applier.progress.on_flushed(lsn)
        ddl = sum(applier.stats.ddl_applied for applier in self.appliers.values())
        if ddl != self._ddl_seen:  # DDL replayed: do the nodes' replicated tables still agree?
            self._ddl_seen = ddl
            self.drift.poke()
        for node, progress in self.progress.items():
            pump = self.pumps[node]
            if self.targets[node].error is None:  # (it answered this tick's progress query)
                await self.logs.mark(node, self.targets[node], self.config.replication.node_timeout_ms / 1000)
            self.logs.upkeep(node, progress, {
                link.target for link in progress.links
                if self.targets[link.target].error is not None
                or not self.appliers[(node, link.target)].ready_for_more
            })
            pump.check_stalled()
            pump.source.confirm(progress.flush_position())  # (synchronous = k: also k targets applied)
            if rewind:
                ready = [
                    link for link in progress.links
                    if link.detached and self.appliers[(node, link.target)].ready_for_more
                    and self.targets[link.target].error is None  # answered this tick's progress query
                    and not len(pump.queues[link.target])
                ]
                if ready:
                    pump.rewind_for(ready)
        self.reporter.export(self)

    async def _progress_of(self, name: str) -> dict[str, int]:
        """`name`'s flushed origin positions; {} when it fails or does not answer in time. A node that does
        not answer, or that cannot be connected to (stopped, refusing connections), is taken for down: its
        links show "down" (router.service.report), /healthz names it, and its sessions are dropped
        (`_cut_off`), so that they reconnect once it answers, instead of waiting on a link that may never
        carry anything again (an idle session to a stopped node fails only when next used; TCP alone can
        take many minutes to give up on a node cut off)."""
        target = self.targets[name]
        timeout = self.config.replication.node_timeout_ms / 1000
        try:
            async with asyncio.timeout(timeout):
                positions = await target.probe()
        except (psycopg.Error, OSError, TimeoutError) as exc:
            silent = isinstance(exc, TimeoutError)
            unreachable = silent or isinstance(exc, OSError) or target.connection_lost
            target.error = (f"no answer to the router within {timeout:g} s" if silent
                            else f"not reachable: {describe(exc)}" if unreachable else describe(exc))
            target.drop()
            if unreachable and target.down_since is None:
                target.down_since = self.clock()
                self._cut_off(name, target.error)
            return {}
        target.error = None
        if target.down_since is not None:
            logger.info("node %s answers the router again", name)
            target.down_since = None
        if target.restarted:  # (between two ticks, unseen by them)
            target.restarted = False
            logger.warning("node %s restarted since the router last read it: its links connect again", name)
            self._reconnect_links(name, "the node restarted")
        try:  # what its slot keeps: shown, never a reason to take the node for down
            async with asyncio.timeout(timeout):
                await target.read_retained(self.config.slot_name)
        except (psycopg.Error, OSError, TimeoutError) as exc:
            logger.debug("node %s: retained WAL not read: %s", name, describe(exc))
            target.drop()
        return positions

    def _cut_off(self, name: str, why: str) -> None:
        """Drop every session the router has with node `name`: the appliers' into it and its source."""
        logger.warning("node %s: %s; its links are down until it answers", name, why)
        self._reconnect_links(name, why)
        pump = self.pumps.get(name)
        if pump is not None:
            pump.source.connection.abort(ConnectionLost(why, node=name))

    def _reconnect_links(self, name: str, why: str) -> None:
        """Every link into node `name` connects again now, idle or not: the node may have crashed and lost
        applied commits it had not flushed (the appliers commit with synchronous_commit off), which only a
        new connection finds out (router.progress.positions.LinkProgress.restart_at). An idle link would
        otherwise find out only at its next transaction, and show streaming meanwhile."""
        for (_, target), applier in self.appliers.items():
            if target == name:
                applier.reconnect(why)

    def health(self) -> tuple[bool, str]:
        return self.reporter.health(self)

    # ------------------------------------------------------------ control

    def _check_nodes(self, *names: str | None) -> None:
        """A pause / resume of a node not in the config: a LookupError (the admin listener's 404)."""
        try:
            for name in names:
                if name is not None:
                    self.config.node(name)
        except ConfigError as exc:
            raise LookupError(str(exc)) from exc

    async def pause(self, target: str | None, source: str | None = None) -> list[str]:
        return await self._set_paused(target, True, source)

    async def resume(self, target: str | None, source: str | None = None) -> list[str]:
        done = await self._set_paused(target, False, source)
        self.drift.poke()  # a link stopped on DDL may have been fixed by hand: do the tables agree?
        return done

    async def _set_paused(self, target: str | None, paused: bool, only_from: str | None) -> list[str]:
        """Pause or resume the links into `target` (all: None) from `only_from` (all: None) now, and record
        it on the target (within `node_timeout_ms`: a node cut off is told at the next pause or resume, the
        links move at once)."""
        self._check_nodes(target, only_from)
        done = []
        timeout = self.config.replication.node_timeout_ms / 1000
        for (source, tgt), applier in self.appliers.items():
            if target in (None, tgt) and only_from in (None, source):
                if paused:
                    applier.pause()
                else:
                    applier.resume()
                try:
                    async with asyncio.timeout(timeout):
                        await self.targets[tgt].set_paused(source, paused, None)
                except (psycopg.Error, OSError, TimeoutError) as exc:
                    self.targets[tgt].drop()
                    done.append(f"{applier.name} (not recorded on node {tgt}: {describe(exc) or 'no answer'};"
                                " a router restart would not remember it)")
                    continue
                done.append(applier.name)
        return done

    async def skip(self, source: str, target: str, lsn: str) -> str:
        """`pgmesh skip` (router.apply.skip): the link source -> target leaves out the transaction that
        ends at `lsn`, recorded on the target first; a refusal raises (the admin listener's 400)."""
        self._check_nodes(source, target)
        applier = self.appliers.get((source, target))
        if applier is None:
            raise LookupError(f"this router runs no link {source} -> {target}")
        at, limit = parse_skip(lsn), self.config.replication.node_timeout_ms / 1000
        query = self.targets[target].query
        text = await applier.skip(at, lambda: record_skip(query, source, at, target, limit))
        self.drift.poke()  # a DDL command left out may leave the schemas apart
        return text

    def conflicts_decided(self) -> int:
        return self.reporter.conflicts_decided(self)

    def status(self) -> StatusReport:
        return self.reporter.status(self)
