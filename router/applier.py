"""One applier per link (source -> target): applies the source's transactions to the target, exactly once.

Each source transaction becomes one target transaction (see `router.statements`), run in a session that
has `session_replication_role = replica` (user and FK triggers do not fire), `synchronous_commit = off`
(as the native apply worker) and the source's replication origin set up, and every transaction calls
`pg_replication_origin_xact_setup(end LSN, commit time)`: the row carries the source's origin and
commit time, and the origin's progress moves atomically with the data. On every (re)connect the
applier reads that progress and skips what the target already has: nothing twice, nothing skipped.

Deadlocks, serialization failures, lock timeouts and lost connections are retried with backoff
(`router.errors.decide` says which); any other error pauses this link only, with node, table and LSN,
until `resume()`. The applier never reads the source and never confirms anything to it: the router's
progress tick reads the flushed origin positions and confirms the source.

A streamed transaction announced before its commit (router.source.EarlyStream) is applied on a second
session (the "side" session) as its spill file grows, in one open target transaction, while the main
session goes on with what commits before it. When its commit comes to the head of the queue, the main
session hands the origin over and the side session commits it there, in commit order. The two sessions
never wait for each other: the main session starts no batch that touches a table the side transaction
holds (it rolls the side transaction back first), and the side session takes no table the main session
is writing. Anything unusual (a subtransaction aborted after part of it spilled, a TRUNCATE, DDL, a
conflict, an abort, a reconnect) rolls the side transaction back, and the transaction is applied the
normal way at its commit.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import itertools
import json
import logging
import random
import time
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any

import asyncpg
import msgspec
import psycopg.conninfo

from protocol.lsn import datetime_to_pg_us, format_lsn, parse_lsn, pg_us_to_datetime
from protocol.messages import Message, Relation, Truncate
from protocol.transactions import Change, Transaction
from router.config import Config, NodeConfig
from router.conflict_apply import CarefulApplier
from router.ddl import DDL_PREFIX, Drift, ddl_command, describe_command, has_ddl, reconcile
from router.errors import Action, PgmeshError, decide, describe
from router.parallel import plan_lanes
from router.progress import LinkProgress
from router.source import EarlyStream
from router.spool import SpillFile, iter_chunks, materialize, release
from router.statements import (
    KEY_LOCKS_MAX,
    ApplyError,
    CopyRun,
    Prepared,
    SchemaMismatch,
    TargetTable,
    quote_ident,
    quote_literal,
    transaction_script,
    transaction_segments,
    xact_setup_sql,
)

__all__ = ["Applier", "LinkQueue", "LinkState", "asyncpg_connect_args"]

# Transactions sent to the target in one round trip: each stays its own target transaction (its own
# BEGIN, origin setup and COMMIT), so every row keeps its source commit time; only the trips are shared.
BATCH_TRANSACTIONS = 256
BATCH_BYTES = 4 << 20
# How long a link waits for a table or column its rows name to appear on the target (DDL from a third
# node still on its way) before it pauses.
SCHEMA_WAIT_S = 60.0

logger = logging.getLogger(__name__)

_SESSION_SETUP = """
SET session_replication_role = replica;
SET synchronous_commit = off;
SET standard_conforming_strings = on;
SET lock_timeout = '10s';
SET TimeZone = 'UTC';
SET DateStyle = 'ISO, YMD';
SET IntervalStyle = 'postgres';
SET extra_float_digits = 3;
"""

# Columns renamed or dropped by DDL on the target, oldest first (router.ddl).
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


class LinkQueue:
    """A bounded FIFO of transactions for one link. `offer` never blocks the fan-out.

    Beside it, one slot for a streamed transaction announced before its commit (`offer_side`,
    `get_side`): it holds one reference to its spill file, released by whoever takes it. `cleared`
    counts `clear()`s (the link detached or restarted: what was announced may never come here).
    """

    __slots__ = ("_items", "_nonempty", "_room", "_side", "_side_ready", "cleared", "maxlen")

    def __init__(self, maxlen: int) -> None:
        self.maxlen = maxlen
        self._items: collections.deque[Transaction] = collections.deque()
        self._nonempty = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._side: EarlyStream | None = None
        self._side_ready = asyncio.Event()
        self.cleared = 0

    def __len__(self) -> int:
        return len(self._items)

    def offer(self, txn: Transaction) -> bool:
        if len(self._items) >= self.maxlen:
            self._room.clear()
            return False
        self._items.append(txn)
        self._nonempty.set()
        return True

    async def get(self) -> Transaction:
        while not self._items:
            self._nonempty.clear()
            await self._nonempty.wait()
        txn = self._items.popleft()
        if len(self._items) < self.maxlen:
            self._room.set()
        return txn

    def push_front(self, txn: Transaction) -> None:
        """Put back a transaction taken too early (may exceed maxlen briefly; the fan-out sees full)."""
        self._items.appendleft(txn)
        self._nonempty.set()

    def peek(self, limit: int) -> Iterator[Transaction]:
        """The first `limit` queued transactions, left in the queue."""
        return itertools.islice(self._items, limit)

    def take(self, limit: int) -> list[Transaction]:
        """Up to `limit` queued transactions, without waiting."""
        out: list[Transaction] = []
        while self._items and len(out) < limit:
            out.append(self._items.popleft())
        if len(self._items) < self.maxlen:
            self._room.set()
        return out

    async def wait_room(self) -> None:
        await self._room.wait()

    @property
    def full(self) -> bool:
        return len(self._items) >= self.maxlen

    def clear(self) -> None:
        for txn in self._items:
            release(txn)  # a transaction spilled to disk: this link no longer needs its file
        self._items.clear()
        self._room.set()
        self.drop_side()
        self.cleared += 1
        self._side_ready.set()  # wakes the applier's side watch: what it started may never come

    def offer_side(self, item: EarlyStream) -> None:
        """Announce a streamed transaction in progress (the caller acquired its file for this link).
        One waits here at most (the applier takes one at a time): a link that is down keeps no file."""
        if self._side is not None:
            item.spill.release()
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
            item.spill.release()

    def oldest_commit_time(self) -> int | None:
        return self._items[0].commit_time if self._items else None


_NOT_COMMITTED = "pgmesh: the transaction before this one did not commit; "
# A session that may hold the source's origin (a lane, the side session) lets it go after a failure.
_LET_ORIGIN_GO = ("SELECT pg_catalog.pg_replication_origin_session_reset()"
                  " WHERE pg_catalog.pg_replication_origin_session_is_setup()")


class _Lane:
    """One session of a link's parallel apply, with its own prepared statements."""

    __slots__ = ("conn", "prepared")

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self.prepared = Prepared()


