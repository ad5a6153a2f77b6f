"""What the apply helpers get of their link: `LinkSession`, the link's main session on the target and its
view of the target, a narrow handle instead of the `Applier`.

The applier (router.apply.applier) creates one per link and hands it to its helpers (router.apply.lanes,
router.apply.large, router.apply.side). It holds the main session (`conn`), whether that session holds
the source's replication origin (`origin_held`; one session per origin at a time, PostgreSQL 15), the
session's prepared statements, the target's tables and the columns DDL renamed or dropped there
(`drift`), the source's origin id here (the guards' `guard_origin`), `installed_at` (set up in every
session), the scripts built ahead for the next batch (`ahead`, thrown away whenever the tables are read
again), and the link's counters (`stats`). Its methods: open and close the main session, read the
target's tables and origins, fit a transaction to the target after DDL, take and let go the origin,
read the origin's progress, and open another session set up alike.

Must not: apply, retry, pause, or decide anything about the loop (what a helper decides for the loop
comes back to the applier as a return value).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import asyncpg

from protocol.lsn import datetime_to_pg_us, parse_lsn
from protocol.messages import Insert, Message, Relation
from protocol.transactions import Transaction
from router.apply.decide import Decisions, session_settings
from router.apply.pipe import Pipe
from router.apply.prepared import Prepared
from router.apply.scripts import ORIGIN_MARK, transaction_script
from router.apply.sessions import open_session, take_origin
from router.apply.shapes import Statements
from router.apply.state import LinkStats
from router.apply.statements import TargetTable, UniqueIndex, quote_ident, quote_literal
from router.config.model import Config, NodeConfig
from router.ddl.messages import DDL_PREFIX, ddl_command, describe_command
from router.ddl.reconcile import Drift, reconcile
from router.errors import ApplyError, ConnectionLost, describe, sqlstate_of
from router.progress.applied import MARK_START, position_sql
from router.stream.items import ORIGIN_NONE_SINCE
from router.stream.seen import APPLIED_PREFIX, applied_content

__all__ = ["LinkSession"]

logger = logging.getLogger(__name__)

LOST_LOG_S = 60.0  # inserts lost to key collisions are logged at most this often per link and table

# Tables with a deferrable constraint or constraint trigger (a DEFERRABLE foreign key, on either side, a
# deferrable unique key): checked at COMMIT unless a transaction makes them immediate (router.apply.scripts)
_DEFERRABLE_QUERY = """
SELECT DISTINCT n.nspname, c.relname FROM pg_catalog.pg_trigger t
JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE t.tgdeferrable
"""

# Columns renamed or dropped by DDL on the target, oldest first (router.ddl.capture).
_DRIFT_QUERY = """
SELECT table_name, old_name, new_name FROM pgmesh.column_changes
WHERE to_regclass('pgmesh.column_changes') IS NOT NULL ORDER BY at
"""

# Every replicated-table candidate on the target: columns with types (in attnum order; whether each is an
# identity GENERATED ALWAYS, whether generated: STORED, or VIRTUAL on 18, written by no apply), primary key,
# the other unique keys (plain column lists, not partial, not on expressions), and the unique indexes
# with a predicate or on expressions (their key terms and predicate deparsed: statements.UniqueIndex).
_TABLES_QUERY = """
SELECT n.nspname, c.relname,
  (SELECT jsonb_agg(jsonb_build_array(a.attname, format_type(a.atttypid, a.atttypmod),
       CASE WHEN t.typtype = 'd' THEN format_type(t.typbasetype, t.typtypmod) END, a.attidentity = 'a',
       a.attgenerated <> '')
       ORDER BY a.attnum)
     FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_type t ON t.oid = a.atttypid
     WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped)::text,
  (SELECT coalesce(jsonb_agg(jsonb_build_array(i.indisprimary, i.indisreplident, (
       SELECT jsonb_agg(a.attname ORDER BY k.ord)
       FROM unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
       JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum), i.indimmediate)),
     '[]')
     FROM pg_catalog.pg_index i
     WHERE i.indrelid = c.oid AND i.indisunique AND i.indpred IS NULL AND i.indexprs IS NULL)::text,
  c.relkind = 'p',
  (SELECT coalesce(jsonb_agg(jsonb_build_array(
       (SELECT jsonb_agg(pg_catalog.pg_get_indexdef(i.indexrelid, k.k, true) ORDER BY k.k)
        FROM pg_catalog.generate_series(1, i.indnkeyatts) AS k(k)),
       pg_catalog.pg_get_expr(i.indpred, i.indrelid, true)) ORDER BY i.indexrelid), '[]')
     FROM pg_catalog.pg_index i
     WHERE i.indrelid = c.oid AND i.indisunique AND (i.indpred IS NOT NULL OR i.indexprs IS NOT NULL))::text
