"""The router's log of every source (router.stream.log.store), as `pgmesh run` keeps them.

It opens each source's log at start (what an earlier run left is read back, a torn tail cut off) and
places the links: one whose target lacks transactions the log holds reads them from it (and so does one
into a node that is down, from the position saved at the last tick: `links` in the log's directory).
A log that was not left open starts at the source's start position. At every progress tick (`upkeep`,
before the source is confirmed) it gives the source's progress the log's `since` and durable position,
deletes the segments every link has flushed past, saves the links' positions, and, once a log that
stopped growing at its cap is no longer needed, deletes it and starts a new one.

A source's slot is confirmed past what its links' targets hold only on the log's account, so the log's
name (`log-id`) is recorded on the source node (`pgmesh.node_info`, key `router_log`) before that first
happens (`mark`): the source's log durable position counts only once the node holds the log's name. If
the node names a log that is not in the directory (lost or replaced), the slot may have been confirmed
past transactions that only that log held: every link out of the node whose target is behind the slot's
confirmed position is stopped with an error naming the node, the position and what to run (`lost`),
never silently skipped. With [ha] no slot is confirmed on a log's account (`_counts`), and the name is
recorded with HA_MARK after it: a standby that takes over with a log of its own finds such a name and
stops nothing (nothing was confirmed past what the targets hold).

Must not: decide what a link reads (router.stream.fanout), or confirm a slot (router.service.supervisor).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec
import psycopg

from protocol.lsn import format_lsn
from router.config.model import Config
from router.errors import PgmeshError
from router.progress.positions import SourceProgress
from router.service.monitor import MonitorTarget
from router.stream.log.store import SourceLog, write_durably
from router.stream.spool import Spool

__all__ = ["RouterLogs"]

logger = logging.getLogger(__name__)

_POSITIONS = "links"
SAVE_EVERY_S = 10.0
# Durable on the node itself, never waiting for its synchronous standbys (one that is gone must not hold
# the router's tick): the setting is local to this statement's transaction, its commit included.
_MARK_SQL = (
    "WITH here AS (SELECT pg_catalog.set_config('synchronous_commit', 'local', true))"
    " INSERT INTO pgmesh.node_info SELECT %s, %s FROM here"
    " ON CONFLICT (key) DO UPDATE SET value = excluded.value"
)
MARK_KEY = "router_log"  # pgmesh.node_info on each source node: the name of the log its slot counts on
HA_MARK = "/ha"  # after the name: the log of an [ha] router, on which no slot counted


class RouterLogs:
    """One `SourceLog` per source node, or none at all (`[log] enabled = false`)."""

    def __init__(self, config: Config, spool: Spool) -> None:
        self.config = config
        self.spool = spool
        self.logs: dict[str, SourceLog] = {}
        self._saved: dict[str, dict[str, int]] = {}
        self._saved_at: dict[str, float] = {}
        # per source: the log name the node holds, and its slot's confirmed position (read at start)
        self.marks: dict[str, str | None] = {}
        self.confirmed: dict[str, int] = {}
        self._unsure: set[str] = set()  # sources with a lost log and a target whose position is unknown
        # sources whose links' positions are being saved (in a thread), with the task doing it
        self._saving: dict[str, asyncio.Task[None]] = {}

    @property
    def enabled(self) -> bool:
        return self.config.log.enabled

    def open(self, node: str, position: Callable[[], int], system_id: str | None) -> SourceLog | None:
        """`node`'s log, read back from disk; `position`: where its fan-out has got to; `system_id`: the
        node's system identifier (None: unknown now, the node is down)."""
        if not self.enabled:
            return None
        section = self.config.log
        old = self.logs.pop(node, None)
        if old is not None:
            old.close()
        log = SourceLog(
            self.config.log_directory(node), node, identity=system_id,
            spool=self.spool, segment_bytes=section.segment_mb << 20, cap_bytes=section.cap_mb << 20,
            fsync_ms=section.fsync_ms, position=position,
            hold_bytes=self.config.replication.queue_max_mb << 20,
            hold_ticks=max(2, -(-section.hold_s * 1000 // self.config.replication.status_interval_ms)),
        )
        try:
            log.open()
        except OSError as exc:
            raise PgmeshError(f"cannot open the router log in {log.directory}: {exc}", node=node) from exc
        self.logs[node] = log
        return log

    def stored(self, node: str) -> dict[str, int]:
        """The positions of `node`'s links saved by the last tick of an earlier run (target -> LSN)."""
        log = self.logs.get(node)
        if log is None:
            return {}
        path = log.directory / _POSITIONS
        try:
            saved = msgspec.msgpack.decode(path.read_bytes(), type=dict[str, int])
        except (OSError, msgspec.DecodeError):
            return {}
        self._saved[node] = dict(saved)
        return saved

    def place(self, node: str, progress: SourceProgress, down: set[str]) -> None:
        """Links that must read the log read it; a log not left open starts where the source starts."""
        log = self.logs.get(node)
        if log is None:
            return
        if not log.active:
            log.activate(progress.start_position(), [link.target for link in progress.links])
        for link in progress.links:
            if log.covers(link.flushed, link.target) and (link.flushed < log.end or link.target in down):
                link.read_log(link.flushed)

    def lost(self, node: str, progress: SourceProgress, down: set[str]) -> list[tuple[str, int, str]]:
        """The links out of `node` that may lack transactions only a lost log held: (target, its position,
        what to say)."""
        log = self.logs.get(node)
        named = self.marks.get(node)
        if log is None or named is None or named == log.log_id or named.endswith(HA_MARK):
            return []
        confirmed = self.confirmed.get(node, 0)
        out = []
        for link in progress.links:
            if link.target in down:
                self._unsure.add(node)
                why = "its position is unknown (the node is down)"
            elif link.flushed < confirmed:
                why = f"it has everything up to {format_lsn(link.flushed)} only"
            else:
                continue
            out.append((link.target, link.flushed, (
                f"link {node} -> {link.target}: {node}'s slot is confirmed to {format_lsn(confirmed)} on the"
                f" account of the router log {named}, which is not in {log.directory} (lost or replaced), and"
                f" {why}: transactions of {node} may be missing on {link.target}. Compare the nodes"
                f" (`pgmesh compare`) and repair what differs, then `pgmesh resume {link.target}`"
            )))
        return out

    async def mark(self, node: str, target: MonitorTarget, limit_s: float) -> None:
        """Record the log's name on `node` if it does not hold it yet (before its slot counts on it), once
        the log holds anything: while every link keeps up nothing is written (no fsync, no write on the
        node), and the slot counts on the links alone."""
        log = self.logs.get(node)
        if log is None or not log.holds_anything or node in self._unsure:
            return
        name = log.log_id + HA_MARK if self.config.ha.enabled else log.log_id
        if self.marks.get(node) == name:
            return
        if not log.settled:
            try:
                await log.sync()  # its identity and name durable before the node names it
            except OSError as exc:
                logger.warning("node %s: cannot make the router log's files durable: %s", node, exc)
                return
        try:
            async with asyncio.timeout(limit_s):
                await target.query(_MARK_SQL, [MARK_KEY, name])
        except (psycopg.Error, OSError, TimeoutError) as exc:
            logger.debug("node %s: router log name not recorded yet: %s", node, exc)
            target.drop()
            return
        self.marks[node] = name

    def upkeep(self, node: str, progress: SourceProgress, stopped: set[str]) -> None:
        """At each tick, before the source is confirmed; `stopped`: the targets that apply nothing now
        (down, paused, held)."""
        log = self.logs.get(node)
        if log is None:
            return
        if log.active and progress.links:
            low = min(link.flushed for link in progress.links)
            log.forget(low, behind=any(
                link.target in stopped or link.log_from is not None or link.detached or link.has_until
                for link in progress.links
            ))
            log.idle()
            log.truncate_before(low)
            idle = not progress.logging() and not any(link.has_until for link in progress.links)
            if not log.appending and idle and low >= log.end:
                log.reset()  # it reached its cap and nobody needs it any more: a new one starts here
                log.activate(progress.seen, [link.target for link in progress.links])
            if log.holds_anything:  # (else a node down at the next start has nothing to read from it)
                self._save(node, log, {link.target: int(link.flushed) for link in progress.links})
        else:
            log.idle()
        counts = self._counts(node, log)
        progress.log_since, progress.log_durable = (log.since, log.durable) if counts else (None, 0)
        progress.log_targets = log.targets

    def durable(self, node: str, progress: SourceProgress) -> None:
        """Between ticks, `node`'s log made more durable (a synchronous source's: docs/synchronous.md): it
        counts at once, as `upkeep` would count it, if the node holds the log's name."""
        log = self.logs.get(node)
        if log is not None and self._counts(node, log):
            progress.log_since, progress.log_durable = log.since, log.durable

    def _counts(self, node: str, log: SourceLog) -> bool:
        """Whether `node`'s slot may be confirmed on the strength of its log: the node holds the log's name
        (see `mark`), and no standby router may take over ([ha]: the log is on this router's disk only,
        and a standby would not have it; docs/ha.md)."""
        return self.marks.get(node) == log.log_id and not self.config.ha.enabled

    def _save(self, node: str, log: SourceLog, positions: dict[str, int]) -> None:
        """Every `SAVE_EVERY_S` at most (two fsyncs, in a thread: never on the event loop, which a slow
        disk would stall): a position saved a little low only makes a node that is down at the next start
        read a little more of the log, and skip what it already has."""
        now = time.monotonic()
        if (self._saved.get(node) == positions or now - self._saved_at.get(node, -SAVE_EVERY_S) < SAVE_EVERY_S
                or node in self._saving):
            return
        self._saved_at[node] = now
        data = msgspec.msgpack.encode(positions)
        path = log.directory / _POSITIONS
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(write_durably, path, data))
        self._saving[node] = task

        def done(task: asyncio.Task[None]) -> None:
            self._saving.pop(node, None)
            exc = None if task.cancelled() else task.exception()
            if exc is not None:
                logger.warning("node %s: cannot save the links' positions in %s: %s", node, path.parent, exc)
            elif not task.cancelled():
                self._saved[node] = positions

        task.add_done_callback(done)

    def run(self, group: asyncio.TaskGroup) -> list[asyncio.Task[None]]:
        """Start every log's group fsync in `group`."""
        return [group.create_task(log.run(), name=f"router log {node}") for node, log in self.logs.items()]

    async def close(self) -> None:
        """Make what was appended durable, and close (and forget: the next build opens its sources' logs
        again, and a node left out meanwhile, parted, has none)."""
        await asyncio.gather(*self._saving.values(), return_exceptions=True)
        for log in self.logs.values():
            with contextlib.suppress(OSError):
                await log.sync()
            log.close()
        self.logs.clear()