class _Abandoned(Exception):
    """A transaction handed out before its commit that the source lost (it is sent again, whole)."""

    def __init__(self, txn: Transaction) -> None:
        super().__init__(f"transaction {txn.xid} abandoned before its commit")
        self.txn = txn


class _SideStop(Exception):
    """The side session gives up on its transaction (it is applied the normal way at its commit)."""


class _Side:
    """A streamed transaction applied before its commit on a session of its own (Applier._side_apply)."""

    __slots__ = ("conn", "finishing", "generation", "item", "prepared", "tables", "task", "why")

    def __init__(self, item: EarlyStream, generation: int) -> None:
        self.item = item
        self.generation = generation  # LinkQueue.cleared when it began
        self.conn: asyncpg.Connection | None = None
        self.prepared = Prepared()
        self.tables: set[tuple[str, str]] = set()  # every table it may have locked
        self.task: asyncio.Task[None] | None = None
        self.finishing = False  # the main session is committing it (or taking it over)
        self.why: str | None = None  # why it stopped short

    @property
    def spill(self) -> SpillFile:
        spill: SpillFile = self.item.spill
        return spill


def _side_check(part: list[Change]) -> None:
    """What the side session does not take: a TRUNCATE (an exclusive lock for the whole stream), a
    logical message (DDL goes the careful way). A subtransaction's changes it takes: one aborted after
    they spilled is listed in the commit's `aborted_subxids`, and the side transaction is then rolled
    back (`_side_apply`)."""
    for change in part:
        kind = type(change)
        if kind is Truncate or kind is Message:
            raise _SideStop("it has a TRUNCATE or a logical message")