FROM pg_catalog.pg_class c
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p') AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'pgmesh')
  AND n.nspname NOT LIKE 'pg\\_%'
"""

_PROGRESS = f"SELECT {position_sql('$1', '$2', False)}::text"
_RESET = "SELECT pg_catalog.pg_replication_origin_session_reset()"


class LinkSession:
    """One link's main session on its target and its view of that target (see the module docstring)."""

    __slots__ = (
        "ahead", "announce", "config", "conflicts", "conn", "ddl_conn", "decisions", "drift", "dropped",
        "history_at", "installed_at", "lost_inserts", "lost_logged", "mark", "name", "origin", "origin_held",
        "pipe", "prepared", "settings", "setup_last", "source", "source_conn", "source_origin", "statements",
        "stats", "tables", "target",
    )

    def __init__(self, config: Config, source: str, target: NodeConfig, stats: LinkStats) -> None:
        self.config = config
        self.source = source
        self.target = target
        self.origin = config.origin_name(source)
        self.name = f"{source} -> {target.name}"
        self.stats = stats
        self.conn: asyncpg.Connection | None = None
        # the router ended the session itself (`drop`): whatever its statement in flight raised, the
        # link opens it again (asyncpg may raise AttributeError from a session terminated under it)
        self.dropped = False
        self.origin_held = False
        self.announce = False  # ends each batch with an APPLIED_PREFIX message (`applied_note`)
        # the origin's set-up just before COMMIT (router.apply.scripts): on PostgreSQL 16+ a rollback
        # after it moves the origin; on 15 it goes with the first statement (one statement fewer)
        self.setup_last = True
        # every set-up also sets the source's applied mark (router.progress.applied): 16+, as `setup_last`
        self.mark = False
        self.decisions = Decisions(config)
        self.prepared = Prepared(self.decisions)
        # what the decision functions need of every session (router.apply.decide), once origins are read
        self.settings = ""
        # (table, conflict type) -> conflicts decided on the target by the decision functions
        self.conflicts: dict[tuple[str, str], int] = {}
        self.history_at: int | None = None  # conflict_history's last id counted (None: not read yet)
        # table -> inserts lost to key collisions (`count_conflicts`), and when each was last logged
        self.lost_inserts: dict[str, int] = {}
        self.lost_logged: dict[str, float] = {}
        self.source_conn: asyncpg.Connection | None = None  # opened to read a row there (read_source)
        self.ddl_conn: asyncpg.Connection | None = None  # creates decision functions (make_functions)
        self.tables: dict[tuple[str, str], TargetTable] = {}
        self.drift: Drift = {}  # columns renamed or dropped here by DDL (router.ddl.reconcile)
        self.source_origin: int | None = None
        self.installed_at: str | None = None
        # Scripts built while the previous batch ran on the target, by id() (router.apply.sender).
        self.ahead: dict[int, tuple[Transaction, str]] = {}
        # the pipelined session (router.apply.pipe), opened when the link connects, and its statements
        self.pipe: Pipe | None = None
        self.statements: Statements | None = None

    @property
    def connected(self) -> bool:
        return self.conn is not None and not self.conn.is_closed()

    async def open(self) -> int:
        """Open the main session, holding the source's origin; returns the origin's progress here."""
        self.dropped = False
        self.conn = await open_session(  # installed_at: set by load_origins
            self.target.dsn, source=self.source,
            synchronous_commit=self.config.apply_synchronous_commit(self.target.name),
        )
        self.prepared = Prepared(self.decisions)  # a new session has no prepared statements
        self.ahead = {}
        # all three for 16+: its stream leaves echoes out, and a rollback after the set-up moves the origin
        self.announce = self.setup_last = self.mark = (
            self.conn.get_server_version().major * 10_000 >= ORIGIN_NONE_SINCE
        )
        if self.mark:
            await self.conn.execute(MARK_START, self.origin, self.source)
        await self.conn.execute("SELECT pg_catalog.pg_replication_origin_session_setup($1)", self.origin)
        self.origin_held = True
        return await self.origin_progress()

    def forget_prepared(self) -> None:
        """After a rolled-back transaction: a decision function created in it is gone (a CREATE runs in
        the transaction it is sent in, a PREPARE outlives it), so the session's prepared statements and
        the functions they call start again, under new names (the old statements stay, never run again)."""
        self.prepared = Prepared(self.decisions, after=self.prepared)
        self.ahead = {}

    def contest(self, txn: Transaction, exc: BaseException) -> None:
        """When `exc`, which rolled `txn`'s batch back, is a unique violation: the tables `txn` inserts into
        decide insert_exists in their single inserts' statements from now on (Decisions.contested), with
        the statements prepared after it (`forget_prepared`, which a rolled-back batch runs)."""
        if sqlstate_of(exc) != _UNIQUE_VIOLATION:
            return
        relations = txn.relations
        for change in txn.changes:
            if isinstance(change, Insert) and change.relid in relations:
                relation = relations[change.relid]
                self.decisions.contested.add(f"{relation.schema}.{relation.name}")
        if self.statements is not None:  # its inserts' statements change
            self.statements.reset()

    def script(self, txn: Transaction, prelude: list[str]) -> str:
        """`txn`'s target transaction, as the main session runs it in a batch (router.apply.scripts)."""
        return transaction_script(txn, self.tables, prepared=self.prepared, guard_origin=self.source_origin,
                                  prelude=prelude, remote=self.decisions.remote, setup_last=self.setup_last,
                                  mark=self.mark)

    def applied_note(self, batch: Sequence[Transaction]) -> str:
        """SQL to end `batch` with on a target whose own stream leaves echoes out (pgoutput's `origin
        'none'`, PostgreSQL 16+): a non-transactional message, without the source's origin (else it
        would be left out too), saying the newest commit time of the source applied here so far; the
        target's stream shows it after the batch's commits (router.stream.seen, APPLIED_PREFIX). The
        origin is taken again in the same statement (its calls run in order). For the main session, which
        holds the origin; every path that commits applied transactions ends with one (a batch, a large
        transaction, the careful path, lanes, the side session: `applied_message`)."""
        message = self.applied_message(batch)
        if not message:
            return ""
        return (
            "\nSELECT pg_catalog.pg_replication_origin_session_reset(),"
            f" {message},"
            f" pg_catalog.pg_replication_origin_session_setup({quote_literal(self.origin)});"
        )

    def applied_message(self, batch: Sequence[Transaction]) -> str:
        """The APPLIED_PREFIX message of `applied_note` alone, as a SELECT item ('' where the target's
        stream shows echoes, or for nothing), for a session that holds no origin when it runs it."""
        if not self.announce or not batch:
            return ""
        content = quote_literal(applied_content(self.source, max(t.commit_time for t in batch)))
        return f"pg_catalog.pg_logical_emit_message(false, {quote_literal(APPLIED_PREFIX)}, {content})"

    def built(self, transactions: int) -> None:
        """A batch of `transactions` was built to be sent: scripts built ahead are stale, and the remote
        version is one batch nearer to being left out (router.apply.decide.Decisions.sent)."""
        self.ahead = {}
        self.decisions.sent(transactions)

    def needed_remote(self) -> bool:
        """A decision function lacked the remote version a rolled-back batch left out: the link's
        transactions carry it from now on (router.apply.decide.Decisions.remote); False when they did."""
        if self.decisions.remote:
            return False
        self.decisions.needed_remote()
        self.ahead = {}  # built without it
        return True

    async def deallocate_stale(self) -> None:
        """Drop the main session's statements no cache names any more (`forget_prepared` leaves them):
        else every rolled-back batch would leave its statements behind for the session's life."""
        if not self.connected:
            return
        assert self.conn is not None
        live = set(self.prepared.names())
        rows = await self.conn.fetch(_OURS)
        stale = [str(r[0]) for r in rows if str(r[0]) not in live]
        if stale:
            await self.conn.execute(";\n".join(f"DEALLOCATE {name}" for name in stale))

    async def make_functions(self, prepared: Prepared) -> None:
        """Create the decision functions `prepared`'s new statements call, on a session of their own,
        committed before those statements are sent (router.apply.prepared: `creates`)."""
        creates, prepared.creates = prepared.creates, []
        if not creates:
            return
        fresh = self.ddl_conn is None or self.ddl_conn.is_closed()
        if fresh:
            self.ddl_conn = await open_session(self.target.dsn)
        assert self.ddl_conn is not None
        try:
            if fresh:  # this node's own functions, not DDL to replicate: the capture's event triggers
                # return at once (else each CREATE and ALTER parsed the whole query string: ~0.3 s a link)
                await self.ddl_conn.execute(_DDL_LOCAL)
            await self.ddl_conn.execute(";\n".join(creates))
        except BaseException:
            self.ddl_conn.terminate()
            self.ddl_conn = None
            raise

    async def read_source(self, query: str) -> Mapping[str, Any] | None:
        """One row read on the source node (router.apply.toast), on a session opened at first use."""
        if self.source_conn is None or self.source_conn.is_closed():
            self.source_conn = await open_session(self.config.node(self.source).dsn)
        try:
            row: Mapping[str, Any] | None = await self.source_conn.fetchrow(query)
        except BaseException:
            self.source_conn.terminate()
            self.source_conn = None
            raise
        return row

    def drop(self) -> None:
        """End the main session at once, without a goodbye (the target stopped answering): a statement in
        flight fails and the applier opens the link again, as after any lost connection."""
        if self.conn is not None and not self.conn.is_closed():
            self.dropped = True
            self.conn.terminate()
        if self.pipe is not None:
            self.dropped = True
            self.pipe.terminate()

    async def close(self) -> None:
        """Close the main session (terminated when it does not close in 5 s), and the one on the source."""
        for other in (self.source_conn, self.ddl_conn):
            if other is not None:
                other.terminate()
        self.source_conn = self.ddl_conn = None
        pipe, self.pipe, self.statements = self.pipe, None, None
        if pipe is not None:
            await pipe.close()
        conn, self.conn = self.conn, None
        self.origin_held = False
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 5)
            if not conn.is_closed():
                conn.terminate()

    async def origin_progress(self) -> int:
        """How far the target applied the source: its origin's progress, never past the applied mark
        (router.progress.applied); committed, not necessarily flushed."""
        assert self.conn is not None
        row = await self.conn.fetchval(_PROGRESS, self.origin, self.source)
        return parse_lsn(row) if row else 0

    async def load_tables(self) -> None:
        """Read the target's tables and the columns DDL renamed or dropped there."""
        assert self.conn is not None
        tables = {}
        for schema, name, columns_json, keys_json, partitioned, indexes_json in await self.conn.fetch(
            _TABLES_QUERY
        ):
            columns = json.loads(columns_json or "[]")
            types = {col: kind for col, kind, *_ in columns}
            bases = {col: base for col, _, base, *_ in columns if base}  # of domain columns
            keys = json.loads(keys_json or "[]")
            pk = next((tuple(cols) for primary, _, cols, _ in keys if primary), ())
            replident = next((tuple(cols) for _, ident, cols, _ in keys if ident), ())
            uniques = tuple(tuple(cols) for primary, _, cols, _ in keys if not primary)
            indexes: tuple[UniqueIndex, ...] = tuple((tuple(t), p) for t, p in json.loads(indexes_json))
            table = TargetTable(schema, name, frozenset(types), types, pk, uniques, partitioned=partitioned,
                                bases=bases, indexes=indexes)
            # the columns pgmesh's tombstone trigger keys deletions by (router.conflicts.catalog)
            table.tombstone_key = pk or replident or tuple(c for c, *_, generated in columns if not generated)
            table.identity = replident
            table.deferred = any(primary and not immediate for primary, _, _, immediate in keys)
            table.always = frozenset(col for col, _, _, always, _ in columns if always)  # GENERATED ALWAYS
            table.generated = frozenset(col for col, *_, generated in columns if generated)  # never written
            got = self.target.tables  # a partial target's tables (router.cluster.partial)
            table.skip = got is not None and table.name not in got
            table.filtered = table.name in self.target.rows
            tables[(schema, name)] = table
        for key in await self.conn.fetch(_DEFERRABLE_QUERY):
            if (found := tables.get((key[0], key[1]))) is not None:
                found.deferrable = True
        self.tables = tables
        self.ahead = {}  # built for the tables as they were
        if self.statements is not None:  # the pipe's statements follow the tables too
            self.statements.tables = tables
            self.statements.reset()
        drift: dict[str, dict[str, str | None]] = {}
        for table_name, old, new in await self.conn.fetch(_DRIFT_QUERY):
            drift.setdefault(table_name, {})[old] = new
        self.drift = drift

    async def reload_tables(self) -> None:
        """What the target has now, after DDL (applied or rolled back). The prepared statements start
        again: their SQL follows the target's keys too (a single insert's ON CONFLICT names them)."""
        if self.connected:
            self.forget_prepared()
            await self.deallocate_stale()
            await self.load_tables()

    async def load_origins(self) -> tuple[dict[int, str], int | None]:
        """This source's origin id here (`source_origin`) and `installed_at` (set up in the session);
        returns every pgmesh origin's node by id, and `installed_at` in PostgreSQL microseconds."""
        assert self.conn is not None
        prefix = self.config.origin_name("")
        rows = await self.conn.fetch(
            "SELECT roident, roname FROM pg_catalog.pg_replication_origin WHERE starts_with(roname, $1)",
            prefix,
        )
        nodes = {int(r["roident"]): str(r["roname"])[len(prefix):] for r in rows}
        self.source_origin = next((ident for ident, node in nodes.items() if node == self.source), None)
        installed = await self.conn.fetchval(
            "SELECT CASE WHEN to_regclass('pgmesh.node_info') IS NOT NULL THEN"
            " (SELECT value FROM pgmesh.node_info WHERE key = 'installed_at') END"
        )
        self.installed_at = installed
        self.settings = session_settings(self.source, self.target.name, self.source_origin, prefix)
        await self.conn.execute(self.settings)
        if self.history_at is None:
            await self.count_conflicts()  # where counting starts
        if not installed:
            return nodes, None
        # rows older than this are every node's common start: no conflict (expect_origin)
        await self.conn.execute("SELECT set_config('pgmesh.installed_at', $1, false)", installed)
        return nodes, datetime_to_pg_us(await self.conn.fetchval("SELECT $1::text::timestamptz", installed))

    def fit(self, txn: Transaction) -> Transaction:
        """`txn` with rows sent before a replicated rename or drop fitted to the target (router.ddl), and
        without the generated columns a publication may send (only the target computes them)."""
        if not self.drift and not any(self._sends_generated(r) for r in txn.relations.values()):
            return txn
        generated = {table.name: dict.fromkeys(table.generated) for table in self.tables.values()
                     if table.generated}
        columns = {key: table.columns - table.generated for key, table in self.tables.items()}
        drift = {name: {**generated.get(name, {}), **self.drift.get(name, {})}
                 for name in {*self.drift, *generated}}
        return reconcile(txn, columns, drift) or txn

    def _sends_generated(self, relation: Relation) -> bool:
        """Whether the source's rows of `relation` carry a column generated here."""
        table = self.tables.get((relation.schema, relation.name))
        return table is not None and bool(table.generated) and any(
            c.name in table.generated for c in relation.columns)

    async def open_pipe(self, *, fresh: bool = False) -> tuple[Pipe, Statements]:
        """The pipelined session (router.apply.pipe), holding the source's origin (the main session lets
        it go first). It is opened only when the link connects (`fresh`): a pipe found gone later raises
        ConnectionLost, so that the whole link connects again and reads the target's own word on what it
        has (the node may have crashed and lost commits it had not flushed: LinkProgress.restart_at).
        Opening a new pipe there instead went on past such lost commits without a word."""
        if not fresh and (self.pipe is None or self.pipe.closed or self.statements is None):
            pipe, self.pipe, self.statements = self.pipe, None, None
            if pipe is not None:
                await pipe.close()
            raise ConnectionLost("the pipe session was lost; the link connects again", node=self.target.name)
        if self.pipe is None or self.statements is None:
            self.pipe = await Pipe.open(
                self.target.dsn, self.target.name, source=self.source, installed_at=self.installed_at,
                synchronous_commit=self.config.apply_synchronous_commit(self.target.name),
                settings=self.settings,
            )
            self.statements = Statements(self.source, self.origin, late=self.setup_last, mark=self.mark)
            self.statements.tables = self.tables
            self.statements.origin = str(self.source_origin)
        if not self.pipe.origin_held:
            await self.let_origin_go()
            await self.pipe.take_origin(self.origin)
        return self.pipe, self.statements

    async def recover_pipe(self) -> None:
        """After a failed batch: the pipe's failed transaction rolled back (its locks let go before the
        careful path runs), or the pipe closed when even that fails."""
        pipe = self.pipe
        if pipe is None or pipe.closed:
            return
        try:
            await pipe.recover()
        except Exception:
            self.pipe = self.statements = None
            await pipe.close()

    async def take_origin(self) -> None:
        """The main session takes the source's origin back after lanes or a side session had it (a
        session that just ended may not have let it go yet: a moment is allowed for that)."""
        if self.origin_held or self.conn is None:
            return
        if self.pipe is not None and self.pipe.origin_held:
            await self.pipe.let_origin_go()
        await take_origin(self.conn, self.origin)
        self.origin_held = True

    async def let_origin_go(self) -> None:
        """The main session lets the source's origin go (another session commits under it next)."""
        if self.origin_held:
            assert self.conn is not None
            await self.conn.execute(_RESET)
            self.origin_held = False

    def let_origin_go_sql(self) -> str:
        """The SQL that lets the main session's origin go, for the caller to send first on the main
        session ('' when it does not hold it); from now on the origin counts as let go."""
        if not self.origin_held:
            return ""
        self.origin_held = False
        return _RESET + ";\n"

    async def open_other(self) -> asyncpg.Connection:
        """Another session on the target, set up as the main one (a lane, the side session)."""
        conn = await open_session(self.target.dsn, self.installed_at, source=self.source,
                                  synchronous_commit=self.config.apply_synchronous_commit(self.target.name))
        if self.settings:
            await conn.execute(self.settings)
        return conn

    async def count_conflicts(self) -> None:
        """Add the conflicts recorded on the target for this source since the last count (whichever
        session of the link decided them) to `conflicts` and the link's stats."""
        assert self.conn is not None
        if self.history_at is None:
            self.history_at = int(await self.conn.fetchval(_HISTORY_NOW) or 0)
            return
        rows = await self.conn.fetch(_HISTORY_SINCE, self.history_at, self.source)
        await self.conn.execute(_RESET_DECIDED)
        for row in rows:
            key = (str(row[0]), str(row[1]))
            self.conflicts[key] = self.conflicts.get(key, 0) + int(row[2])
            self.stats.conflicts += int(row[2])
            self.history_at = max(self.history_at, int(row[3]))
            if row[4]:
                self._lost(key[0], int(row[4]), str(row[5]))

    def _lost(self, table: str, count: int, lsn: str) -> None:
        """`count` inserts lost to key collisions on `table` (insert_exists between two different rows: two
        nodes made the same key, and one row is now only in conflict_history); logged with the hint at
        the first and then at most once a minute per table."""
        self.lost_inserts[table] = total = self.lost_inserts.get(table, 0) + count
        now = asyncio.get_running_loop().time()
        if now - self.lost_logged.get(table, -LOST_LOG_S) < LOST_LOG_S:
            return
        self.lost_logged[table] = now
        logger.warning(
            "link %s: %d insert(s) lost to key collisions on %s (%d since the router started; the last at"
            " source LSN %s): two nodes made the same key at once, and the losing row is only in"
            " pgmesh.conflict_history (`pgmesh conflicts`); if the key comes from a sequence (a column"
            " default, or nextval() the application calls itself), make it cluster-unique with `pgmesh"
            " sequences convert` (docs/sequences.md)", self.name, count, table, total, lsn,
        )

    async def run_ddl(self, conn: Any, message: Message) -> dict[tuple[str, str], TargetTable] | None:
        """One captured DDL command, inside the target transaction, as its user under its search_path (a
        message with another prefix: nothing, None); returns the target's tables after it."""
        if message.prefix != DDL_PREFIX:
            return None
        command = ddl_command(message)
        # first: its first change has no origin, and a target transaction that opens with it would
        # stream without one (router.apply.scripts.ORIGIN_MARK)
        await conn.execute(ORIGIN_MARK)
        path = await conn.fetchval("SELECT current_setting('search_path')")
        await conn.execute("SELECT set_config('search_path', $1, true)", command.search_path)
        me = await conn.fetchval("SELECT current_user")
        # as its author: a superuser's DDL through pgmesh.ddl_as_owner when this role is none (it can
        # never SET ROLE to one: router/cluster/sql/ddl_as_owner.sql), another role's by SET ROLE
        # (docs/security.md)
        as_owner = command.role != me and bool(await conn.fetchval(_REPLAY_AS_OWNER, command.role))
        try:
            if as_owner:
                await conn.execute(_DDL_AS_OWNER, command.role, command.sql)
            elif command.role != me:
                await conn.execute(f"SET LOCAL ROLE {quote_ident(command.role)}")
            if not as_owner:
                await conn.execute(command.sql)
            if command.role != me and not as_owner:
                await conn.execute(f"SET LOCAL ROLE {quote_ident(me)}")
        except asyncpg.PostgresError as exc:
            grant = f"GRANT {quote_ident(command.role)} TO {quote_ident(me)}"
            raise ApplyError(
                f"replicated DDL failed: {describe(exc)}; the command ({command.tag}):"
                f" {describe_command(command)}",
                lsn=message.lsn,
                sqlstate=exc.sqlstate,
                hint=f"let the router's role {me} act as {command.role} ({grant}, docs/security.md), then"
                " `pgmesh resume`" if "permission denied to set role" in str(exc) else
                "make the command possible here (for example create the missing role or object),"
                " then `pgmesh resume`",
            ) from None
        await conn.execute("SELECT set_config('search_path', $1, true)", path)
        logger.info("link %s: applied %s from %s", self.name, command.tag, self.source)
        await self.load_tables()
        return self.tables

