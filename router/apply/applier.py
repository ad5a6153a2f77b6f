"""One applier per link (source -> target): applies the source's transactions to the target, exactly once.

Each source transaction becomes one target transaction (see `router.apply.scripts`), run in a session that
has `session_replication_role = replica` (user and FK triggers do not fire), `synchronous_commit = off`
(as the native apply worker) and the source's replication origin set up, and every transaction calls
`pg_replication_origin_xact_setup(end LSN, commit time)`: the row carries the source's origin and
commit time, and the origin's progress moves atomically with the data. On every (re)connect the
applier reads that progress and skips what the target already has: nothing twice, nothing skipped.

Deadlocks, serialization failures, lock timeouts and lost connections are retried with backoff
(`router.errors.decide` says which); any other error pauses this link only, with node, table and LSN,
until `resume()`. The applier never reads the source and never confirms anything to it: the router's
progress tick reads the flushed origin positions and confirms the source.

Beside it: `router.stream.linkqueue` (the queue it reads), `router.apply.sessions` (a session on the target:
set-up, the origin), `router.apply.large` (a transaction too big for a batch, in parts), `router.apply.lanes`
(parallel apply) and `router.apply.side` (a streamed transaction applied on a side session before its commit).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import asyncpg

from protocol.lsn import datetime_to_pg_us, format_lsn, parse_lsn, pg_us_to_datetime
from protocol.messages import Message
from protocol.transactions import Transaction
from router.apply.careful import CarefulApplier
from router.apply.lanes import Lanes
from router.apply.large import Abandoned, LargeApply, is_large, whole_transaction
from router.apply.scripts import transaction_script
from router.apply.sessions import open_session, take_origin
from router.apply.side import SideSession
from router.apply.statements import ApplyError, Prepared, SchemaMismatch, TargetTable, quote_ident
from router.config import Config, NodeConfig
from router.ddl.messages import DDL_PREFIX, ddl_command, describe_command, has_ddl
from router.ddl.reconcile import Drift, reconcile
from router.errors import Action, PgmeshError, decide, describe
from router.progress import LinkProgress
from router.stream.linkqueue import LinkQueue
from router.stream.spool import materialize, release

__all__ = ["Applier", "LinkState"]

# Transactions sent to the target in one round trip: each stays its own target transaction (its own
# BEGIN, origin setup and COMMIT), so every row keeps its source commit time; only the trips are shared.
BATCH_TRANSACTIONS = 256
BATCH_BYTES = 4 << 20
# How long a link waits for a table or column its rows name to appear on the target (DDL from a third
# node still on its way) before it pauses.
SCHEMA_WAIT_S = 60.0

logger = logging.getLogger(__name__)

# Columns renamed or dropped by DDL on the target, oldest first (router.ddl.capture).
_DRIFT_QUERY = """
SELECT table_name, old_name, new_name FROM pgmesh.column_changes
WHERE to_regclass('pgmesh.column_changes') IS NOT NULL ORDER BY at
"""

# Every replicated-table candidate on the target: columns with types (in attnum order), primary key,
# and the other unique keys (plain column lists, not partial, not on expressions).
_TABLES_QUERY = """
SELECT n.nspname, c.relname,
  (SELECT jsonb_agg(jsonb_build_array(a.attname, format_type(a.atttypid, a.atttypmod)) ORDER BY a.attnum)
     FROM pg_catalog.pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped)::text,
  (SELECT coalesce(jsonb_agg(jsonb_build_array(i.indisprimary, i.indisreplident, (
       SELECT jsonb_agg(a.attname ORDER BY k.ord)
       FROM unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
       JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum))), '[]')
     FROM pg_catalog.pg_index i
     WHERE i.indrelid = c.oid AND i.indisunique AND i.indpred IS NULL AND i.indexprs IS NULL)::text
FROM pg_catalog.pg_class c
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p') AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'pgmesh')
  AND n.nspname NOT LIKE 'pg\\_%'