async def _once(data: bytes) -> AsyncIterator[bytes]:
    """`data` as an asynchronous iterable: asyncpg's COPY then sends it as it is (a file-like object
    would be read in a worker thread, chunk by chunk)."""
    yield data


async def _take_origin(conn: asyncpg.Connection, origin: str) -> None:
    """Set the session up with `origin`; a session that just ended may not have let it go yet (a moment
    is allowed for that)."""
    for attempt in range(50):
        try:
            await conn.execute("SELECT pg_catalog.pg_replication_origin_session_setup($1)", origin)
            return
        except asyncpg.ObjectInUseError:
            if attempt == 49:
                raise
            await asyncio.sleep(0.1)


class _Gone(Exception):
    """A spill file read before its transaction's commit was abandoned (aborted, or sent again)."""


async def _growing_parts(
    txn: Transaction, relations: dict[int, Relation]
) -> AsyncGenerator[tuple[list[Change], Transaction | None], None]:
    """The changes of `txn`, read before its commit while its spill file grows: parts of
    LARGE_PART_CHANGES as they are written, then the rest with the in-memory tail once the commit
    arrived; each part with the whole Transaction once the commit is there (None before). Before each
    part, `relations` gets the relations the source learnt meanwhile (`txn.relations` is the source
    assembler's own dict: it grows as later changes name more). Raises _Gone when the file is
    abandoned before the commit."""
    spill = txn.spill
    live = txn.relations
    changed = spill.changed
    assert changed is not None
    pending: list[Change] = []
    pos = 0
    while True:
        changed.clear()
        final = spill.final
        if spill.abandoned and final is None:
            raise _Gone
        try:
            got, pos = spill.read_frames(pos, LARGE_PART_CHANGES)
        except PgmeshError:
            if spill.abandoned:
                raise _Gone from None
            raise
        pending += got
        whole = final is not None and pos >= spill.size
        if whole:
            assert final is not None
            pending += final.changes  # the tail that never spilled
        while pending and (len(pending) >= LARGE_PART_CHANGES or whole):
            part = pending[:LARGE_PART_CHANGES]
            del pending[:LARGE_PART_CHANGES]
            for relid, relation in live.items():
                relations.setdefault(relid, relation)
            yield part, final
        if whole:
            return
        if not got:
            await changed.wait()


def _whole(txn: Transaction) -> Transaction:
    """The whole transaction for one handed out before its commit, once the commit arrived."""
    spill = txn.spill
    if spill is not None and spill.early and spill.final is not None:
        whole: Transaction = spill.final
        return whole
    return txn


def _large(txn: Transaction) -> bool:
    """Applied alone, in parts, with COPY for runs of inserts (Applier._apply_large)."""
    return txn.row_count > KEY_LOCKS_MAX or txn.spilled > 0


LARGE_PART_CHANGES = 50_000  # changes of a large transaction turned into SQL / COPY at once


def _parts(txn: Transaction) -> Iterator[list[Change]]:
    """The transaction's changes in parts of at most LARGE_PART_CHANGES (read back from the spool
    when it spilled to disk)."""
    yield from iter_chunks(txn, max_changes=LARGE_PART_CHANGES)


