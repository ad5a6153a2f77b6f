"""The queue of one link (source -> target): whole transactions from the fan-out to the applier.

The fan-out (`router.stream.fanout.SourcePump`) `offer`s each committed transaction to the queue of every
attached link; `offer` never blocks, and a full queue says no (the fan-out then detaches the link or
waits). The link's applier (`router.apply.applier.Applier`) `get`s them in commit order, `take`s what is
already queued to batch it, `peek`s at what comes next to build its scripts ahead, and puts back
(`push_front`) what it took too early. Beside the queue, one slot holds a streamed transaction
announced before its commit (`router.stream.items.EarlyStream`) for the applier's side session
(`router.apply.side`). A transaction spilled to disk is held by one reference to its file, released by
whoever takes it, or by `clear()`.

Must not: read the source, talk to a database, or decide what is applied.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from collections.abc import Iterator

from protocol.transactions import Transaction
from router.stream.items import EarlyStream
from router.stream.spool import let_go

__all__ = ["LinkQueue"]


class LinkQueue:
    """A bounded FIFO of transactions for one link. `offer` never blocks the fan-out.

    Beside it, one slot for a streamed transaction announced before its commit (`offer_side`,
    `get_side`): it holds one reference to its spill file, released by whoever takes it. `cleared`
    counts `clear()`s (the link detached or restarted: what was announced may never come here).
    """

    __slots__ = ("_bytes", "_interrupt", "_items", "_nonempty", "_room", "_side", "_side_ready", "cleared",
                 "max_bytes", "maxlen")

    def __init__(self, maxlen: int, max_bytes: int = 1 << 62) -> None:
        """At most `maxlen` transactions and `max_bytes` of their payload in memory (`Transaction.nbytes`:
        a spilled transaction counts its in-memory tail), one transaction always fits."""
        self.maxlen = maxlen
        self.max_bytes = max_bytes
        self._bytes = 0
        self._items: collections.deque[Transaction] = collections.deque()
        self._nonempty = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._side: EarlyStream | None = None
        self._side_ready = asyncio.Event()
        self.cleared = 0
        self._interrupt: BaseException | None = None

    def __len__(self) -> int:
        return len(self._items)

    def offer(self, txn: Transaction) -> bool:
        if len(self._items) >= self.maxlen or (self._items and self._bytes + txn.nbytes > self.max_bytes):
            self._room.clear()
            return False
        self._items.append(txn)
        self._bytes += txn.nbytes
        self._nonempty.set()
        return True

    async def get(self) -> Transaction:
        """The next transaction, once there is one; raises what `interrupt` was given when the queue is
        (or becomes) empty meanwhile."""
        while not self._items:
            if self._interrupt is not None:
                exc, self._interrupt = self._interrupt, None
                raise exc
            self._nonempty.clear()
            await self._nonempty.wait()
        txn = self._items.popleft()
        self._bytes -= txn.nbytes
        if not self.full:
            self._room.set()
        return txn

    def interrupt(self, exc: BaseException) -> None:
        """Make the consumer's next wait on an empty queue (or the one in progress) raise `exc`, once: an idle
        link whose sessions were dropped connects again now, instead of at its next transaction (its target
        may have lost commits it had not flushed, which only a new connection finds out)."""
        self._interrupt = exc
        self._nonempty.set()

    def forget_interrupt(self) -> None:
        """The consumer connected again: an `interrupt` not raised yet is moot."""
        self._interrupt = None

    def push_front(self, txn: Transaction) -> None:
        """Put back a transaction taken too early (may exceed maxlen briefly; the fan-out sees full)."""
        self._items.appendleft(txn)
        self._bytes += txn.nbytes
        self._nonempty.set()

    def peek(self, limit: int) -> Iterator[Transaction]:
        """The first `limit` queued transactions, left in the queue."""
        return itertools.islice(self._items, limit)

    def take(self, limit: int) -> list[Transaction]:
        """Up to `limit` queued transactions, without waiting."""
        out: list[Transaction] = []
        while self._items and len(out) < limit:
            txn = self._items.popleft()
            self._bytes -= txn.nbytes
            out.append(txn)
        if not self.full:
            self._room.set()
        return out

    async def wait_room(self) -> None:
        await self._room.wait()

    def wake(self) -> None:
        """Wake whoever waits for room (to look at the link again: router.stream.fanout's stall check)."""
        self._room.set()

    @property
    def full(self) -> bool:
        return len(self._items) >= self.maxlen or self._bytes >= self.max_bytes

    def clear(self) -> None:
        for txn in self._items:
            let_go(txn)  # a transaction spilled to disk: this link no longer needs its file
        self._items.clear()
        self._bytes = 0
        self._room.set()
        self.drop_side()
        self.cleared += 1
        self._side_ready.set()  # wakes the applier's side watch: what it started may never come

    def offer_side(self, item: EarlyStream) -> None:
        """Announce a streamed transaction in progress (the caller acquired its file for this link).
        One waits here at most (the applier takes one at a time): a link that is down keeps no file."""
        if self._side is not None:
            item.spill.drop_ref()
            return
        self._side = item
        self._side_ready.set()

    async def get_side(self, wait_s: float) -> EarlyStream | None:
        """The announcement waiting, or None after `wait_s` seconds (or a `clear()`) without one."""
        if self._side is None:
            self._side_ready.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._side_ready.wait()
        item, self._side = self._side, None
        return item

    def drop_side(self) -> None:
        item, self._side = self._side, None
        if item is not None:
            item.spill.drop_ref()

    def oldest_commit_time(self) -> int | None:
        return self._items[0].commit_time if self._items else None