"""

# SQLSTATEs of a conflict met by the fast path: a guard fired, or a key is already there.
_CONFLICT_STATES = frozenset({"PGM01", "PGM02", "23505"})
# The target's tables changed under us (DDL run there): undefined column / table, datatype mismatch.
_SCHEMA_STATES = frozenset({"42703", "42P01", "42804"})


class LinkState(enum.Enum):
    STREAMING = "streaming"
    PAUSED = "paused"
    CATCHING_UP = "catching up"
    DOWN = "down"
    ERROR = "error"


class Applier:
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
    ) -> None:
        self.config = config
        self.source = source
        self.target = target
        self.origin = config.origin_name(source)
        self._source_origin: int | None = None
        self._careful = CarefulApplier(config, source, target.name, {})
        self.queue = queue
        self.progress = progress
        self.apply_delay = config.replication.apply_delay_ms / 1000.0
        self._clock = clock
        self._on_applied = on_applied
        self._conn: asyncpg.Connection | None = None
        self._tables: dict[tuple[str, str], TargetTable] = {}
        self._schema_wait_since: float | None = None  # since when a missing table / column is awaited
        self.schema_wait = SCHEMA_WAIT_S
        self._reloaded_for = -1  # the transaction that last made us re-read the target's tables
        self._drift: Drift = {}  # columns renamed or dropped here by DDL (router.ddl.capture.reconcile)
        self._held: list[Transaction] = []  # taken from the queue, not yet known to be applied
        self._prepared = Prepared()
        # Scripts built while the previous batch ran on the target, by id(): see _build_ahead.
        self._ahead: dict[int, tuple[Transaction, str]] = {}
        self.scripts_ahead = 0  # scripts built ahead and then sent (for the bench)
        self.early_transactions = 0  # large transactions whose apply began before their commit arrived
        self.abandoned_transactions = 0  # of those, lost by the source before the commit (sent again)
        # Transactions per round trip: halved after a conflict (the rest of a batch is sent again),
        # doubled after a clean batch, up to BATCH_TRANSACTIONS.
        self._batch_limit = BATCH_TRANSACTIONS
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.user_paused = False
        self.state = LinkState.DOWN
        self.last_error: str | None = None
        self.last_commit_time: int | None = None  # source commit time of the last applied transaction
        self.retries = 0
        self.errors = 0
        self.skipped = 0
        self.applied_transactions = 0
        self.applied_rows = 0
        self.conflicts = 0
        self.ddl_applied = 0
        self.copied_transactions = 0  # large transactions applied in parts (COPY where possible)
        self.copied_rows = 0
        self._large = LargeApply(self)
        # Parallel apply (router.apply.lanes): sessions besides the main one; the main session holds the
        # source's replication origin except while lanes run (then each takes it just to commit).
        self.lanes = max(1, config.replication.apply_lanes)
        self._parallel = Lanes(self)
        self._origin_held = False
        self._installed_at: str | None = None
        self._sequential_next = False
        self.parallel_batches = 0
        self.parallel_transactions = 0
        # Streamed transactions applied before their commit on a side session (router.apply.side).
        self._side = SideSession(self)
        self.early_streams = 0  # streamed transactions a side session began before their commit
        self.early_streams_committed = 0  # of those, committed there in their place in commit order
        self.early_streams_dropped = 0  # of those, rolled back (then applied the normal way, or aborted)

    @property
    def name(self) -> str:
        return f"{self.source} -> {self.target.name}"

    # ------------------------------------------------------------ control

    def pause(self, reason: str = "paused by the operator") -> None:
        self.user_paused = True
        self._resumed.clear()
        self._side.drop("the link was paused")  # holds no transaction open while paused
        self.state = LinkState.PAUSED
        self.last_error = None if reason.startswith("paused by") else reason

    def resume(self) -> None:
        self.user_paused = False
        self.last_error = None
        self._resumed.set()

    @property
    def pending(self) -> int:
        """Transactions held for this link: queued, plus those in hand."""
        return len(self.queue) + len(self._held)

    def oldest_pending_commit_time(self) -> int | None:
        if self._held:
            return self._held[0].commit_time
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
                action = self._classify(exc)
                await self._disconnect()
                if action is Action.RETRY:
                    self.retries += 1
                    self.state = LinkState.DOWN
                    self.last_error = describe(exc)
                    logger.warning("link %s: %s; retrying in %.1f s", self.name, self.last_error, backoff)
                    await asyncio.sleep(backoff * (0.5 + random.random() / 2))
                    backoff = min(backoff * 2, 10.0)
                else:
                    self._hold(exc)

    def _classify(self, exc: Exception) -> Action:
        if isinstance(exc, asyncpg.InterfaceError) and "closed" in str(exc):
            return Action.RETRY
        if isinstance(exc, SchemaMismatch):
            # Rows of a node that already ran another node's DDL can arrive before that DDL does:
            # wait a while for it, then pause naming the table and column.
            now = time.monotonic()
            if self._schema_wait_since is None:
                self._schema_wait_since = now
            if now - self._schema_wait_since < self.schema_wait:
                return Action.RETRY
            self._schema_wait_since = None
            return Action.PAUSE
        return decide(exc)

    def _hold(self, exc: Exception) -> None:
        """Pause this link with the error; `resume()` retries the same transaction."""
        self.errors += 1
        lsn = self._held[0].end_lsn if self._held else None
        if isinstance(exc, PgmeshError):
            exc.node = exc.node or self.target.name
            exc.lsn = exc.lsn or lsn
            text = exc._render()
        else:
            text = f"node {self.target.name}, LSN {format_lsn(lsn or 0)}: {describe(exc)}"
        self.last_error = f"applying {self.source}'s transaction: {text}"
        self.state = LinkState.ERROR
        self._resumed.clear()
        self._side.drop("the link paused on an error")
        logger.error("link %s paused: %s (fix it, then `pgmesh resume`)", self.name, self.last_error)

    async def _connect(self) -> None:
        self._conn = await open_session(self.target.dsn)  # installed_at: set by _load_origins
        self._prepared = Prepared()  # a new session has no prepared statements
        self._ahead = {}
        await self._conn.execute("SELECT pg_catalog.pg_replication_origin_session_setup($1)", self.origin)
        self._origin_held = True
        row = await self._conn.fetchval(
            "SELECT pg_catalog.pg_replication_origin_progress($1, false)::text", self.origin
        )
        if self.progress.restart_at(parse_lsn(row) if row else 0):
            logger.warning("link %s: the target lost unflushed commits; re-reading from %s",
                           self.name, format_lsn(self.progress.applied))
            self.queue.clear()
            for txn in self._held:
                release(txn)
            self._held = []
        await self._load_tables()
        await self._load_origins()
        self.state = LinkState.CATCHING_UP if len(self.queue) else LinkState.STREAMING
        self.last_error = None
        logger.info("link %s: connected, target has everything up to %s", self.name,
                    format_lsn(self.progress.applied))

    async def _load_tables(self) -> None:
        assert self._conn is not None
        tables = {}
        for schema, name, columns_json, keys_json in await self._conn.fetch(_TABLES_QUERY):
            types = {col: kind for col, kind in json.loads(columns_json or "[]")}
            keys = json.loads(keys_json or "[]")
            pk = next((tuple(cols) for primary, _, cols in keys if primary), ())
            replident = next((tuple(cols) for _, ident, cols in keys if ident), ())
            uniques = tuple(tuple(cols) for primary, _, cols in keys if not primary)
            table = TargetTable(schema, name, frozenset(types), types, pk, uniques)
            # the columns pgmesh's tombstone trigger keys deletions by (router.conflicts.catalog)
            table.tombstone_key = pk or replident or tuple(types)
            tables[(schema, name)] = table
        self._tables = tables
        self._ahead = {}  # built for the tables as they were
        drift: dict[str, dict[str, str | None]] = {}
        for table_name, old, new in await self._conn.fetch(_DRIFT_QUERY):
            drift.setdefault(table_name, {})[old] = new
        self._drift = drift

    async def _load_origins(self) -> None:
        """This source's origin id here, and every pgmesh origin's node (for conflict versions)."""
        assert self._conn is not None
        prefix = self.config.origin_name("")
        rows = await self._conn.fetch(
            "SELECT roident, roname FROM pg_catalog.pg_replication_origin WHERE starts_with(roname, $1)",
            prefix,
        )
        nodes = {int(r["roident"]): str(r["roname"])[len(prefix):] for r in rows}
        self._source_origin = next((ident for ident, node in nodes.items() if node == self.source), None)
        self._careful.origin_nodes = nodes
        installed = await self._conn.fetchval(
            "SELECT CASE WHEN to_regclass('pgmesh.node_info') IS NOT NULL THEN"
            " (SELECT value FROM pgmesh.node_info WHERE key = 'installed_at') END"
        )
        self._installed_at = installed
        if installed:  # rows older than this are every node's common start: no conflict (expect_origin)
            await self._conn.execute("SELECT set_config('pgmesh.installed_at', $1, false)", installed)
            self._careful.installed_at = datetime_to_pg_us(
                await self._conn.fetchval("SELECT $1::text::timestamptz", installed)
            )

    async def _disconnect(self) -> None:
        self._side.drop("the link reconnects")
        self._parallel.close()
        conn, self._conn = self._conn, None
        self._origin_held = False
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 5)
            if not conn.is_closed():
                conn.terminate()

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
            if not self._held:
                self._held = [await self.queue.get()]
            await self._resumed.wait()  # paused while it waited for the queue
            self._take_more()
            fresh = [t for t in self._held if t.end_lsn > self.progress.applied]
            for txn in self._held:
                if txn.end_lsn <= self.progress.applied:
                    release(txn)
            self.skipped += len(self._held) - len(fresh)
            self._held = fresh
            if fresh:
                await self._delay(fresh[-1] if self.apply_delay <= 0 else fresh[0])
                try:
                    await self._apply_batch(fresh)
                finally:
                    self._side.main_done()
            self._held = []
            self.state = LinkState.CATCHING_UP if len(self.queue) > 1000 else LinkState.STREAMING

    def _take_more(self) -> None:
        """Join what is already queued (and due, under an apply delay) to the transactions in hand."""
        room = self._batch_limit - len(self._held)
        if room <= 0 or not len(self.queue):
            return
        if self.apply_delay > 0:
            return  # one at a time: each waits for its own due time
        self._held.extend(self.queue.take(room))

    async def _delay(self, txn: Transaction) -> None:
        """Hold `txn` until its commit time plus the apply delay; never apply a commit time that is still
        in the future here (clock skew), so a local write after it always commits later (docs/conflicts.md).
        """
        due = pg_us_to_datetime(txn.commit_time).timestamp() + self.apply_delay
        wait = due - self._clock()
        if wait > 0:
            await asyncio.sleep(wait)

    def _script(self, txn: Transaction, prelude: list[str]) -> str:
        ahead = self._ahead.pop(id(txn), None)
        if ahead is not None and ahead[0] is txn:
            self.scripts_ahead += 1
            return ahead[1]
        mark = self._prepared.mark()
        size = len(prelude)
        try:
            return transaction_script(
                txn, self._tables, prepared=self._prepared, guard_origin=self._source_origin, prelude=prelude
            )
        except ApplyError:
            self._prepared.forget_since(mark)  # its PREPAREs are never sent
            del prelude[size:]
            fitted = self._fit(txn)
            if fitted is txn:
                raise
        return transaction_script(
            fitted, self._tables, prepared=self._prepared, guard_origin=self._source_origin, prelude=prelude
        )

    def _fit(self, txn: Transaction) -> Transaction:
        """`txn` with rows sent before a replicated rename or drop fitted to the target (router.ddl)."""
        if not self._drift:
            return txn
        columns = {key: table.columns for key, table in self._tables.items()}
        return reconcile(txn, columns, self._drift) or txn

    async def _scripts(self, batch: list[Transaction]) -> tuple[list[str], list[str]]:
        """The batch's PREPAREs and transaction scripts; a transaction that does not fit the target's
        schema ends the batch."""
        prelude: list[str] = []
        scripts: list[str] = []
        size = 0
        for i, txn in enumerate(batch):
            if has_ddl(txn) or is_large(txn):
                break  # applied on its own (_apply_batch)
            try:
                script = self._script(txn, prelude)
            except ApplyError:
                if i:
                    break  # apply what comes before it first
                await self._load_tables()  # the target's schema may have changed since we looked
                script = self._script(txn, prelude)
            scripts.append(script)
            size += len(script)
            if size >= BATCH_BYTES:
                break
        self._ahead = {}
        return prelude, scripts

    def _build_ahead(self) -> None:
        """While a batch runs on the target, build the scripts of the transactions queued behind it.

        Building is the router's share of a small transaction's cost; done here, it overlaps the
        target's work instead of following it (TPC-B: ~15% of the time was spent building while the
        target waited). Only scripts that need no new prepared statement are kept, so throwing the
        cache away (a reconnect, the tables read again, a conflict) never leaves a PREPARE unsent;
        `_script` takes a cached script only for the very transaction object it was built from.
        """
        self._ahead = {}
        if self.apply_delay > 0 or self.lanes > 1:
            return
        mark = self._prepared.mark()
        size = 0
        try:
            for txn in self.queue.peek(self._batch_limit):
                if has_ddl(txn) or is_large(txn):
                    break
                prelude: list[str] = []
                script = transaction_script(
                    txn, self._tables, prepared=self._prepared, guard_origin=self._source_origin,
                    prelude=prelude,
                )
                if prelude:  # a new prepared statement: left to the batch that sends it
                    self._prepared.forget_since(mark)
                    break
                self._ahead[id(txn)] = (txn, script)
                size += len(script)
                if size >= BATCH_BYTES:
                    break
        except ApplyError:
            self._prepared.forget_since(mark)  # built the normal way, which handles it

    async def _send(self, text: str) -> None:
        """Run one batch's SQL on the target, building the next batch's scripts meanwhile."""
        assert self._conn is not None
        task = asyncio.ensure_future(self._conn.execute(text))
        try:
            await asyncio.sleep(0)  # the task sends the query
            if not task.done():
                self._build_ahead()
            await task
        finally:
            if not task.done():
                task.cancel()

    async def _apply_batch(self, batch: list[Transaction]) -> None:
        assert self._conn is not None
        if self._side.current is not None:
            self._side.gate(batch)
        if self.lanes > 1 and len(batch) > 1 and not self._sequential_next and not is_large(batch[0]):
            try:
                done = await self._parallel.apply(batch)
            except BaseException:
                await self._after_failure()
                raise
            if done:
                self._held = batch[done:]
                if self._held:
                    await self._apply_batch(self._held)
                return
        self._sequential_next = False
        await self._hold_origin()
        if has_ddl(batch[0]):
            try:
                await self._apply_carefully(batch[0])
            except BaseException:
                await self._after_failure()
                await self._reload_tables()
                raise
            self._held = batch[1:]
            if self._held:
                await self._apply_batch(self._held)
            return
        try:
            if is_large(batch[0]):
                batch[0] = await self._large.apply(batch[0])  # the whole one, if it came early
                done = 1
            else:
                prelude, scripts = await self._scripts(batch)
                await self._send("".join(f"{p};\n" for p in prelude) + "\n".join(scripts))
                done = len(scripts)
        except asyncpg.PostgresError as exc:
            await self._after_failure()
            if exc.sqlstate in _SCHEMA_STATES and self._held and self._held[0].end_lsn != self._reloaded_for:
                # DDL run on the target itself since the tables were read: read them again, once
                self._reloaded_for = self._held[0].end_lsn
                await self._reload_tables()
                await self._apply_batch(self._held)
                return
            if exc.sqlstate not in _CONFLICT_STATES or not self._held or self._conn is None:
                raise
            await self._apply_carefully(self._held[0])  # the transaction that met a conflict
            self._held = self._held[1:]
            self._batch_limit = max(16, self._batch_limit // 2)
            for txn in reversed(self._held[self._batch_limit :]):
                self.queue.push_front(txn)  # back to the queue, in order: sent in smaller batches
            self._held = self._held[: self._batch_limit]
        except Abandoned as gone:
            await self._after_failure()  # rolls back what was applied of it
            if self._held and (self._held[0] is gone.txn or self._held[0] is whole_transaction(gone.txn)):
                release(self._held.pop(0))
            self.abandoned_transactions += 1
            logger.info("link %s: transaction %s (commit at %s) lost by the source before its commit"
                        " arrived; rolled back on %s, it will be applied when resent", self.name,
                        gone.txn.xid, format_lsn(gone.txn.commit_lsn), self.target.name)
        except BaseException:
            await self._after_failure()
            raise
        else:
            for txn in batch[:done]:
                self._applied(txn)
            self._held = batch[done:]
            self._batch_limit = min(BATCH_TRANSACTIONS, self._batch_limit * 2)
        if self._held:
            await self._apply_batch(self._held)

    async def _hold_origin(self) -> None:
        """The main session takes the source's origin back after lanes or a side session had it (a
        session that just ended may not have let it go yet: a moment is allowed for that)."""
        if self._origin_held or self._conn is None:
            return
        await take_origin(self._conn, self.origin)
        self._origin_held = True

    def conflict_counts(self) -> dict[tuple[str, str], int]:
        """(table, conflict type) -> conflicts decided on this link since start."""
        return dict(self._careful.counts)

    async def _apply_carefully(self, txn: Transaction) -> None:
        """Row by row, with conflict detection and resolution, in its own target transaction.

        A local session may insert the same key between our read and our write (a unique violation):
        the whole transaction is read and decided again, now seeing that row.
        """
        assert self._conn is not None
        whole = materialize(txn)  # a transaction spilled to disk is read back whole, for this path only
        ddl = has_ddl(whole)
        reloaded = False
        for attempt in range(1, 6):
            try:
                records = await self._careful.apply(
                    self._conn, self._fit(whole), self._tables, self._run_ddl if ddl else None
                )
                break
            except asyncpg.UniqueViolationError:
                if attempt == 5:
                    raise
                self.retries += 1
            except asyncpg.PostgresError as exc:
                if exc.sqlstate not in _SCHEMA_STATES or reloaded:
                    raise
                reloaded = True  # DDL run on the target itself since the tables were read
                await self._reload_tables()
        self.conflicts += len(records)
        if ddl:
            self.ddl_applied += 1
            await self._reload_tables()
        self._applied(txn)

    async def _reload_tables(self) -> None:
        """What the target has now, after DDL (applied or rolled back). Prepared statements stay: they
        are keyed by the source's relation description, and a changed relation is a new one."""
        if self._conn is None or self._conn.is_closed():
            return
        await self._load_tables()

    async def _run_ddl(self, conn: Any, message: Message) -> dict[tuple[str, str], TargetTable] | None:
        """One captured DDL command, inside the target transaction, as its user under its search_path."""
        if message.prefix != DDL_PREFIX:
            return None
        command = ddl_command(message)
        path = await conn.fetchval("SELECT current_setting('search_path')")
        await conn.execute("SELECT set_config('search_path', $1, true)", command.search_path)
        me = await conn.fetchval("SELECT current_user")
        try:
            if command.role != me:
                await conn.execute(f"SET LOCAL ROLE {quote_ident(command.role)}")
            await conn.execute(command.sql)
            if command.role != me:
                await conn.execute(f"SET LOCAL ROLE {quote_ident(me)}")
        except asyncpg.PostgresError as exc:
            raise ApplyError(
                f"replicated DDL failed: {describe(exc)}; the command ({command.tag}):"
                f" {describe_command(command)}",
                lsn=message.lsn,
                sqlstate=exc.sqlstate,
                hint="make the command possible here (for example create the missing role or object),"
                " then `pgmesh resume`",
            ) from None
        await conn.execute("SELECT set_config('search_path', $1, true)", path)
        logger.info("link %s: applied %s from %s", self.name, command.tag, self.source)
        await self._load_tables()
        return self._tables

    async def _after_failure(self) -> None:
        """Roll back the failed transaction; learn which of the batch's transactions committed before it."""
        conn = self._conn
        if conn is None or conn.is_closed():
            return  # the next connect reads the origin's progress
        with contextlib.suppress(Exception):
            await conn.execute("ROLLBACK")
            row = await conn.fetchval(
                "SELECT pg_catalog.pg_replication_origin_progress($1, false)::text", self.origin
            )
            done = parse_lsn(row) if row else 0
            # one handed out before its commit counts by its whole self (it commits only once whole)
            self._held = [whole_transaction(t) for t in self._held]
            for txn in self._held:
                if txn.end_lsn <= done:
                    self._applied(txn)
            self._held = [t for t in self._held if t.end_lsn > done]

    def _applied(self, txn: Transaction) -> None:
        release(txn)
        self._schema_wait_since = None
        self.progress.on_applied(txn.end_lsn)
        self.last_commit_time = txn.commit_time
        self.applied_transactions += 1
        self.applied_rows += txn.row_count
        if self._on_applied is not None:
            self._on_applied(self, txn)
