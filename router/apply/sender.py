"""A batch's way to the target: the pipe's (router.apply.pipe: the transactions encoded once for every
link, router.apply.encode, bound to statements prepared once, router.apply.shapes) or, for what the pipe
does not take, the script path's (router.apply.scripts: SQL text, one simple query a batch, the next
batch's scripts built while the target runs this one).

`Sender` gets the link's narrow handle (router.apply.link.LinkSession) and the link's queue (to build
ahead from), never the applier; what it did comes back as a return value and `alone` (whether a failure
of the last batch names its transaction).

Must not: retry, pause, decide what an error means, or apply the careful way.
"""

from __future__ import annotations

import asyncio

from protocol.transactions import Transaction
from router import failpoints
from router.apply.encode import Encoded, Encoder
from router.apply.link import DECIDED, LinkSession
from router.apply.parts import is_large
from router.apply.pipe import Piece
from router.apply.quarantine import QuarantineIndex
from router.apply.state import LinkStats
from router.ddl.messages import has_ddl
from router.errors import ApplyError, Unpipeable
from router.stream.linkqueue import LinkQueue

__all__ = ["BATCH_BYTES", "Sender"]

BATCH_BYTES = 4 << 20  # a script batch's SQL at most (its transactions stay whole)


class Sender:
    """One link's way of sending batches (see the module docstring)."""

    __slots__ = ("alone", "apply_delay", "encoder", "lanes", "link", "piped", "quarantine", "queue", "stats")

    def __init__(
        self, link: LinkSession, queue: LinkQueue, stats: LinkStats, quarantine: QuarantineIndex,
        encoder: Encoder, *, piped: bool, lanes: int, apply_delay: float,
    ) -> None:
        self.link = link
        self.queue = queue
        self.stats = stats
        self.quarantine = quarantine
        self.encoder = encoder
        self.piped = piped
        self.lanes = lanes
        self.apply_delay = apply_delay
        self.alone = True  # the last batch's failure names its transaction

    def takes(self, link: LinkSession) -> bool:
        """Whether the pipe sends this link's small transactions (not under lanes, nor before the source's
        origin exists on the target)."""
        return self.piped and self.lanes == 1 and link.source_origin is not None

    async def scripts(self, batch: list[Transaction], limit: int) -> int:
        """Apply the first of `batch` as scripts in one round trip (the origin taken by the main
        session); returns how many. `limit`: the applier's batch size (to build ahead)."""
        await self.link.take_origin()
        prelude, scripts = await self._scripts(batch)
        self.alone = len(scripts) <= 1
        notes = self.link.applied_note(batch[: len(scripts)])  # (16+: instead of echoes)
        await self._send("".join(f"{p};\n" for p in prelude) + "\n".join(scripts) + notes, limit)
        return len(scripts)

    def script(self, txn: Transaction, prelude: list[str], *, fit: bool = False) -> str:
        """`txn`'s script; with `fit`, rows sent before a replicated rename or drop fitted to the target
        first when they do not fit as they are. Only with tables just read: against tables read before
        a DDL typed on the target, a column dropped and added again there would look dropped, and its
        values would be left out without an error."""
        link = self.link
        ahead = link.ahead.pop(id(txn), None)
        if ahead is not None and ahead[0] is txn:
            self.stats.scripts_ahead += 1
            return ahead[1]
        mark = link.prepared.mark()
        size = len(prelude)
        try:
            return link.script(txn, prelude)
        except ApplyError:
            link.prepared.forget_since(mark)  # its PREPAREs are never sent
            del prelude[size:]
            fitted = link.fit(txn) if fit else txn
            if fitted is txn:
                raise
        return link.script(fitted, prelude)

    def encoded(self, batch: list[Transaction]) -> list[Encoded]:
        """The batch's first transactions as the pipe sends them (router.apply.encode), up to the first it
        does not take ([] when that is the first: the script path's batch)."""
        link = self.link
        if not self.takes(link):
            return []
        out: list[Encoded] = []
        encoded, holds, tables = self.encoder.encoded, self.quarantine.holds, link.tables
        for txn in batch:
            if has_ddl(txn) or (self.quarantine.counts and holds(txn, tables)):
                break
            enc = encoded(txn)
            if enc is None:
                break
            out.append(enc)
        return out

    async def pipe(self, batch: list[Transaction], encoded: list[Encoded]) -> int:
        """Apply the first of `batch` (encoded as `encoded`) through the pipe in one round trip; returns how
        many (0: the first does not go this way on this target, the script path takes the batch)."""
        link = self.link
        pipe, statements = await link.open_pipe()
        prepared, remote = link.prepared, link.decisions.remote
        plan: list[Piece] = []
        build = statements.wire if pipe.raw else statements.transaction  # (Bind bytes: once for all links)
        count = 0
        for enc in encoded:
            try:
                plan += build(enc, prepared, remote)
            except (Unpipeable, ApplyError):
                break  # (the script path fits it to the target or says what does not fit)
            count += 1
        if not count:
            return 0
        plan += statements.ending(batch[:count], link.announce, link.source)
        link.built(count)
        await link.make_functions(prepared)  # committed before the batch that calls them
        prepares = statements.new
        statements.sent()
        self.alone = count == 1
        closes, statements.stale = statements.stale, []
        commands = await pipe.send(prepares, plan, closes)
        if failpoints.ARMED:
            await _batch_sent()
        result = await pipe.results(commands)
        if result.error is not None:
            statements.lost()
            # the transaction that failed is known: the first left in hand once those committed are let go
            # (_after_failure), unless a statement failed to prepare
            assert result.failed_at is not None
            self.alone = count == 1 or result.failed_at >= len(closes) + len(prepares)
            raise result.error
        statements.fresh = []
        if result.decided:  # a decision function decided a conflict
            await link.count_conflicts()
        return count

    async def _scripts(self, batch: list[Transaction]) -> tuple[list[str], list[str]]:
        """The batch's PREPAREs and transaction scripts; a transaction that does not fit the target's
        schema ends the batch."""
        prelude: list[str] = []
        scripts: list[str] = []
        size = 0
        for i, txn in enumerate(batch):
            if has_ddl(txn) or is_large(txn) or self.quarantine.holds(txn, self.link.tables):
                break  # applied on its own (_apply_first)
            try:
                script = self.script(txn, prelude)
            except ApplyError:
                if i:
                    break  # apply what comes before it first
                await self.link.load_tables()  # the target's schema may have changed since we looked
                script = self.script(txn, prelude, fit=True)
            scripts.append(script)
            size += len(script)
            if size >= BATCH_BYTES:
                break
        self.link.built(len(scripts))
        return prelude, scripts

    def _build_ahead(self, limit: int) -> None:
        """While a batch runs on the target, build the scripts of the transactions queued behind it.

        Building is the router's share of a small transaction's cost; done here, it overlaps the
        target's work instead of following it (TPC-B: ~15% of the time was spent building while the
        target waited). Only scripts that need no new prepared statement are kept, so throwing the
        cache away (a reconnect, the tables read again, a conflict) never leaves a PREPARE unsent;
        `_script` takes a cached script only for the very transaction object it was built from.
        """
        link = self.link
        link.ahead = {}
        if self.apply_delay > 0 or self.lanes > 1:
            return
        mark = link.prepared.mark()
        size = 0
        try:
            for txn in self.queue.peek(limit):
                if has_ddl(txn) or is_large(txn):
                    break
                prelude: list[str] = []
                script = link.script(txn, prelude)
                if prelude:  # a new prepared statement: left to the batch that sends it
                    link.prepared.forget_since(mark)
                    break
                link.ahead[id(txn)] = (txn, script)
                size += len(script)
                if size >= BATCH_BYTES:
                    break
        except ApplyError:
            link.prepared.forget_since(mark)  # built the normal way, which handles it

    async def _send(self, text: str, limit: int) -> None:
        """Run one batch's SQL on the target, building the next batch's scripts meanwhile."""
        assert self.link.conn is not None
        await self.link.make_functions(self.link.prepared)  # committed before the batch that calls them
        task = asyncio.ensure_future(self.link.conn.execute(f"{text};\n{DECIDED}"))
        try:
            await asyncio.sleep(0)  # the task sends the query
            if not task.done():
                self._build_ahead(limit)
            if failpoints.ARMED:
                await _batch_sent()
            if await task == "SELECT 1":  # a decision function decided a conflict
                await self.link.count_conflicts()
        finally:
            if not task.done():
                task.cancel()


async def _batch_sent() -> None:
    """A test's fail point: a batch sent (by either way), its result not read (router.failpoints)."""
    await failpoints.hit("apply.batch_sent")