def asyncpg_connect_args(dsn: str) -> dict[str, Any]:
    """libpq keyword/URI DSN -> asyncpg.connect keyword arguments."""
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    args: dict[str, Any] = {}
    mapping = {"host": "host", "port": "port", "user": "user", "password": "password", "dbname": "database"}
    for key, target in mapping.items():
        if params.get(key) is not None:
            args[target] = params[key]
    if "port" in args:
        args["port"] = int(str(args["port"]).split(",")[0])
    if params.get("sslmode") is not None:
        args["ssl"] = params["sslmode"]
    if params.get("connect_timeout") is not None:
        args["timeout"] = float(str(params["connect_timeout"]))
    return args


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
        self._drift: Drift = {}  # columns renamed or dropped here by DDL (router.ddl.reconcile)
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
        # Parallel apply (router.parallel): sessions besides the main one; the main session holds the
        # source's replication origin except while lanes run (then each takes it just to commit).
        self.lanes = max(1, config.replication.apply_lanes)
        self._extra: list[_Lane] = []
        self._origin_held = False
        self._installed_at: str | None = None
        self._lane_key = zlib.crc32(self.origin.encode()) & 0x7FFFFFFF
        self._seq = 0
        self._sequential_next = False
        self.parallel_batches = 0
        self.parallel_transactions = 0
        # Streamed transactions applied before their commit on a side session (see the module doc).
        self._side: _Side | None = None
        self._main_tables: frozenset[tuple[str, str]] = frozenset()  # the main session's batch writes these
        self._main_idle = asyncio.Event()
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
        self._drop_side("the link was paused")  # holds no transaction open while paused
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
        self._drop_side("the link paused on an error")
        logger.error("link %s paused: %s (fix it, then `pgmesh resume`)", self.name, self.last_error)

    async def _connect(self) -> None:
        self._conn = await asyncpg.connect(**asyncpg_connect_args(self.target.dsn))
        self._prepared = Prepared()  # a new session has no prepared statements
        self._ahead = {}
        await self._conn.execute(_SESSION_SETUP)
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
            # the columns pgmesh's tombstone trigger keys deletions by (router.conflict_catalog)
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
        self._drop_side("the link reconnects")
        conns = [lane.conn for lane in self._extra]
        self._extra = []
        for extra in conns:
            extra.terminate()
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
        watch = asyncio.create_task(self._watch_side(), name=f"side watch {self.name}")
        try:
            await self._apply_loop()
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            self._drop_side("the link stopped")

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
                    self._main_tables = frozenset()
                    self._main_idle.set()
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
            if has_ddl(txn) or _large(txn):
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
                if has_ddl(txn) or _large(txn):
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
        if self._side is not None:
            self._gate_side(batch)
        if self.lanes > 1 and len(batch) > 1 and not self._sequential_next and not _large(batch[0]):
            try:
                done = await self._apply_parallel(batch)
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
            if _large(batch[0]):
                batch[0] = await self._apply_large(batch[0])  # the whole one, if it came early
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
        except _Abandoned as gone:
            await self._after_failure()  # rolls back what was applied of it
            if self._held and (self._held[0] is gone.txn or self._held[0] is _whole(gone.txn)):
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

    async def _apply_large(self, txn: Transaction) -> Transaction:
        """A transaction with more row changes than KEY_LOCKS_MAX, alone: its runs of inserts go in by
        COPY where no conflict can hide from it (router.statements.CopyRun); a transaction spilled to
        disk is read back part by part, all in one target transaction. Returns the transaction applied
        (for one handed out before its commit: the whole one, see `_apply_growing`)."""
        spill = txn.spill
        if spill is not None and spill.early and spill.final is not txn:
            return await self._apply_growing(txn)
        side = self._side
        if side is not None and spill is not None and side.spill is spill:  # applied ahead: commit it
            committed = await self._finish_side(side, txn)
            if committed:
                self.copied_transactions += 1
                return txn
        relations = dict(txn.relations)
        tombstones: dict[str, bool] = {}
        parts = _parts(txn)
        first = True
        part: list[Change] | None = next(parts)
        while part is not None:
            following: list[Change] | None = next(parts, None)
            await self._apply_part(txn, part, relations, tombstones, first, following is None)
            first = False
            part = following
        self.copied_transactions += 1
        return txn

    async def _apply_growing(self, txn: Transaction) -> Transaction:
        """A plain transaction that router.source handed out at its first spill, before its commit:
        applied part by part as its spill file grows, in one target transaction that commits once the
        commit has arrived (the origin's xact_setup, which needs the commit's end LSN, goes just before
        COMMIT). If the source loses it first (a reconnect), raises _Abandoned: the caller rolls back,
        and the transaction comes again, whole. On a conflict, waits for the whole transaction before
        raising, so that the careful path gets it (`self._held[0]` becomes the whole one)."""
        spill = txn.spill
        conn = self._conn
        assert spill is not None and conn is not None
        relations = dict(txn.relations)
        tombstones: dict[str, bool] = {}
        first = True
        try:
            async with contextlib.aclosing(_growing_parts(txn, relations)) as parts:
                async for part, final in parts:
                    if first and final is None:
                        self.early_transactions += 1
                    await self._apply_part(txn, part, relations, tombstones, first, False, setup=False)
                    first = False
            final = spill.final
            assert final is not None
            whole_txn: Transaction = final
            await conn.execute(f"{xact_setup_sql(whole_txn)};\nCOMMIT")
        except _Gone:
            raise _Abandoned(txn) from None
        except asyncpg.PostgresError:
            while spill.final is None and not spill.abandoned:
                spill.changed.clear()
                await spill.changed.wait()
            if spill.final is None:
                raise _Abandoned(txn) from None
            if self._held and self._held[0] is txn:
                self._held[0] = spill.final  # the careful path takes the whole transaction
            raise
        self.copied_transactions += 1
        return whole_txn

    async def _apply_part(
        self,
        txn: Transaction,
        part: list[Change],
        relations: dict[int, Relation],
        tombstones: dict[str, bool],
        first: bool,
        last: bool,
        *,
        setup: bool = True,
        side: _Side | None = None,
    ) -> None:
        """One part of a large transaction (`first` opens the target transaction, `last` commits it).
        `setup` False leaves the origin's xact_setup out of the first part: `_apply_growing` sends it
        with its own COMMIT (the end LSN is not known before). With `side`, on the side session."""
        conn = self._conn if side is None else side.conn
        prepared = self._prepared if side is None else side.prepared
        assert conn is not None
        prelude: list[str] = []
        # A part of a large transaction locks whole tables, however few rows it has itself.
        piece = msgspec.structs.replace(
            txn, changes=part, relations=relations, row_count=max(txn.row_count, KEY_LOCKS_MAX + 1)
        )
        mark = prepared.mark()
        try:
            segments = self._segments(piece, prelude, relations, first, last, setup, prepared)
        except ApplyError:
            if not first or side is not None:
                raise
            await self._load_tables()  # the target's schema may have changed since we looked
            segments = self._segments(piece, prelude, relations, first, last, setup, prepared)
        try:
            if prelude:
                await conn.execute("".join(f"{p};\n" for p in prelude))
            for segment in segments:
                if isinstance(segment, str):
                    await conn.execute(segment)
                else:
                    await self._copy(conn, segment, tombstones)
        except BaseException:
            prepared.forget_since(mark)
            raise

    def _segments(
        self, txn: Transaction, prelude: list[str], relations: dict[int, Relation], begin: bool, commit: bool,
        setup: bool = True, prepared: Prepared | None = None,
    ) -> list[str | CopyRun]:
        def build(t: Transaction) -> list[str | CopyRun]:
            return transaction_segments(
                t, self._tables, prepared=prepared or self._prepared, guard_origin=self._source_origin,
                prelude=prelude,
                relations=relations, begin=begin, commit=commit, setup=setup,
            )

        saved = dict(relations)
        try:
            return build(txn)
        except ApplyError:
            fitted = self._fit(txn)
            if fitted is txn:
                raise
            relations.clear()
            relations.update(saved)
            return build(fitted)

    async def _copy(self, conn: asyncpg.Connection, run: CopyRun, tombstones: dict[str, bool]) -> None:
        """One run of inserts by COPY, or by guarded INSERTs when the table has tombstones (a row
        deleted recently may be among them: decided as a conflict)."""
        if run.check_tombstones:
            name = run.table.name
            if name not in tombstones:
                tombstones[name] = bool(await conn.fetchval(
                    "SELECT EXISTS (SELECT 1 FROM pgmesh.tombstones WHERE table_name = $1)", name
                ))
            if tombstones[name]:
                await conn.execute(run.fallback())
                return
        schema, table = run.schema_and_name
        await conn.copy_to_table(table, schema_name=schema, columns=run.columns, source=_once(run.data()),
                                 format="text")
        self.copied_rows += len(run.rows)

    # ------------------------------------------------------------ streamed transactions, early

    def _side_wanted(self) -> bool:
        return (self.config.replication.early_apply and self.apply_delay <= 0 and self._conn is not None
                and self._resumed.is_set() and self._side is None)

    async def _watch_side(self) -> None:
        """Start a side session on each announced streamed transaction (one at a time); drop one whose
        commit will not come to this link (aborted, resent, the link re-reads, applied already)."""
        while True:
            item = await self.queue.get_side(1.0)
            self._check_side()
            if item is None:
                continue
            if not self._side_wanted() or item.spill.abandoned or item.spill.deleted:
                item.spill.release()
                continue
            side = self._side = _Side(item, self.queue.cleared)
            self.early_streams += 1
            side.task = asyncio.create_task(self._run_side(side), name=f"side apply {self.name}")

    def _check_side(self) -> None:
        side = self._side
        if side is None or side.finishing:
            return
        final = side.spill.final
        if side.spill.abandoned:
            self._drop_side("the source transaction was aborted, or it will be sent again")
        elif self.queue.cleared != side.generation:
            self._drop_side("the link re-reads its source")
        elif final is not None and final.end_lsn <= self.progress.applied:
            self._drop_side("the target has it already")

    async def _run_side(self, side: _Side) -> None:
        try:
            await self._side_apply(side)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            side.why = str(exc) if isinstance(exc, _SideStop) else describe(exc)
            conn, side.conn = side.conn, None
            if conn is not None:
                conn.terminate()  # rolls its transaction back
            if not side.finishing and self._side is side:
                self._drop_side(side.why)

    async def _side_apply(self, side: _Side) -> None:
        """Apply the announced transaction as its spill file grows, in one target transaction left
        open (the main session commits it: `_finish_side`). Returns once all of it is applied."""
        spill, txn = side.spill, side.item.txn
        conn = side.conn = await asyncpg.connect(**asyncpg_connect_args(self.target.dsn))
        await conn.execute(_SESSION_SETUP)
        # Its rows are written under an origin of their own (the main session holds the source's): the
        # target's walsender streams them as an echo, not as a transaction of this node.
        early = self.config.early_origin_name(self.source)
        await conn.execute("SELECT pg_catalog.pg_replication_origin_create($1)"
                           " WHERE pg_catalog.pg_replication_origin_oid($1) IS NULL", early)
        await _take_origin(conn, early)
        if self._installed_at:
            await conn.execute("SELECT set_config('pgmesh.installed_at', $1, false)", self._installed_at)
        relations = dict(txn.relations)
        tombstones: dict[str, bool] = {}
        first = True
        try:
            async with contextlib.aclosing(_growing_parts(txn, relations)) as parts:
                async for part, final in parts:
                    if spill.abandoned:
                        raise _Gone
                    if final is not None and final.aborted_subxids:
                        raise _SideStop("a subtransaction of it was aborted")
                    _side_check(part)
                    await self._side_tables(side, relations)
                    await self._apply_part(txn, part, relations, tombstones, first, False, setup=False,
                                           side=side)
                    first = False
        except _Gone:
            raise _SideStop("the source transaction was aborted, or it will be sent again") from None
        if first:
            raise _SideStop("nothing of it was applied before its commit")

    async def _side_tables(self, side: _Side, relations: dict[int, Relation]) -> None:
        """Before the side session locks a table, wait until the main session's batch is not writing it."""
        new = {(r.schema, r.name) for r in relations.values()} - side.tables
        while new & self._main_tables:
            self._main_idle.clear()
            await self._main_idle.wait()
        side.tables |= new

    def _gate_side(self, batch: list[Transaction]) -> None:
        """The main session is about to apply `batch`: if what comes before the side transaction's commit
        writes a table the side transaction holds (or runs DDL), the side transaction is rolled back,
        else the side session keeps off those tables until the batch is done."""
        side = self._side
        if side is None or side.finishing:
            return
        names: set[tuple[str, str]] = set()
        for txn in batch:
            if txn.spill is side.spill:
                break
            if has_ddl(txn):
                self._drop_side("DDL comes before its commit")
                return
            names.update((r.schema, r.name) for r in txn.relations.values())
        if names & side.tables:
            self._drop_side("a transaction that commits before it writes the same tables")
            return
        self._main_tables = frozenset(names)
        self._main_idle.set()  # the side session re-checks: what it waited for may be free now

    async def _finish_side(self, side: _Side, txn: Transaction) -> bool:
        """`txn`'s commit is next: commit the side session's transaction now, under the origin (handed
        over by the main session); False when it cannot be (the caller applies `txn` the normal way)."""
        main = self._conn
        assert main is not None
        side.finishing = True
        committed = False
        self._main_tables = frozenset()  # the main session writes nothing until this is done
        self._main_idle.set()
        try:
            if side.task is not None:
                await asyncio.wait({side.task})
            conn = side.conn
            if side.why is not None or conn is None:
                return False
            if self._origin_held:
                await main.execute("SELECT pg_catalog.pg_replication_origin_session_reset()")
                self._origin_held = False
            try:
                await conn.execute(
                    "SELECT pg_catalog.pg_replication_origin_session_reset();\n"
                    f"SELECT pg_catalog.pg_replication_origin_session_setup({quote_literal(self.origin)});\n"
                    f"{xact_setup_sql(txn)};\nCOMMIT;\n"
                    "SELECT pg_catalog.pg_replication_origin_session_reset()"
                )
                committed = True
            except asyncpg.PostgresError as exc:
                side.why = f"its commit failed: {describe(exc)}"
                with contextlib.suppress(Exception):
                    await conn.execute(f"ROLLBACK;\n{_LET_ORIGIN_GO}")
            except (OSError, asyncpg.InterfaceError) as exc:
                side.why = f"its session was lost while committing: {describe(exc)}"
                conn.terminate()
                side.conn = None
                await self._hold_origin()
                row = await main.fetchval(
                    "SELECT pg_catalog.pg_replication_origin_progress($1, false)::text", self.origin
                )
                committed = bool(row) and parse_lsn(row) >= txn.end_lsn
            return committed
        finally:
            self._drop_side(side.why, committed=committed)
            await self._hold_origin()

    def _drop_side(self, why: str | None, *, committed: bool = False) -> None:
        """End the side session: its transaction committed, or rolled back (`why`)."""
        side, self._side = self._side, None
        if side is None:
            return
        self._main_idle.set()
        task = side.task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        conn, side.conn = side.conn, None
        if conn is not None:
            conn.terminate()
        side.spill.release()
        if committed:
            self.early_streams_committed += 1
            return
        self.early_streams_dropped += 1
        logger.info("link %s: streamed transaction %s no longer applied ahead of its commit: %s", self.name,
                    side.item.txn.xid, why or "stopped")

    # ------------------------------------------------------------ parallel apply

    async def _hold_origin(self) -> None:
        """The main session takes the source's origin back after lanes or a side session had it (a
        session that just ended may not have let it go yet: a moment is allowed for that)."""
        if self._origin_held or self._conn is None:
            return
        await _take_origin(self._conn, self.origin)
        self._origin_held = True

    async def _lanes(self) -> list[_Lane]:
        """Lane 0 is the main session; the others are opened on first use."""
        assert self._conn is not None
        while len(self._extra) < self.lanes - 1:
            conn = await asyncpg.connect(**asyncpg_connect_args(self.target.dsn))
            try:
                await conn.execute(_SESSION_SETUP)
                if self._installed_at:
                    await conn.execute(
                        "SELECT set_config('pgmesh.installed_at', $1, false)", self._installed_at
                    )
            except BaseException:
                conn.terminate()
                raise
            self._extra.append(_Lane(conn))
        main = _Lane(self._conn)
        main.prepared = self._prepared
        return [main, *self._extra]

    async def _apply_parallel(self, batch: list[Transaction]) -> int:
        """Run the batch's first transactions on several sessions at once, committed in source order;
        return how many are applied (0: none ran, the caller applies the batch one by one).

        Each transaction i holds a session advisory lock s_i from before any lane starts until just
        after its COMMIT. A transaction whose predecessor runs in another lane waits for s_(i-1), then
        checks that the origin's progress reached the predecessor's end (a lane that died releases its
        locks without committing: its successors must not commit either). Every lane takes the origin
        just to commit and gives it back at once (PostgreSQL 15: one session per origin at a time).
        """
        small = list(itertools.takewhile(lambda t: not _large(t), batch))
        lanes_of = plan_lanes(small, self._tables, self.lanes)
        if len(set(lanes_of)) < 2:
            return 0
        lanes = await self._lanes()
        key, origin = self._lane_key, quote_literal(self.origin)
        preludes: dict[int, list[str]] = {lane: [] for lane in set(lanes_of)}
        scripts: dict[int, list[str]] = {lane: [] for lane in set(lanes_of)}
        seqs: list[int] = []
        txns: list[Transaction] = []
        for i, (txn, lane) in enumerate(zip(batch, lanes_of, strict=False)):
            seq = (self._seq + i) % 0x7FFFFFFF
            before = [f"SELECT pg_catalog.pg_replication_origin_session_setup({origin})"]
            if i and lanes_of[i - 1] != lane:
                before.insert(0, f"SELECT pg_catalog.pg_advisory_xact_lock_shared({key}, {seqs[-1]})")
                before.append(
                    f"SELECT CASE WHEN pg_catalog.pg_replication_origin_progress({origin}, false)"
                    f" >= '{format_lsn(txns[-1].end_lsn)}'::pg_lsn THEN 0 ELSE ('{_NOT_COMMITTED}'"
                    " || pg_catalog.now())::int END"
                )
            after = (f"SELECT pg_catalog.pg_replication_origin_session_reset();\n"
                     f"SELECT pg_catalog.pg_advisory_unlock({key}, {seq})")
            try:
                (script,) = transaction_segments(
                    self._fit(txn), self._tables, prepared=lanes[lane].prepared,
                    guard_origin=self._source_origin, prelude=preludes[lane], copy=False,
                    at_commit=(";\n".join(before), after),
                )
            except ApplyError:
                break  # the one-by-one path deals with it
            assert isinstance(script, str)
            scripts[lane].append(script)
            seqs.append(seq)
            txns.append(txn)
        used = {lane for lane, lane_scripts in scripts.items() if lane_scripts}
        if len(used) < 2:
            return 0
        self._seq += len(txns)
        # Every lane's locks are held before any lane starts.
        reset = "SELECT pg_catalog.pg_replication_origin_session_reset();\n" if self._origin_held else ""
        self._origin_held = False
        locks = {lane: [s for s, on in zip(seqs, lanes_of, strict=False) if on == lane] for lane in used}
        await asyncio.gather(*(
            lanes[lane].conn.execute(
                (reset if lane == 0 else "")
                + "SELECT " + ", ".join(f"pg_catalog.pg_advisory_lock({key}, {s})" for s in locks[lane])
            )
            for lane in used
        ))
        results = await asyncio.gather(*(
            self._run_lane(lanes[lane].conn, "".join(f"{p};\n" for p in preludes[lane])
                           + "\n".join(scripts[lane]))
            for lane in used
        ))
        await self._hold_origin()
        assert self._conn is not None
        row = await self._conn.fetchval(
            "SELECT pg_catalog.pg_replication_origin_progress($1, false)::text", self.origin
        )
        done = parse_lsn(row) if row else 0
        applied = [txn for txn in txns if txn.end_lsn <= done]
        for txn in applied:
            self._applied(txn)
        self.parallel_batches += 1
        self.parallel_transactions += len(applied)
        if any(exc is not None for exc in results):
            self._sequential_next = True  # the transaction that failed goes the careful way, alone
        return len(applied)

    async def _run_lane(self, conn: asyncpg.Connection, script: str) -> asyncpg.PostgresError | None:
        """One lane's script; on an error, roll back and free the origin and every lock it holds (its
        successors then see that it did not commit, and stop)."""
        try:
            await conn.execute(script)
        except asyncpg.PostgresError as exc:
            with contextlib.suppress(asyncpg.PostgresError):
                await conn.execute("ROLLBACK")
            await conn.execute(f"{_LET_ORIGIN_GO};\nSELECT pg_catalog.pg_advisory_unlock_all()")
            if _NOT_COMMITTED not in str(exc):
                logger.debug("link %s: a lane stopped: %s", self.name, describe(exc))
            return exc
        return None

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
            self._held = [_whole(t) for t in self._held]
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
