"""One applier per link (source -> target): applies the source's transactions to the target, exactly once.

Each source transaction becomes one target transaction (see `router.apply.scripts`), run in a session that
has `session_replication_role = replica` (user and FK triggers do not fire), `synchronous_commit = off`
(as the native apply worker) and the source's replication origin set up, and every transaction calls
`pg_replication_origin_xact_setup(end LSN, commit time)`: the row carries the source's origin and
commit time, and the origin's progress moves atomically with the data. On every (re)connect the
applier reads that progress and skips what the target already has: nothing twice, nothing skipped.

Deadlocks, serialization failures, lock timeouts and lost connections are retried with backoff
(`router.errors.decide_link` says which); any other error pauses this link only, with node, table and
LSN, until `resume()`. The applier never reads the source and never confirms anything to it: the
router's progress tick reads the flushed origin positions and confirms the source.

The applier owns the loop and its control state (the transactions in hand, the batch size, the link's
state); its helpers get the link's `LinkSession` (router.apply.link: the target session and its view of
the target), never the applier, and what they decide for the loop comes back as a return value:
`router.apply.large` (a transaction too big for a batch, in parts), `router.apply.lanes` (parallel
apply), `router.apply.side` (a streamed transaction applied on a side session before its commit) and
`router.apply.careful.transaction` (row by row, with conflicts). Its state and counters: `router.apply.state`.
Beside it: `router.stream.linkqueue` (the queue it reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable

import asyncpg

from protocol.lsn import format_lsn, pg_us_to_datetime
from protocol.transactions import Transaction
from router.apply.careful.transaction import CarefulApplier
from router.apply.clock import LinkClockView, NoClock
from router.apply.encode import Encoder
from router.apply.lanes import Lanes
from router.apply.large import LargeApply
from router.apply.link import LinkSession
from router.apply.parts import is_large, whole_transaction
from router.apply.quarantine import Guard, QuarantineIndex
from router.apply.sender import Sender
from router.apply.side import SideSession
from router.apply.skip import check_skip, drop_skip, due, read_skip, skip_transaction
from router.apply.state import RUNNING, LinkCondition, LinkHold, LinkState, LinkStats, LinkView, Liveness
from router.config.model import Config, NodeConfig
from router.ddl.capture import SCHEMA_CHANGES
from router.ddl.messages import has_ddl
from router.errors import (
    SCHEMA_WAIT_S,
    UNIQUE_ATTEMPTS,
    Action,
    ConnectionLost,
    LostBeforeCommit,
    PgmeshError,
    SchemaWait,
    decide_link,
    decision_function_lost,
    describe,
    is_conflict,
    is_refused,
    remote_version_missing,
    retry_unique,
    tables_changed,
)
from router.progress.positions import LinkProgress
from router.stream.linkqueue import LinkQueue
from router.stream.spool import let_go, materialize

__all__ = ["Applier"]

# Transactions sent to the target in one round trip: each stays its own target transaction (its own
# BEGIN, origin setup and COMMIT), so every row keeps its source commit time; only the trips are shared.
BATCH_TRANSACTIONS = 256

logger = logging.getLogger(__name__)

_STOPS = frozenset({LinkHold.PAUSE, LinkHold.DRIFT})  # holds that stop the loop (clock skew waits in it)


class Applier(LinkView):
    """Applies one source's transactions to one target, in order, exactly once."""

    def __init__(
        self,
        config: Config,
        source: str,
        target: NodeConfig,
        queue: LinkQueue,
        progress: LinkProgress,
        *,
        on_applied: Callable[[Applier, Transaction], None] | None = None,
        clock: Callable[[], float] = time.time,
        target_clock: LinkClockView | None = None,
        quarantine: QuarantineIndex | None = None,
        encoder: Encoder | None = None,
    ) -> None:
        self.config = config
        self.source = source
        self.target = target
        self.stats = LinkStats()
        self.link = LinkSession(config, source, target, self.stats)
        self.condition = LinkCondition(self.link.name)
        self._careful = CarefulApplier(config, source, target.name, {})
        self._careful.read_source = self.link.read_source  # unchanged TOAST values (router.apply.toast)
        # the target's pending quarantine keys, shared by its appliers (router.apply.quarantine)
        self.quarantine = quarantine if quarantine is not None else QuarantineIndex(target.name)
        self._quarantines = config.quarantines()  # some table sets refused changes aside
        # the source's transactions encoded once for all its links (router.apply.encode), sent by the pipe
        self.encoder = encoder if encoder is not None else Encoder()
        self.queue = queue
        self.progress = progress
        self.apply_delay = config.replication.apply_delay_ms / 1000.0
        self._clock = clock
        # the target's clock offset from the router's, and the clock-skew hold (router.service.clocks)
        self._target_clock: LinkClockView = target_clock if target_clock is not None else NoClock()
        self._on_applied = on_applied
        self._schema = SchemaWait()  # since when a missing table / column is awaited
        self.schema_wait = SCHEMA_WAIT_S
        self._reloaded_for = -1  # the transaction that last made us re-read the target's tables
        self._schema_changes = -1  # the target's count of DDL commands when the careful path last looked
        self._in_hand: list[Transaction] = []  # taken from the queue, not yet known to be applied
        # the last failure came from `_in_hand[0]` alone (not from several sent in one round trip, where the
        # error does not say which one failed): only then may an error name it for `pgmesh skip`
        self._alone = True
        # Transactions per round trip: halved after a conflict (the rest of a batch is sent again),
        # doubled after a clean batch, up to BATCH_TRANSACTIONS.
        self._batch_limit = BATCH_TRANSACTIONS
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._between = asyncio.Event()  # no batch in the target's hands (`finish`)
        self._between.set()
        self._reread = False  # out of a schema drift hold: the target's tables may have been fixed by hand
        self.skip_lsn: int | None = None  # `pgmesh skip`: the transaction that ends there is left out
        self._large = LargeApply(self.link, self.link.run_ddl)
        # Parallel apply (router.apply.lanes): sessions besides the main one; the main session holds the
        # source's replication origin except while lanes run (then each takes it just to commit).
        self.lanes = max(1, config.replication.apply_lanes)
        self._parallel = Lanes(self.link, self.lanes)
        # Streamed transactions applied before their commit on a side session (router.apply.side).
        self._side = SideSession(self.link, self._large, queue, progress, self._resumed)
        # a batch's way to the target: the pipe, or scripts (router.apply.sender)
        self._sender = Sender(self.link, queue, self.stats, self.quarantine, self.encoder, lanes=self.lanes,
                              piped=config.replication.apply_transport == "pipeline",
                              apply_delay=self.apply_delay)

    @property
    def name(self) -> str:
        return self.link.name

    # ------------------------------------------------------------ control

    # A link's holds (router.apply.state): the operator's pause (`pause` / `resume`), schema drift (the
    # supervisor reports it: `add_hold` / `drop_hold`) and clock skew (`_wait_out_skew`, and the clock
    # watch at each refresh). The loop runs (`_resumed`) unless the link is on an error, paused or drifted.

    @property
    def user_paused(self) -> bool:
        return LinkHold.PAUSE in self.condition.holds

    @property
    def drift(self) -> str | None:
        """Why the link holds on schema drift (router.ddl.drift) until the schemas agree, or None."""
        return self.condition.holds.get(LinkHold.DRIFT)

    def pause(self, reason: str = "paused by the operator") -> None:
        self._resumed.clear()
        self._side.drop("the link was paused")  # holds no transaction open while paused
        self.condition.add_hold(LinkHold.PAUSE, None if reason.startswith("paused by") else reason)

    async def finish(self) -> None:
        """Start no batch more; return once the one in the target's hands has committed or failed (the
        router stopping: on 16+ a batch cut short moves the origin past what committed; progress.applied)."""
        self._resumed.clear()
        await self._between.wait()

    def resume(self) -> None:
        """`pgmesh resume`: the pause goes, the error shown is cleared, and a link on an error connects
        again; one held on schema drift stays held (the router re-checks the schemas: `drop_hold`)."""
        liveness, paused = self.condition.liveness, self.user_paused
        if liveness is Liveness.ERROR:
            liveness = Liveness.CONNECTING
        elif paused and liveness in RUNNING:
            liveness = self._running()
        self.condition.to(liveness, None)
        self.condition.drop_hold(LinkHold.PAUSE)
        self._gate()

    def add_hold(self, hold: LinkHold, reason: str) -> None:
        """A watcher holds the link: schema drift applies nothing (the source's slot is confirmed no
        further) while the schemas differ; an error stays in view until resumed."""
        if hold in _STOPS:
            self._resumed.clear()
            self._side.drop(f"the link holds on {hold.value}")
        self.condition.add_hold(hold, reason)

    def drop_hold(self, hold: LinkHold) -> None:
        """The watcher's hold is over: run, unless the operator paused the link or an error holds it."""
        condition = self.condition
        if hold not in condition.holds:
            return
        if condition.shows(hold):  # what it showed goes, its reason with it
            liveness = condition.liveness
            condition.to(self._running() if liveness in RUNNING else liveness, None)
        condition.drop_hold(hold)
        if hold is LinkHold.DRIFT:
            self._reread = True
        self._gate()

    def _gate(self) -> None:
        """Let the loop run unless the link is on an error, paused or held on schema drift."""
        if self.condition.liveness is Liveness.ERROR or not _STOPS.isdisjoint(self.condition.holds):
            self._resumed.clear()
        else:
            self._resumed.set()

    def _running(self, backlog: int = 0) -> Liveness:
        return Liveness.CATCHING_UP if len(self.queue) > backlog else Liveness.STREAMING

    @property
    def pending(self) -> int:
        """Transactions waiting for this link: queued, plus those in hand."""
        return len(self.queue) + len(self._in_hand)

    def oldest_pending_commit_time(self) -> int | None:
        if self._in_hand:
            return self._in_hand[0].commit_time
        return self.queue.oldest_commit_time()

    @property
    def ready_for_more(self) -> bool:
        """Running and not held: a detached link in this state can be re-attached."""
        return self._resumed.is_set() and self.state in (LinkState.STREAMING, LinkState.CATCHING_UP)

    # ------------------------------------------------------------ main loop

    async def run(self) -> None:
        backoff = 0.2
        while True:
            await self._resumed.wait()
            try:
                await self._connect()
                backoff = 0.2
                await self._apply_forever()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                try:
                    backoff = await self._after_error(exc, backoff)
                except RuntimeError as bad:  # an illegal liveness move (router.apply.state): stop, loudly
                    self._broken(exc, bad)

    async def _after_error(self, exc: Exception, backoff: float) -> float:
        """Retry after a backoff (the next backoff returned) or stop the link on `exc`."""
        action = decide_link(exc, self._schema, now=time.monotonic(), schema_wait_s=self.schema_wait,
                             dropped=self.link.dropped)
        await self._disconnect()
        if action is Action.RETRY:
            self.stats.retries += 1
            self.condition.to(Liveness.DOWN, describe(exc))
            logger.debug("link %s: retrying in %.1f s", self.name, backoff)
            await asyncio.sleep(backoff * (0.5 + random.random() / 2))
            return min(backoff * 2, 10.0)
        self.fail(exc)
        return backoff

    def _broken(self, exc: Exception, bad: RuntimeError) -> None:
        """Handling `exc` made a move the link's state forbids (`bad`): the link ends in "error" (reachable
        from every state) instead of ending the applier's task, and says so."""
        self.stats.errors += 1
        self._resumed.clear()
        self._side.drop("the link stopped on an internal error")
        logger.error("link %s: %s, while handling: %s", self.name, bad, describe(exc))
        self.condition.to(Liveness.ERROR, f"internal error: {bad}, while handling: {describe(exc)};"
                                          " `pgmesh resume` connects again")

    def reconnect(self, why: str) -> None:
        """Connect again now, busy or idle: the sessions are ended at once and an idle link stops waiting
        for its next transaction (its target may have lost commits it had not flushed, which only a new
        connection finds out: router.progress.positions.LinkProgress.restart_at)."""
        self.link.drop()
        self.queue.interrupt(ConnectionLost(why, node=self.target.name))

    def fail(self, exc: Exception) -> None:
        """Stop this link on the error (state "error"); `resume()` retries the same transaction."""
        self.stats.errors += 1
        lsn = self._in_hand[0].end_lsn if self._in_hand else None
        if isinstance(exc, PgmeshError):
            text = str(exc.at(node=self.target.name, lsn=lsn))
        else:
            text = f"node {self.target.name}, LSN {format_lsn(lsn or 0)}: {describe(exc)}"
        self._resumed.clear()
        self._side.drop("the link paused on an error")
        at, skip, in_hand = "", "", self._in_hand
        if not self._alone and len(in_hand) > 1:  # several in one round trip: which one failed is unknown
            at = (f"s ending at {format_lsn(in_hand[0].end_lsn)} to {format_lsn(in_hand[-1].end_lsn)}"
                  f" ({len(in_hand)}, sent together: which one failed is not known)")
        elif lsn is not None:  # the transaction by the LSN `pgmesh skip` takes (router.apply.skip)
            at = f" ending at {format_lsn(lsn)}"
            skip = (f"; to leave just this transaction out on {self.target.name}: `pgmesh skip --source"
                    f" {self.source} --target {self.target.name} --lsn {format_lsn(lsn)}`")
        self.condition.to(Liveness.ERROR, f"applying {self.source}'s transaction{at}: {text}{skip}")

    async def skip(self, lsn: int, record: Callable[[], Awaitable[object]]) -> str:
        """`pgmesh skip`: leave out the source's transaction that ends at `lsn` (router.apply.skip). A link
        held on an error is stuck on one transaction: only that one may be named, and the link runs again.
        `record` writes the skip on the target first (a restart remembers it); returns what will happen."""
        on_error = self.condition.liveness is Liveness.ERROR
        stuck = self._in_hand[0].end_lsn if on_error and self._in_hand else None
        if stuck is not None and not self._alone and len(self._in_hand) > 1:  # never guess which one failed
            raise PgmeshError(
                f"link {self.name} is held on {len(self._in_hand)} transactions sent together, and the error"
                " does not say which of them failed; nothing skipped", node=self.target.name, lsn=lsn,
                hint="fix the cause and `pgmesh resume`; skipping needs the one failing transaction alone",
            )
        text = check_skip(lsn, link=self.name, target=self.target.name, applied=self.progress.applied,
                          stuck=stuck)
        await record()
        self.skip_lsn = lsn
        if stuck is not None:
            self.resume()
        return text

    async def _connect(self) -> None:
        link = self.link
        self.condition.to(Liveness.CONNECTING, keep_error=True)  # shown "down" (with why) until it runs
        self.queue.forget_interrupt()  # (this connection finds out what the target has)
        if self.progress.restart_at(await link.open()):
            logger.warning("link %s: the target lost unflushed commits; re-reading from %s",
                           self.name, format_lsn(self.progress.applied))
            self.queue.clear()
            for txn in self._in_hand:
                let_go(txn)
            self._in_hand = []
        await link.load_tables()
        await self.quarantine.load(link.conn, required=self._quarantines)
        nodes, installed_at = await link.load_origins()
        self.skip_lsn = await read_skip(link)
        self._careful.origin_nodes = nodes
        self._careful.mark = link.mark
        if installed_at is not None:
            self._careful.installed_at = installed_at
        if self._sender.takes(link):  # opened with the link only (LinkSession.open_pipe)
            await link.open_pipe(fresh=True)
        self.condition.to(self._running(), None)  # (paused while it connected: shown paused)
        logger.info("link %s: connected, target has everything up to %s", self.name,
                    format_lsn(self.progress.applied))

    async def _disconnect(self) -> None:
        self._side.drop("the link reconnects")
        self._parallel.close()
        await self.link.close()

    async def close(self) -> None:
        await self._disconnect()

    async def _apply_forever(self) -> None:
        watch = asyncio.create_task(self._side.watch(), name=f"side watch {self.name}")
        try:
            await self._apply_loop()
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            self._side.drop("the link stopped")

    async def _apply_loop(self) -> None:
        while True:
            await self._resumed.wait()
            if not self._in_hand:
                self._in_hand = [await self.queue.get()]
            await self._resumed.wait()  # paused while it waited for the queue
            if self._reread:
                self._reread = False
                await self.link.reload_tables()
            self._take_more()
            fresh = [t for t in self._in_hand if t.end_lsn > self.progress.applied]
            for txn in self._in_hand:
                if txn.end_lsn <= self.progress.applied:
                    let_go(txn)
            self.stats.skipped += len(self._in_hand) - len(fresh)
            self._in_hand = fresh
            if fresh and self.skip_lsn is not None:
                fresh = self._in_hand = await self._skip(fresh, self.skip_lsn)
            if fresh:
                await self._delay(fresh[-1] if self.apply_delay <= 0 else fresh[0])
                self._between.clear()
                try:
                    await self._apply_batch(fresh)
                finally:
                    self._between.set()
                    self._side.main_done()
            self._in_hand = []
            self.condition.to(self._running(backlog=1000), keep_error=True)  # (paused meanwhile: shown so)

    async def _skip(self, fresh: list[Transaction], lsn: int) -> list[Transaction]:
        """What is left to apply of `fresh` under a skip (router.apply.skip): those before the transaction
        at `lsn` first (the rest back to the queue); that one left out; the skip dropped if none ends
        there."""
        at = due(fresh, lsn)
        if at:
            for txn in reversed(fresh[at:]):
                self.queue.push_front(txn)
            return fresh[:at]
        if at is None:
            return fresh
        txn, self.skip_lsn = fresh[0], None
        await self.link.take_origin()
        if txn.end_lsn != lsn:
            await drop_skip(self.link, lsn, txn)
            return fresh
        self._side.drop("a transaction is skipped")
        self._between.clear()
        try:
            await skip_transaction(self.link, whole_transaction(txn))
        finally:
            self._between.set()
        let_go(txn)
        self.progress.on_applied(txn.end_lsn)
        if self._on_applied is not None:  # (a synchronous source waits for it no more)
            self._on_applied(self, txn)
        return fresh[1:]

    def _take_more(self) -> None:
        """Join what is already queued (and due, under an apply delay) to the transactions in hand."""
        room = self._batch_limit - len(self._in_hand)
        if room <= 0 or not len(self.queue) or self.apply_delay > 0:
            return  # (under a delay, one at a time: each waits for its own due time)
        self._in_hand.extend(self.queue.take(room))

    async def _delay(self, txn: Transaction) -> None:
        """Hold `txn` until its commit time plus the apply delay has passed on the *target's* clock (the
        router's plus the target's measured offset): never apply a commit time that is still in the future
        there, so a local write after it always commits later (docs/conflicts.md, Clocks). Held while
        the source's or target's clock is beyond [clocks] max_offset_ms (router.service.clocks).
        """
        clocks = self._target_clock
        if await self._wait_out_skew():
            await self._resumed.wait()  # paused (or held on drift) while it was held
        due = pg_us_to_datetime(txn.commit_time).timestamp() + self.apply_delay
        wait = due - (self._clock() + clocks.offset())
        while wait > 0:
            await asyncio.sleep(wait)
            wait = due - (self._clock() + clocks.offset())  # the offset may have been measured anew

    async def _wait_out_skew(self) -> bool:
        """Wait while the link is held for clock skew, the hold in view; True if it waited. No commit time
        is applied before the clocks were first measured."""
        clocks = self._target_clock
        await clocks.measured()
        waited = False
        while (reason := clocks.skewed()) is not None:
            waited = True
            self.condition.add_hold(LinkHold.CLOCK, reason)
            await clocks.next_round()
        if waited:
            self.condition.drop_hold(LinkHold.CLOCK)
        return waited

    async def _apply_batch(self, batch: list[Transaction]) -> None:
        """Apply `batch` (the transactions in hand, `_in_hand`) a step at a time: each step applies the first
        of them (several in lanes, or one alone, or a run in one round trip) and leaves the rest in hand."""
        assert self.link.conn is not None
        self._in_hand = batch
        sequential = False  # a lane failed: the next step goes without lanes
        while self._in_hand:
            batch = self._in_hand
            if self._side.current is not None:
                self._side.gate(batch)
            if (self.lanes > 1 and len(batch) > 1 and not sequential and not is_large(batch[0])
                    and not self.quarantine.counts):
                self._alone = False
                try:
                    run = await self._parallel.apply(batch)
                    await self.link.count_conflicts()
                except BaseException:
                    await self._after_failure()
                    raise
                if run.failed:  # what the failed lanes created is gone with their transactions
                    self._parallel.forget()
                if run.applied:
                    for txn in batch[: run.applied]:
                        self._applied(txn)
                    self._in_hand = batch[run.applied :]
                    sequential = run.failed  # the transaction that failed goes the careful way, alone
                    continue
            sequential = False
            await self._apply_first(batch)

    async def _apply_first(self, batch: list[Transaction]) -> None:
        """One step without lanes: the batch's first transaction with DDL or a large one alone, else as
        many as fit one round trip; a conflict sends that transaction the careful way (and the rest of
        the batch back in smaller batches). Leaves what is still to apply in `_in_hand`."""
        piped = self._sender.encoded(batch)
        if piped:
            await self.link.open_pipe()
        else:
            await self.link.take_origin()
        self._alone = self._sender.alone = True
        # a table with pending keys: the careful way, once whole (one handed out before its commit goes in
        # parts, and meets what is pending by version: docs/conflicts.md "Quarantine")
        held = self.quarantine.holds(batch[0], self.link.tables) and whole_transaction(batch[0]).spill is None
        if held or (has_ddl(batch[0]) and not is_large(batch[0])):  # a large one runs its DDL in place
            if held:
                self._side.drop("its table has changes in quarantine")
            try:
                await self._apply_carefully(whole_transaction(batch[0]))
            except BaseException:
                await self._after_failure()
                await self.link.reload_tables()
                raise
            self._in_hand = batch[1:]
            return
        try:
            if is_large(batch[0]):
                if not await self._side.commit(batch[0]):  # applied ahead: committed there
                    batch[0] = await self._large.apply(batch[0])  # the whole one, if it came early
                await self.link.count_conflicts()
                done = 1
            else:
                sender = self._sender
                done = (piped and await sender.pipe(batch, piped)) or await sender.scripts(batch,
                                                                                          self._batch_limit)
                self._alone = sender.alone
        except asyncpg.PostgresError as exc:
            self._alone = self._sender.alone
            await self._after_failure()
            await self._after_conflict(exc)
        except LostBeforeCommit as lost:
            await self._after_failure()  # rolls back what was applied of it
            first = self._in_hand[0] if self._in_hand else None
            if first is not None and (first is lost.txn or first is whole_transaction(lost.txn)):
                let_go(self._in_hand.pop(0))
            self.stats.abandoned_transactions += 1
            logger.info("link %s: transaction %s (commit at %s) lost by the source before its commit"
                        " arrived; rolled back on %s, it will be applied when resent", self.name,
                        lost.txn.xid, format_lsn(lost.txn.commit_lsn), self.target.name)
        except BaseException:
            await self._after_failure()
            raise
        else:
            for txn in batch[:done]:
                self._applied(txn)
            self._in_hand = batch[done:]
            self._batch_limit = min(BATCH_TRANSACTIONS, self._batch_limit * 2)

    async def _after_conflict(self, exc: asyncpg.PostgresError) -> None:
        """The batch failed on the target (rolled back): read the tables again if DDL changed them here
        (once per transaction), or apply the transaction that met a conflict the careful way; else raise."""
        in_hand = self._in_hand
        if tables_changed(exc) and in_hand and in_hand[0].end_lsn != self._reloaded_for:
            # DDL run on the target itself since the tables were read: read them again, once
            self._reloaded_for = in_hand[0].end_lsn
            await self.link.reload_tables()
            return
        if remote_version_missing(exc) and self.link.needed_remote():
            return  # sent again, with the remote version
        if decision_function_lost(exc) and in_hand and in_hand[0].end_lsn != self._reloaded_for:
            self._reloaded_for = in_hand[0].end_lsn  # once per transaction, as a reload; then sent again
            return
        refused = self._quarantines and is_refused(exc)  # quarantined where its table says so, else raised
        if not (is_conflict(exc) or refused) or not in_hand or self.link.conn is None:
            raise exc
        if not refused:  # an insert that met its key: its table's inserts decide it here
            self.link.contest(in_hand[0], exc)
        self._alone = True
        # the transaction that met a conflict, or that the target refused
        await self._apply_carefully(whole_transaction(in_hand[0]), refused=refused)
        self._in_hand = in_hand[1:]
        self._batch_limit = max(16, self._batch_limit // 2)
        for txn in reversed(self._in_hand[self._batch_limit :]):
            self.queue.push_front(txn)  # back to the queue, in order: sent in smaller batches
        self._in_hand = self._in_hand[: self._batch_limit]

    def conflict_counts(self) -> dict[tuple[str, str], int]:
        """(table, conflict type) -> conflicts decided on this link since start (from its history)."""
        return dict(self.link.conflicts)

    async def _apply_carefully(self, txn: Transaction, *, refused: bool = False) -> None:
        """Row by row, with conflict detection and resolution, in its own target transaction.

        A local session may insert the same key between our read and our write (a unique violation):
        the whole transaction is read and decided again, now seeing that row (`router.errors.retry_unique`).
        A change the target refuses (`refused`: it did already) is set aside in quarantine where its
        table's `on_refused` says so: the transaction is applied again with a savepoint around each change
        of such a table (router.apply.quarantine).
        """
        link = self.link
        assert link.conn is not None
        await link.take_origin()  # (the pipe's until now, after a conflict there)
        whole = materialize(txn)  # a transaction spilled to disk is read back whole, for this path only
        changes = await link.conn.fetchval(SCHEMA_CHANGES)  # DDL run here changes keys (router.ddl.capture)
        if changes != self._schema_changes:
            self._schema_changes = changes
            await link.reload_tables()
        ddl = has_ddl(whole)
        reloaded = False
        guard = None
        for attempt in range(1, UNIQUE_ATTEMPTS + 1):
            guard = await self._guard(whole, refused)
            try:
                await self._careful.apply(
                    link.conn, link.fit(whole), link.tables, self.link.run_ddl if ddl else None, guard
                )
                break
            except asyncpg.PostgresError as exc:
                if guard is not None and not guard.savepoints and is_refused(exc):
                    refused = True  # applied again, each change of a quarantining table under a savepoint
                elif retry_unique(exc, attempt):
                    self.stats.retries += 1
                elif tables_changed(exc) and not reloaded:
                    reloaded = True  # DDL run on the target itself since the tables were read
                    await link.reload_tables()
                else:
                    raise
        else:  # every attempt went to a retry: never taken for applied
            raise PgmeshError(f"the careful apply did not finish in {UNIQUE_ATTEMPTS} attempts",
                              lsn=txn.end_lsn, hint="`pgmesh resume` tries it again")
        if note := link.applied_note([txn]):  # 16+: its commit shows no echo (router.stream.seen)
            await link.conn.execute(note)
        await link.count_conflicts()  # its own, and those of transactions committed before a failed batch's
        if ddl:
            self.stats.ddl_applied += 1
            await link.reload_tables()
        self._applied(txn)

    async def _guard(self, txn: Transaction, refused: bool) -> Guard | None:
        """The quarantine of one careful apply (None: no table of the target has one, nothing pending)."""
        index = self.quarantine
        if not (self._quarantines or index.counts):
            return None
        if index.due(time.monotonic()):  # a replay or discard since: keys no longer pending
            await index.load(self.link.conn, required=self._quarantines)
        return Guard(self.config, index, self.source, txn, savepoints=refused)

    async def _after_failure(self) -> None:
        """Roll back the failed transaction; learn which of the batch's transactions committed before it."""
        link = self.link
        if link.conn is None or link.conn.is_closed():
            return  # the next connect reads the origin's progress
        self._parallel.forget()  # the main session's and the lanes' prepared statements
        await link.recover_pipe()  # its failed transaction's locks go first
        with contextlib.suppress(Exception):
            await link.conn.execute("ROLLBACK")
            # else the failed transaction's origin LSN stays, for a later commit without a setup to record
            await link.conn.execute("SELECT pg_catalog.pg_replication_origin_xact_reset()")
            await link.deallocate_stale()
            done = await link.origin_progress()
            # one handed out before its commit counts by its whole self (it commits only once whole)
            self._in_hand = [whole_transaction(t) for t in self._in_hand]
            for txn in self._in_hand:
                if txn.end_lsn <= done:
                    self._applied(txn)
            self._in_hand = [t for t in self._in_hand if t.end_lsn > done]

    def _applied(self, txn: Transaction) -> None:
        let_go(txn)
        self._schema.done()
        self.progress.on_applied(txn.end_lsn)
        stats = self.stats
        stats.last_commit_time = txn.commit_time
        stats.applied_transactions += 1
        stats.applied_rows += txn.row_count
        if self._on_applied is not None:
            self._on_applied(self, txn)
