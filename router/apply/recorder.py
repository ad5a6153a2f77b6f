"""The tombstone recorder: a node's own deletes recorded from its decoded stream, off the application's path.

The conflict path needs, on node T, the last deletion of each key (`pgmesh.tombstones`, version = the
deleting transaction's commit time and origin, from its xid). The router's own replicated deletes are
recorded by the `pgmesh_tombstone` trigger, enabled REPLICA (it fires under the appliers'
`session_replication_role = replica`, in the applying transaction). The node's own deletes, which the
application waits for, are recorded here instead: the router decodes every one of them anyway. One
`TombstoneRecorder` per node takes that node's own committed transactions that delete, or update a row's
key (its old key goes as a deletion would; the fan-out, router.stream.fanout, hands it them in commit
order; spilled ones are read back from the spool) and,
per table whose trigger fires REPLICA (router.conflicts.catalog.trigger_fires: the stream carries the
key), writes in one transaction on the node:

1. the table's advisory lock, exclusive (router.apply.statements.table_lock): every applier decision
   on a key of the table holds it shared, taken in a statement before the one that reads tombstones,
   until its transaction ends. So every applier transaction that decided on this table without these
   tombstones has committed before step 3 reads, and every later one reads them;
2. the tombstones, `(table, key, xid8 of the deleting transaction)`, each kept only when newer than the
   one there (commit time);
3. the late decisions: a row now holding a deleted key that a remote change wrote (origin not local)
   was written after the deletion by an applier that did not see its tombstone yet (or concurrently,
   on a snapshot without the deletion). It is decided now as the applier would have decided it with the
   tombstone there, by the same SQL (`pgmesh.decide`, conflict `update_deleted`: the tombstone is the
   local version, the row the remote one), recorded in conflict_history; a row that loses is deleted
   here (with the recorder's origin: no echo; the trigger records nothing for the recorder's session).
   A row a local transaction wrote after the deletion is newer in the node's own order and stays.
   Custom and `error` resolvers are not decided in SQL: such a row stops the recorder with an error
   (the node's slot is held; nothing is lost), never a silent difference.

The recorder's position (`pgmesh.tombstones_recorded`, the end LSN of the last transaction recorded)
is written with the last table's transaction, committed with synchronous_commit on (local with
`synchronous` > 0): its link (SourceProgress.recorder, router.progress) is flushed there, and the node's
slot is confirmed only up to what the recorder has durably recorded. A crash between tables records
them again (idempotent).

Recording after the commit leaves a window, closed by steps 1 and 3 together: an applier that meets no
row and no tombstone during the recorder's lag applies the change; the recorder then decides it late,
exactly as if the tombstone had been there, so the nodes still end equal. A row it decides is locked
first and read again, so a change committed meanwhile is decided as it now is.

Keyless tables (REPLICA IDENTITY FULL without a key): tombstones are recorded, late decisions are not
made (no key to find the row by; docs/conflicts.md lists it).

TRUNCATE: a TRUNCATE of the node's own is recorded as its table's tombstone (`pgmesh.table_tombstones`,
the truncating transaction's xid: its commit time and origin are the TRUNCATE's version; a replicated
TRUNCATE records its own in the applying transaction, `pgmesh.truncate_by_version`). A change older than
it that an applier wrote after it (it reached the node later, or before the tombstone was recorded) is
removed by the sweep (`pgmesh.truncate_sweep`: every row of the table older than its tombstone goes,
recorded as `write_truncated`), run right after recording and every `SWEEP_INTERVAL_S` (one look at the
node's table tombstones, usually none; the appliers record those of replicated TRUNCATEs). A table
tombstone goes once the pruning horizon (router.conflicts.pruning, kept in `pgmesh.node_info` as
`tombstone_horizon`) has passed it, in the transaction of a last sweep: every change older than it had
been applied on the node by then, so that sweep removed the last of them.

Must not: decide anything but the late decisions above, write to tables other than tombstones,
table_tombstones, conflict_history, tombstones_recorded, the late deletes and the sweeps' deletes, or
confirm a position not yet durable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Final

import asyncpg

from protocol.changes import ChangeContext, Dispatch, ignore, note_relation
from protocol.lsn import format_lsn
from protocol.messages import KIND_NULL, Delete, Relation, Truncate, TupleData, Update
from protocol.transactions import Transaction
from router.apply.sessions import open_session
from router.apply.statements import TargetTable, quote_ident, table_lock, tombstone_key
from router.config.model import Config, NodeConfig
from router.errors import PgmeshError, describe
from router.progress.positions import LinkProgress
from router.stream.linkqueue import LinkQueue
from router.stream.spool import iter_chunks, let_go

__all__ = ["BATCH_TRANSACTIONS", "RECORDED_SQL", "TombstoneRecorder"]

logger = logging.getLogger(__name__)

BATCH_TRANSACTIONS: Final = 200  # transactions recorded together at most
CHUNK_KEYS: Final = 50_000  # keys per statement
RECORDED_SQL: Final = "SELECT position::text FROM pgmesh.tombstones_recorded"
SWEEP_INTERVAL_S: Final = 1.0  # while the node holds a table tombstone: a sweep at least this often
SWEEP_LOCK_TIMEOUT: Final = "200ms"  # a sweep waits this long for its table at most
_POSITION_SQL: Final = (
    "WITH u AS (UPDATE pgmesh.tombstones_recorded SET position = $1::text::pg_lsn RETURNING 1)"
    " INSERT INTO pgmesh.tombstones_recorded SELECT $1::text::pg_lsn WHERE NOT EXISTS (SELECT 1 FROM u)"
)
# The recorder's commits never wait for a synchronous standby that is the router itself (it confirms the
# node's transactions only once they are recorded): synchronous_standby_names set on the node by hand, not
# through [replication] synchronous (`_connect`), may name it ($1: Config.standby_name) or be '*'
_NOT_FOR_ITSELF_SQL: Final = (
    "SELECT pg_catalog.set_config('synchronous_commit', 'local', false)"
    " WHERE pg_catalog.current_setting('synchronous_standby_names')"
    " ~ ('(^|[^a-z0-9_$])(' || $1 || '|\\*)($|[^a-z0-9_$])')"
)
# A TRUNCATE of the node's own ($1: the table as "schema.name", $2: the truncating transaction's xid8)
_TABLE_TOMBSTONE_SQL: Final = (
    "SELECT pgmesh.table_tombstone($1, $2::text::xid8, v.timestamp, pgmesh.origin_node(v.roident))"
    " FROM pg_catalog.pg_xact_commit_timestamp_origin(pg_catalog.xid($2::text::xid8)) AS v"
)
# The node's table tombstones, each with its table quoted (NULL: the table is gone) and whether the
# pruning horizon has passed it
_TABLE_TOMBSTONES_SQL: Final = """
SELECT t.table_name, (SELECT pg_catalog.format('%I.%I', n.nspname, c.relname)
                        FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
                       WHERE n.nspname || '.' || c.relname = t.table_name AND c.relkind IN ('r', 'p')),
  coalesce(pg_catalog.pg_xact_commit_timestamp(pg_catalog.xid(t.xid))
           < (SELECT i.value::timestamptz FROM pgmesh.node_info i WHERE i.key = 'tombstone_horizon'), false)
  OR pg_catalog.pg_xact_commit_timestamp(pg_catalog.xid(t.xid)) IS NULL