# A command whose author is a superuser while the applying role is not (router/cluster/sql/ddl_as_owner.sql)
_REPLAY_AS_OWNER = ("SELECT a.rolsuper AND NOT m.rolsuper FROM pg_catalog.pg_roles a, pg_catalog.pg_roles m"
                    " WHERE a.rolname = $1 AND m.rolname = current_user")
_DDL_AS_OWNER = "SELECT pgmesh.ddl_as_owner($1, $2)"
# Conflicts decided since the last count: pgmesh.decide sets pgmesh.decided (router/conflicts/sql); the
# applier appends DECIDED to a batch, whose status then says whether to count (`count_conflicts`).
DECIDED = "SELECT FROM pg_catalog.current_setting('pgmesh.decided', true) AS d WHERE d = 'y'"
_UNIQUE_VIOLATION = "23505"
_DDL_LOCAL = "SELECT pg_catalog.set_config('pgmesh.ddl_local', 'on', false)"
_OURS = "SELECT name FROM pg_catalog.pg_prepared_statements WHERE name LIKE 'pgmesh\\_%'"
_RESET_DECIDED = "SELECT pg_catalog.set_config('pgmesh.decided', '', false)"
_HISTORY_NOW = ("SELECT CASE WHEN pg_catalog.to_regclass('pgmesh.conflict_history') IS NOT NULL THEN"
                " (SELECT pg_catalog.max(id) FROM pgmesh.conflict_history) END")
# (not the tombstone recorders' late decisions, router.apply.recorder: their reason says "late")
# A lost insert: insert_exists between two different rows (a key collision of two fresh inserts; the
# same row arriving again, every remote column equal to the local one, loses nothing).
_HISTORY_SINCE = ("SELECT table_name, conflict_type, pg_catalog.count(*), pg_catalog.max(id),"
                  " pg_catalog.count(*) FILTER (WHERE conflict_type = 'insert_exists'"
                  " AND NOT coalesce(local_row @> remote_row, false)), pg_catalog.max(remote_lsn)::text"
                  " FROM pgmesh.conflict_history WHERE id > $1 AND source = $2"
                  " AND coalesce(reason, '') NOT LIKE 'late: %' GROUP BY 1, 2")
