"""The fan-out of one source: echo filter, the router's log, per-link bounded queues, log readers.

A `SourcePump` reads its node's `ReplicationSource` and hands every committed transaction, in commit
order, to the queue of each link out of that node. A transaction that carries a replication origin was
applied here by pgmesh (or another replicator): it is an echo and goes nowhere. Every other one that a
target needs is first appended to the source's log (router.stream.log.store), before any link may wait. A link
whose queue is full reads the log instead (a feeder task fills its queue from the log, and hands it back
to the fan-out once it read to the end) when other links can still take more (a slow or dead target must
not stall the others) or when it applied nothing for `log_hold_s` (`check_stalled`, at every tick);
until then, when every link is full, the pump waits (backpressure reaches the walsender). Without a log,
or with the log at its cap, such a link is detached instead and later re-reads the source from its
applied position; links that already have those transactions skip them.
A transaction that spilled to disk carries a `SpillFile`: each link
it is queued for holds one reference and its applier releases it; one nobody takes is deleted here.
A streamed transaction announced before its commit (`EarlyStream`) goes to the side channel of every
attached link (`LinkQueue.offer_side`, one reference each); its commit is handed out as any other.
The source's own committed transactions that delete also go, in commit order, to the queue of its tombstone
recorder (router.apply.recorder; backpressure when it is full, never a detach). Every echo also updates
the source's `SeenVersions` (router.stream.seen), and every transaction handed
out (announced, handed out at its first spill, or whole) carries its vector as it stood then
(`Transaction.seen`, set in place: one shared tuple, no copy of the transaction).
Owns no database connection and no clock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from msgspec.structs import force_setattr

from protocol.lsn import format_lsn
from protocol.messages import Delete, Insert, Message, Truncate, Update
from protocol.transactions import Transaction
from router.progress.positions import LinkProgress, SourceProgress
from router.stream.items import DDL_PREFIX, EarlyStream
from router.stream.linkqueue import LinkQueue
from router.stream.log.store import SourceLog
from router.stream.seen import APPLIED_PREFIX, SeenVersions
from router.stream.source import ReplicationSource
from router.stream.spool import SpillFile, let_go

__all__ = ["SourcePump"]

_DATA_CHANGES = (Insert, Update, Delete, Truncate)

logger = logging.getLogger(__name__)


class SourcePump:
    """Reads one source and feeds its links' queues; counts into the source's `stats`."""

    def __init__(
        self,
        source: ReplicationSource,
        progress: SourceProgress,
        queues: dict[str, LinkQueue],
        *,
        on_echo: Callable[[Transaction], None] | None = None,
        origins: Mapping[str, str] | None = None,
        recorder: LinkQueue | None = None,
        log: SourceLog | None = None,
        log_hold_s: float = 10.0,
    ) -> None:
        """`origins`: replication origin name -> node name (router.stream.seen.origin_nodes), for
        the vector of what this source had applied from each node; without it, every `seen` stays ().
        `log`: the source's log (router.stream.log.store); every transaction a target needs is appended to it
        while it grows, and a link whose queue is full reads from it instead of detaching (when another
        link needs the stream to move on, or when it applied nothing for `log_hold_s` seconds)."""
        self.source = source
        self.stats = source.stats
        self.progress = progress
        self.queues = queues  # target node -> queue
        # The queue of the source's tombstone recorder (progress.recorder): the source's own committed
        # transactions with deletes, in commit order, never detached (it waits for room instead)
        self.recorder = recorder
        self._on_echo = on_echo
        self.seen = SeenVersions(origins or {}, own=source.node)
        self._reattach: list[LinkProgress] = []
        # Per target: the transaction last handed out before its commit (its spill file) and where the
        # link's `enqueued` stood before it. If the source loses it before the commit, the link must
        # take it again when it is resent.
        self._early: dict[str, tuple[SpillFile, int]] = {}
        self.log = log
        self.log_hold_s = log_hold_s
        self._feeders: dict[str, asyncio.Task[None]] = {}  # target -> the task feeding it from the log
        # The link `_hand` waits on now (its applied position then, since when), and one found stalled
        self._waiting: tuple[LinkProgress, int, float] | None = None
        self._stalled: LinkProgress | None = None

    @property
    def node(self) -> str:
        return self.source.node

    async def run(self) -> None:
        for link in self.progress.logging():  # (from an earlier run's log: router.service.supervisor)
            self._feed(link)
        items = self.source.stream()
        try:
            async for item in items:
                if self._reattach:
                    for link in self._reattach:
                        link.reattach(self.progress.seen)
                    self._reattach = []
                if isinstance(item, Message):  # non-transactional: nothing to apply
                    if item.prefix == APPLIED_PREFIX:  # what an applier committed here (no echoes)
                        self.stats.applied_notes += 1
                        self.seen.note_applied(item.lsn, item.content, self.source.confirmed_lsn)
                    # passed, as an echo is: else a node whose stream ends with such a note (16+: after
                    # every applied batch) never has its slot confirmed past it (WAL kept, barriers hang)
                    self.progress.on_seen(item.lsn)
                    continue
                if isinstance(item, EarlyStream):
                    self._announce(item)
                    continue
                await self._dispatch(item)
                await asyncio.sleep(0)  # let the appliers start while a backlog is still being read
        finally:
            for task in list(self._feeders.values()):
                task.cancel()
            await items.aclose()

    def _announce(self, item: EarlyStream) -> None:
        """A streamed transaction in progress: the appliers of attached links may start on it."""
        if self.seen.snapshot:
            force_setattr(item.txn, "seen", self.seen.snapshot)  # made for this announcement alone
        for link in self.progress.links:
            if link.receiving:
                item.spill.acquire()  # released by the applier (or the queue) that got it
                self.queues[link.target].offer_side(item)

    async def _dispatch(self, txn: Transaction) -> None:
        spill = txn.spill
        try:
            await self._dispatch_one(txn)
        finally:
            if spill is not None and spill.pinned:
                spill.pinned = False
                spill.drop_ref()  # the source's, held from the announcement to this hand-out

    async def _dispatch_one(self, txn: Transaction) -> None:
        if self.recorder is not None and txn.origin is None:  # an echo is not the source's own
            await self._to_recorder(txn)
        spill = txn.spill
        if spill is not None and spill.early and spill.final is txn:
            # The commit of a transaction handed out at its first spill: the links that took it then
            # have it whole now (their appliers were waiting for this); nothing more to hand out. No echo
            # came between its first spill and its commit: its vector is the one it was handed out with.
            if self.seen.snapshot:
                force_setattr(txn, "seen", self.seen.snapshot)
            self._append(txn)
            late = []
            for link in self.progress.links:
                if link.target in spill.handed:
                    link.enqueued = max(link.enqueued, txn.end_lsn)
                    if self._early.get(link.target, (None, 0))[0] is spill:
                        del self._early[link.target]
                elif link.wants(txn.end_lsn):
                    late.append(link)  # it read the log when this was handed out, and caught up since
            for link in late:
                spill.acquire()  # this link's applier releases it
                if not await self._hand(link, txn):
                    spill.drop_ref()
            self.progress.on_seen(txn.end_lsn)
            return
        if spill is not None:
            spill.acquire()  # the pump's own reference while it hands the transaction out
        try:
            await self._dispatch_to_links(txn)
        finally:
            if spill is not None:
                spill.drop_ref()  # the last one when no link took it: the file goes
        if spill is not None and spill.early:
            return  # handed out before its commit: seen when the commit comes (above)
        self.progress.on_seen(txn.end_lsn)

    async def _to_recorder(self, txn: Transaction) -> None:
        """Hand a committed transaction of the source's own that deletes (or changes a key, or truncates) to
        its tombstone recorder."""
        link = self.progress.recorder
        if self.recorder is None or link is None or not link.wants(txn.end_lsn):  # (an echo: not called)
            return
        if txn.spill is not None and txn.spill.early and txn.spill.final is not txn:
            return  # handed out before its commit: the recorder takes it at the commit
        if not txn.spilled:
            for c in txn.changes:  # (a loop: most have one change, and a generator costs more than it)
                if isinstance(c, (Delete, Truncate)) or (isinstance(c, Update) and c.old is not None):
                    break
            else:
                return  # neither deletes, truncates nor takes a key away (a key update sends the old key)
        if txn.spill is not None:
            txn.spill.acquire()  # the recorder releases it
        while not self.recorder.offer(txn):
            await self.recorder.wait_room()
        link.enqueued = txn.end_lsn

    async def _dispatch_to_links(self, txn: Transaction) -> None:
        if txn.origin is not None:
            self.stats.echoes += 1
            self.seen.note(txn, self.source.confirmed_lsn)
            if self._on_echo is not None:
                self._on_echo(txn)
        elif not (txn.spilled or any(isinstance(c, _DATA_CHANGES) for c in txn.changes)
                  or DDL_PREFIX in txn.prefixes):
            pass  # nothing a target needs (a transactional message, a schema description only)
        else:
            self.stats.transactions += 1
            seen = self.seen.snapshot
            if seen:
                force_setattr(txn, "seen", seen)  # fresh from the source (or its spill file's `final`)
            if not (txn.spill is not None and txn.spill.early):  # (one handed out early: at its commit)
                # In the log before any link may wait for room: a link reading the log that catches up
                # meanwhile must find it there (it is handed to no queue while it reads the log)
                self._append(txn, needed=True)
            for link in self.progress.links:
                early = self._early.get(link.target)
                if early is not None and early[0].abandoned:
                    # lost before its commit (the source reconnected): what comes now may be it again
                    link.enqueued = min(link.enqueued, early[1])
                    del self._early[link.target]
                before = link.enqueued
                if link.wants(txn.end_lsn):
                    if txn.spill is not None:
                        txn.spill.acquire()  # this link's applier releases it
                    if not await self._hand(link, txn):
                        let_go(txn)
                    elif txn.spill is not None:
                        txn.spill.handed.add(link.target)
                        if txn.spill.early:
                            self._early[link.target] = (txn.spill, before)

    async def _hand(self, link: LinkProgress, txn: Transaction) -> bool:
        """Queue `txn` for `link`; False when it was not queued (the link detached, reads the log now, or
        no longer wants it)."""
        queue = self.queues[link.target]
        while not queue.offer(txn):
            others = self._others_want_and_can_take(link, txn)
            if self._log_can_take(link) and (others or self._stalled is link):
                self._stalled = self._waiting = None
                link.read_log(link.enqueued)
                self._feed(link)
                logger.info("link %s -> %s: queue full at %s; it reads the router log from there",
                            link.source, link.target, format_lsn(link.enqueued))
                return False
            if others:
                link.detach(self.progress.seen)
                queue.clear()  # releases the spill files of what it held
                logger.warning(
                    "link %s -> %s: queue full at %s; detached, it will re-read from %s",
                    link.source, link.target, format_lsn(txn.end_lsn), format_lsn(link.applied),
                )
                return False
            # every link is behind: let backpressure reach the source (`check_stalled`, at every progress
            # tick, wakes this when the link applied nothing for log_hold_s: it goes to the log)
            if self._waiting is None or self._waiting[0] is not link:
                self._waiting = (link, link.applied, time.monotonic())
            await queue.wait_room()
            if not link.wants(txn.end_lsn):
                self._waiting = None
                return False
        self._waiting = self._stalled = None
        link.enqueued = txn.end_lsn
        return True

    def check_stalled(self) -> None:
        """Called at every progress tick: a link this pump has been waiting on that applied nothing for
        `log_hold_s` goes to the log (the waiter is woken to look again)."""
        waiting = self._waiting
        if waiting is None:
            return
        link, applied, since = waiting
        now = time.monotonic()
        if link.applied != applied:
            self._waiting = (link, link.applied, now)
        elif now - since >= self.log_hold_s and self._log_can_take(link):
            self._stalled = link
            self.queues[link.target].wake()

    def _others_want_and_can_take(self, link: LinkProgress, txn: Transaction) -> bool:
        """Would waiting for this link hold back another link that needs this transaction now?

        While a link re-reads what it missed, nobody else wants those transactions: it is simply
        backpressure. Only a link that stalls another detaches (or reads the log). A link reading the log
        takes nothing from the stream: it needs nothing of it now.
        """
        return any(
            other is not link
            and other.receiving
            and other.log_from is None
            and other.enqueued <= txn.end_lsn  # it has (or wants) this one: it needs the stream to move
            and not self.queues[other.target].full
            for other in self.progress.links
        )

    def rewind_for(self, links: list[LinkProgress]) -> int | None:
        """Give these detached links what they missed: from the log when it holds it, else by re-reading
        the source; returns the position re-read from (None: no re-read)."""
        log = self.log
        rest = []
        for link in links:
            after = link.resume_position()
            if log is not None and log.covers(after, link.target) and (log.appending or after < log.end):
                link.read_log(after)
                self._feed(link)
                logger.info("link %s -> %s: reads the router log from %s", link.source, link.target,
                            format_lsn(after))
            else:
                rest.append(link)
        links = rest
        if not links:
            return None
        position = max(min(link.resume_position() for link in links), self.source.confirmed_lsn)
        self.source.rewind(position)
        self.seen.rewind(position)
        self._reattach.extend(links)
        logger.info("node %s: re-reading from %s for %s", self.node, format_lsn(position),
                    ", ".join(link.target for link in links))
        return position

    # ------------------------------------------------------------ the log

    def _append(self, txn: Transaction, *, needed: bool = False) -> None:
        """Append a committed transaction a target may need to the log, while it grows (`needed`: the
        caller knows a target needs it)."""
        log = self.log
        if log is None or not log.appending or txn.end_lsn <= log.end:
            return
        if not needed and not (txn.spilled or any(isinstance(c, _DATA_CHANGES) for c in txn.changes)
                               or DDL_PREFIX in txn.prefixes):
            return
        if log.full:
            log.stop_appending(self.progress.seen)
            logger.warning(
                "node %s: the router log reached its cap (%d MB); from %s on, links that fall behind"
                " re-read the source and its slot keeps the WAL", self.node, log.cap_bytes >> 20,
                format_lsn(log.end),
            )
            return
        log.append(txn)

    def _log_can_take(self, link: LinkProgress) -> bool:
        log = self.log
        return (log is not None and log.appending and not log.full and link.missed_until is None
                and log.covers(link.enqueued, link.target))

    def _feed(self, link: LinkProgress) -> None:
        """Start (or restart) the task that hands `link` what the log holds after `link.log_from`."""
        old = self._feeders.pop(link.target, None)
        if old is not None:
            old.cancel()
        self._feeders[link.target] = asyncio.create_task(
            self._feed_link(link), name=f"log feeder {link.source} -> {link.target}"
        )

    async def _feed_link(self, link: LinkProgress) -> None:
        log = self.log
        after = link.log_from
        if log is None or after is None:
            return
        reader = log.reader(after)
        queue = self.queues[link.target]
        try:
            while link.log_from is not None:
                txn = reader.next()
                if txn is None:  # read to the end: nothing awaited since, so nothing appended since
                    if log.appending:
                        link.caught_up(reader.after)
                        logger.info("link %s -> %s: caught up with the router log at %s", link.source,
                                    link.target, format_lsn(reader.after))
                    else:
                        link.log_ended(max(reader.after, log.end), self.progress.seen)
                    return
                while not queue.offer(txn):
                    await queue.wait_room()
                    # the link restarted meanwhile (router.progress.positions.restart_at)
                    if link.log_from is None:
                        let_go(txn)
                        return
                link.log_from = txn.end_lsn  # a feeder started again (the pump restarts) goes on from here
                await asyncio.sleep(0)
        finally:
            reader.close()
            if self._feeders.get(link.target) is asyncio.current_task():
                del self._feeders[link.target]