FROM pgmesh.table_tombstones t
"""
_BUILT_IN: Final = frozenset(("last_update_wins", "first_update_wins", "node_priority", "keep_local",
                              "apply_remote"))

# Per table: the trigger's key columns (tgargs), whether it fires REPLICA, whether the key is a real key
# (primary or replica identity index: rows can be found by it), and each key column's type.
_TABLE_SQL: Final = """
SELECT t.tgargs, t.tgenabled::text,
  EXISTS (SELECT 1 FROM pg_catalog.pg_index i
           WHERE i.indrelid = c.oid AND (i.indisprimary OR i.indisreplident)),
  ARRAY(SELECT a.attname::text || ':' || pg_catalog.format_type(
                 CASE WHEN ty.typtype = 'd' THEN ty.typbasetype ELSE a.atttypid END, NULL)
          FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_type ty ON ty.oid = a.atttypid
         WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped)
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
JOIN pg_catalog.pg_trigger t ON t.tgrelid = c.oid AND t.tgname = 'pgmesh_tombstone' AND t.tgparentid = 0
WHERE n.nspname = $1 AND c.relname = $2
"""


class _Table:
    """What the recorder needs of one replicated table on its node."""

    __slots__ = ("key", "keyed", "lock", "name", "qualified", "replica", "schema", "table", "types")

    def __init__(self, schema: str, name: str, key: tuple[str, ...], replica: bool, keyed: bool,
                 types: Mapping[str, str]) -> None:
        self.schema, self.table = schema, name
        target = TargetTable(schema, name, frozenset())
        self.name = target.name
        self.qualified = target.qualified
        self.lock = table_lock(target, exclusive=True)  # as the appliers' shared one, exclusive
        self.key = key
        self.replica = replica  # the trigger fires REPLICA: the node's own deletes are recorded here
        self.keyed = keyed  # the key is a primary key or replica identity index
        self.types = dict(types)


class _Deletes:
    """The deleted keys of one table in one batch: the last deletion of each key (commit order)."""

    __slots__ = ("keys", "table")

    def __init__(self, table: _Table) -> None:
        self.table = table
        self.keys: dict[tuple[str | None, ...], int] = {}  # key values (text) -> xid (32 bits)


class _Collect(ChangeContext):
    """The deletes of one batch being collected (the handlers of `_COLLECT` add to them). A handler
    returns the relation of a deletion whose table this batch has not looked at yet (None otherwise): the
    recorder reads the table, then hands it the change again."""

    __slots__ = ("deletes", "tables", "truncates", "xid")

    def __init__(self, tables: dict[tuple[str, str], _Table], truncates: dict[str, int]) -> None:
        super().__init__({})
        self.tables = tables  # the recorder's: what it knows of each table (forgotten after DDL)
        self.truncates = truncates  # "schema.table" -> xid of the TRUNCATE
        self.deletes: dict[tuple[str, str], _Deletes] = {}
        self.xid = 0  # of the transaction being collected

    def delete(self, relid: int, old: TupleData, new: TupleData | None) -> Relation | None:
        """A deletion of row `old` (or, with `new`, an update that may take its key away)."""
        relation = self.relations.get(relid)
        if relation is None:
            return None
        deletes = self.deletes.get((relation.schema, relation.name))
        if deletes is None:
            return relation
        key = _key_values(relation, old, deletes.table.key)
        if new is not None:  # a key update takes the old key away
            if not deletes.table.keyed:
                return None  # a keyless table's row changes are not deletions
            new_key = _key_values(relation, new, deletes.table.key)
            if new_key is None or new_key == key:
                return None
        if key is not None:
            deletes.keys.pop(key, None)  # re-inserted at the end: commit order kept
            deletes.keys[key] = self.xid
        return None


def _relation(collect: _Collect, change: Relation) -> None:
    note_relation(collect, change)
    collect.tables.pop((change.schema, change.name), None)  # DDL: read it again


def _truncate(collect: _Collect, change: Truncate) -> None:
    for relid in change.relids:
        truncated = collect.relations.get(relid)
        if truncated is not None:
            collect.truncates[f"{truncated.schema}.{truncated.name}"] = collect.xid


def _delete(collect: _Collect, change: Delete) -> Relation | None:
    return collect.delete(change.relid, change.old, None)


def _update(collect: _Collect, change: Update) -> Relation | None:
    return None if change.old is None else collect.delete(change.relid, change.old, change.new)


_COLLECT: Final[Dispatch[_Collect, Relation | None]] = Dispatch({
    Relation: _relation, Truncate: _truncate, Delete: _delete, Update: _update,
}, otherwise=ignore)  # inserts, messages, types: nothing deleted


class TombstoneRecorder:
    """Records one node's own deletes (see the module docstring); `run` until cancelled."""

    def __init__(self, config: Config, node: NodeConfig, progress: LinkProgress, queue: LinkQueue,
                 on_recorded: Callable[[], None] | None = None) -> None:
        self.config = config
        self.on_recorded = on_recorded  # its position moved (router.service.synchronous: confirm at once)
        self.node = node
        self.progress = progress  # source = target = the node
        self.queue = queue
        self.error: str | None = None
        self.recorded = 0  # tombstones written
        self.late = 0  # late decisions made
        self.replaced = 0  # of them, those that replaced the applier's record of the same change
        self.swept = 0  # rows older than their table's TRUNCATE removed (router.conflicts.sql truncate_sweep)
        self._swept_at = 0.0  # (monotonic) the last sweep; the next one comes SWEEP_INTERVAL_S later
        self._sweep_pause = 0.0  # longer, while the node has no table of table tombstones (installed before)
        self._sweep_error: str | None = None
        self._conn: asyncpg.Connection | None = None
        self._tables: dict[tuple[str, str], _Table] = {}

    async def run(self) -> None:
        try:
            while True:
                try:
                    async with asyncio.timeout(SWEEP_INTERVAL_S):
                        first = await self.queue.get()
                except TimeoutError:
                    await self._sweep_quietly()
                    continue
                batch = [first, *self.queue.take(BATCH_TRANSACTIONS - 1)]
                await self._record_until_done(batch)
                if time.monotonic() - self._swept_at >= SWEEP_INTERVAL_S:
                    await self._sweep_quietly()
        finally:
            await self.close()

    async def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            try:
                await asyncio.wait_for(conn.close(), 5)
            except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError,
                    asyncpg.InternalClientError):
                conn.terminate()

    async def _record_until_done(self, batch: list[Transaction]) -> None:
        delay = 0.2
        try:
            while True:
                try:
                    await self._record(batch)
                    self.error = None
                    return
                except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError,
                        PgmeshError) as exc:
                    self.error = describe(exc)
                    logger.error("node %s: recording the tombstones of transactions up to %s failed: %s;"
                                 " retrying in %.1f s", self.node.name, format_lsn(batch[-1].end_lsn),
                                 self.error, delay)
                    await self.close()
                    self._tables.clear()
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
        finally:
            for txn in batch:
                let_go(txn)

    async def _connect(self) -> asyncpg.Connection:
        if self._conn is None or self._conn.is_closed():
            conn = await open_session(self.node.dsn)
            origin = self.config.recorder_origin_name()
            # "local" on a node with synchronous > 0: the router is its synchronous standby (it would wait
            # for itself; docs/synchronous.md)
            mode = "local" if self.config.synchronous(self.node.name) > 0 else "on"
            await conn.execute(f"SET synchronous_commit = {mode}; SET pgmesh.recording = 'y'")
            await conn.execute(_NOT_FOR_ITSELF_SQL, self.config.standby_name)
            await conn.execute(
                "SELECT pg_catalog.set_config('pgmesh.target', $1, false),"
                " pg_catalog.set_config('pgmesh.origin_prefix', $2, false)",
                self.node.name, self.config.origin_name(""),
            )
            await conn.execute(
                "SELECT pg_catalog.pg_replication_origin_create($1)"
                " WHERE pg_catalog.pg_replication_origin_oid($1) IS NULL", origin,
            )
            await conn.execute("SELECT pg_catalog.pg_replication_origin_session_setup($1)", origin)
            self._conn = conn
        return self._conn

    async def _record(self, batch: list[Transaction]) -> None:
        conn = await self._connect()
        truncates: dict[str, int] = {}
        deletes = await self._collect(conn, batch, truncates)
        end = batch[-1].end_lsn
        tables = [d for d in deletes.values() if d.keys and d.table.replica]
        if not tables and not truncates:
            self._recorded(end)  # nothing of these is this recorder's: up to here is recorded
            return
        await conn.execute(_NOT_FOR_ITSELF_SQL, self.config.standby_name)
        current = int(await conn.fetchval(
            "SELECT pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot())::text::bigint"))
        if truncates:
            async with conn.transaction():
                for name, xid in truncates.items():
                    await conn.execute(_TABLE_TOMBSTONE_SQL, name, str(full_xid(xid, current)))
                if not tables:
                    await conn.execute(_POSITION_SQL, format_lsn(end))
            logger.info("node %s: TRUNCATE of %s recorded as table tombstone(s)", self.node.name,
                        ", ".join(sorted(truncates)))
            # swept once this batch counts as recorded (run): a synchronous node's TRUNCATE holds its lock
            # until the router confirms it, and the sweep needs the table
            self._swept_at = 0.0
        for i, part in enumerate(sorted(tables, key=lambda d: d.table.name)):
            last = i == len(tables) - 1
            async with conn.transaction():
                await conn.execute(part.table.lock)
                await self._write(conn, part, current)
                if last:
                    await conn.execute(_POSITION_SQL, format_lsn(end))
        self._recorded(end)

    async def _sweep_quietly(self) -> None:
        """A sweep (module docstring, TRUNCATE) when the node may hold a table tombstone; an error waits for
        the next one (the sweep is idempotent, and the table tombstone stays until a sweep passes it)."""
        now = time.monotonic()
        if now - self._swept_at < self._sweep_pause:
            return
        self._swept_at, self._sweep_pause = now, 0.0
        try:
            await self._sweep(await self._connect())
            self._sweep_error = None
        except asyncpg.UndefinedTableError:
            self._sweep_pause = 60.0  # installed before table tombstones (`pgmesh init` adds them)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError,
                PgmeshError) as exc:
            # (InternalClientError: "cannot switch to state ...", a session whose protocol state asyncpg
            # lost after an operation on it was cancelled: closed, and opened again next time; PgmeshError:
            # the fence refused the session, [ha]: a node down when this router took the lease, back before
            # the lease took it in, or the lease just lost; it must not end the router)
            error = describe(exc)
            log = logger.debug if error == self._sweep_error else logger.warning  # (once, not every second)
            log("node %s: sweeping the rows older than a TRUNCATE failed: %s; trying again in %.0f s",
                self.node.name, error, SWEEP_INTERVAL_S)
            self._sweep_error = error
            await self.close()

    async def _sweep(self, conn: asyncpg.Connection) -> None:
        """Each table tombstone's sweep; a tombstone the pruning horizon has passed goes with its last one."""
        rows = await conn.fetch(_TABLE_TOMBSTONES_SQL)
        for name, qualified, passed in rows:
            try:
                async with conn.transaction():
                    # never wait long for the table (a TRUNCATE on a synchronous node holds it until the
                    # router confirms it; an application's long lock): the next sweep tries again
                    await conn.execute(f"SET LOCAL lock_timeout = '{SWEEP_LOCK_TIMEOUT}'")
                    removed = 0 if qualified is None else int(
                        await conn.fetchval("SELECT pgmesh.truncate_sweep($1, $2)", name, qualified))
                    if passed or qualified is None:
                        await conn.execute("DELETE FROM pgmesh.table_tombstones WHERE table_name = $1", name)
            except asyncpg.LockNotAvailableError:
                logger.debug("node %s: %s is locked: swept next time", self.node.name, name)
                continue
            if removed:
                self.swept += removed
                logger.info("node %s: %s: %d row(s) written by changes older than the table's TRUNCATE"
                            " removed (conflict write_truncated)", self.node.name, name, removed)

    def _recorded(self, end: int) -> None:
        self.progress.on_flushed(end)
        if self.on_recorded is not None:
            self.on_recorded()

    async def _collect(
        self, conn: asyncpg.Connection, batch: Iterable[Transaction], truncates: dict[str, int]
    ) -> dict[tuple[str, str], _Deletes]:
        """Every delete of the batch, by table; each TRUNCATE's tables into `truncates` (name -> xid)."""
        collect = _Collect(self._tables, truncates)
        handlers = _COLLECT.handlers
        for txn in batch:
            collect.relations, collect.xid = dict(txn.relations), txn.xid
            for chunk in iter_chunks(txn):
                for change in chunk:
                    relation = handlers[type(change)](collect, change)
                    if relation is not None:  # a deletion in a table not looked at yet in this batch
                        table = await self._table(conn, relation)
                        if table is not None:
                            collect.deletes[(relation.schema, relation.name)] = _Deletes(table)
                            handlers[type(change)](collect, change)
        return collect.deletes

    async def _table(self, conn: asyncpg.Connection, relation: Relation) -> _Table | None:
        where = (relation.schema, relation.name)
        table = self._tables.get(where)
        if table is not None:
            return table
        row = await conn.fetchrow(_TABLE_SQL, *where)
        if row is None:
            return None  # no trigger: not replicated from this node's point of view
        args, enabled, keyed, columns = row
        key = tuple(part.decode() for part in bytes(args).split(b"\x00")[:-1])
        types = dict(c.split(":", 1) for c in columns)
        table = _Table(*where, key, enabled == "R", keyed, types)
        self._tables[where] = table
        return table

    async def _write(self, conn: asyncpg.Connection, deletes: _Deletes, current: int) -> None:
        table = deletes.table
        items = list(deletes.keys.items())
        for start in range(0, len(items), CHUNK_KEYS):
            chunk = items[start : start + CHUNK_KEYS]
            columns = [[key[i] for key, _ in chunk] for i in range(len(table.key))]
            xids = [full_xid(xid, current) for _, xid in chunk]
            status = await conn.execute(tombstones_sql(table), table.name, xids, *columns)
            self.recorded += int(status.rsplit(" ", 1)[1])
            if table.keyed:
                await self._late(conn, table, columns, xids)

    async def _late(self, conn: asyncpg.Connection, table: _Table, columns: list[list[str | None]],
                    xids: list[int]) -> None:
        """Rows a remote change wrote on a key this node deleted: decided now (module docstring, step 3)."""
        query = candidates_sql(table)
        if not await conn.fetch(query, xids, *columns):
            return  # the usual case: no row holds a key this node deleted
        # Lock them, then read them again on a snapshot taken after the locks: a row an applier or the
        # application changed meanwhile is decided as it is now (a locking read returns the newest row
        # version, but a LATERAL beside it keeps the old version's commit time)
        await conn.execute(f"{query} FOR UPDATE OF r", xids, *columns)
        found = await conn.fetch(query, xids, *columns)
        name = self.config.policy(table.schema, table.table, "update_deleted").resolver.value
        if found and name not in _BUILT_IN:
            raise PgmeshError(
                f"a remote change rewrote a key this node deleted, before its tombstone was recorded;"
                f" resolver {name} cannot be decided here: resolve by hand (pgmesh repair) and restart",
                node=self.node.name, relation=table.name,
            )
        for row in found:
            origin_node = row["pgmesh_node"]
            remote = f"0/0|{row['pgmesh_ts'].isoformat()}|"
            await conn.execute(
                "SELECT pg_catalog.set_config('pgmesh.source', $1, true),"
                " pg_catalog.set_config('pgmesh.remote', $2, true)",
                origin_node, remote,
            )
            won = await conn.fetchval(
                "SELECT pgmesh.decide('update_deleted', $1, $2, pg_catalog.pg_xact_commit_timestamp("
                "pg_catalog.xid($3::xid8)), 0, NULL, $4, $5, $6)",
                table.name, row["pgmesh_key"], row["pgmesh_xid"], row["pgmesh_row"], name,
                list(self.config.conflicts.node_priority),
            )
            self.replaced += int(await conn.fetchval(_LATE_RECORD, table.name, row["pgmesh_key"], origin_node,
                                                     row["pgmesh_ts"]) or 0)
            if not won:
                await conn.execute(
                    f"DELETE FROM {table.qualified} WHERE ctid = $1::text::tid AND tableoid = $2::oid",
                    row["pgmesh_ctid"], row["pgmesh_tableoid"],
                )
            self.late += 1
            logger.info("node %s: %s key %s: a remote change from %s met this node's deletion late: %s",
                        self.node.name, table.name, row["pgmesh_key"], origin_node,
                        "the change stays" if won else "the deletion wins; removed")


# The late decision's record: its reason says so, and it replaces what the applier recorded for the same
# change when it met neither the row nor the tombstone (update_missing, same source and commit time): one
# conflict, one record, as on the nodes where the tombstone was there in time.
_LATE_RECORD: Final = (
    "WITH this AS (SELECT pg_catalog.currval(pg_catalog.pg_get_serial_sequence('pgmesh.conflict_history',"
    " 'id')) AS id),"
    " replaced AS (DELETE FROM pgmesh.conflict_history h USING this WHERE h.id < this.id"
    " AND h.table_name = $1 AND h.key = $2 AND h.source = $3 AND h.conflict_type = 'update_missing'"
    " AND h.remote_commit_time = $4 RETURNING h.id)"
    " UPDATE pgmesh.conflict_history h SET reason = 'late: ' || h.reason || ' (the deletion was recorded"
    " after the change had been applied; decided by the tombstone recorder'"
    " || CASE WHEN EXISTS (SELECT FROM replaced) THEN ', in place of the update_missing recorded then'"
    " ELSE '' END || ')' FROM this WHERE h.id = this.id RETURNING (SELECT count(*) FROM replaced)"
)


def _key_values(relation: Relation, row: TupleData, key: tuple[str, ...]) -> tuple[str | None, ...] | None:
    """A row image's key columns as text (None: NULL); None when the image lacks one (or holds it as
    "unchanged")."""
    position = {c.name: i for i, c in enumerate(relation.columns)}
    out: list[str | None] = []
    for name in key:
        i = position.get(name)
        if i is None:
            return None
        kind = row.kinds[i]
        if kind == KIND_NULL:
            out.append(None)
            continue
        value = row.values[i]
        if not isinstance(value, bytes):
            return None
        out.append(value.decode())
    return tuple(out)


def full_xid(xid: int, current: int) -> int:
    """The 64-bit xid (xid8) of a committed transaction from its 32 bits: the one nearest `current` (the
    next xid, 64 bits, from a snapshot taken after the commit was decoded), as PostgreSQL widens an xid.
    Usually below `current`, but a commit can be decoded before its backend has left the proc array, and
    then it is at or above it: the same epoch, not the one before (in epoch 0 that was a negative xid8,
    and the recorder's batch failed and was retried; seen on PostgreSQL 18)."""
    delta = (xid - current) & 0xFFFFFFFF
    if delta >= 1 << 31:
        delta -= 1 << 32
    full = current + delta
    return full if full >= 0 else xid


def _key_array(table: _Table, alias: str) -> str:
    parts = ", ".join(f'{alias}."c{i}"::{table.types.get(c, "text")}::text' for i, c in enumerate(table.key))
    return tombstone_key(f"ARRAY[{parts}]::text[]")


def _unnest(table: _Table, first: int) -> str:
    """The batch's deletions as rows k(x, c0, c1...): xids in parameter `first`, key columns after it."""
    args = ", ".join(f"${first + 1 + i}::text[]" for i in range(len(table.key)))
    names = ", ".join(f'"c{i}"' for i in range(len(table.key)))
    return f"unnest(${first}::xid8[], {args}) AS k(x, {names})"


def tombstones_sql(table: _Table) -> str:
    """Upsert the batch's tombstones of `table` ($1: its name, $2: xids, $3...: key columns as text)."""
    newer = ("pg_catalog.pg_xact_commit_timestamp(pg_catalog.xid(excluded.xid))"
             " >= coalesce(pg_catalog.pg_xact_commit_timestamp(pg_catalog.xid(t.xid)), '-infinity')")
    return (
        f"INSERT INTO pgmesh.tombstones AS t (table_name, key, xid)"
        f" SELECT $1, {_key_array(table, 'k')}, k.x FROM {_unnest(table, 2)}"
        f" ON CONFLICT (table_name, key) DO UPDATE SET xid = excluded.xid WHERE {newer}"
    )


def candidates_sql(table: _Table) -> str:
    """Rows of `table` holding one of the batch's deleted keys, written by a remote change (origin not
    local): each with its ctid, version, origin node, key and the deletion's xid ($1: xids, $2...: key
    columns as text)."""
    match = " AND ".join(
        f'r.{quote_ident(c)} = k."c{i}"::{table.types.get(c, "text")}' for i, c in enumerate(table.key)
    )
    return (
        f"SELECT r.ctid::text AS pgmesh_ctid, r.tableoid::oid AS pgmesh_tableoid, v.timestamp AS pgmesh_ts,"
        f" pgmesh.origin_node(v.roident) AS pgmesh_node, k.x AS pgmesh_xid,"
        f" pg_catalog.array_to_string({_key_array(table, 'k')}, ',') AS pgmesh_key,"
        f" pg_catalog.to_jsonb(r)::text AS pgmesh_row"
        f" FROM {_unnest(table, 1)}"
        f" JOIN {table.qualified} AS r ON {match},"
        f" LATERAL pg_catalog.pg_xact_commit_timestamp_origin(r.xmin) AS v"
        f" WHERE v.roident <> 0"
    )
