"""The copy's lock holder on the donor: one session that imports the exported snapshot, locks every table
to copy in ACCESS SHARE mode (waiting a bounded time), checks that none was truncated or rewritten since
the snapshot, and plans the copy (columns and leaf relations with their sizes) under the locks it holds.

Why one session does all of it: a lock the application asks for (TRUNCATE, ALTER TABLE: ACCESS
EXCLUSIVE) queues behind the holder's ACCESS SHARE, and every *other* session's ACCESS SHARE request
then queues behind the application's. A planner on a session of its own waited for the application,
which waited for the holder, which waited (in Python, where no server sees it) for the planner: a wait
that never ends (issue 17). A lock a session already holds is granted again at once, so planning in
the holder never queues. The sessions that still need locks of their own (the schema dump, the copy
tasks) wait at most `lock_timeout`, and `pgmesh join` gives way to an application session that waits
for a lock of the join's (router.ops.join).

A relation whose file is no longer the snapshot's was truncated or rewritten after the snapshot (neither
is MVCC-safe: the snapshot sees the new file, whose rows it cannot see). One the snapshot sees empty and
whose catalog rows are otherwise the snapshot's (columns, defaults, access method, persistence: nothing
an ALTER TABLE that rewrites would change) was truncated: it needs no copy, since the TRUNCATE committed
after the snapshot is in the stream the new node reads (the donor's own after L, another node's after
P_X), and the new node replays it and what follows. Such tables are left out and no longer locked, so
an application that truncates them every few seconds no longer meets the join (`truncated`). Any other
(an ALTER TABLE that rewrote it) means a new snapshot (SQL state 40001). VACUUM FULL, CLUSTER and SET
TABLESPACE keep the rows the snapshot sees, so a relation they moved is copied as usual.

Owns: the holder session (REPEATABLE READ READ ONLY, `SET TRANSACTION SNAPSHOT`, `lock_timeout`), the
LOCK statement, the check that each relation's file is still the snapshot's and what it means (above),
reading columns (as the snapshot sees them: the schema the dump restores) and leaves with their COPY
format (router.cluster.copy.initial.plan_leaves); and `give_way`, the watch that stops a join attempt (or
round, router.ops.join) when an application session has waited too long for one of the
join's locks.

Must not: wait for a lock without a lock_timeout, write anything, decide whether a join attempt is
tried again (router.errors.retry_join does), or put a DSN in a message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any, Final

import psycopg
from psycopg import sql

from router.cluster.copy.initial import CopyAbort, CopyTable, plan_leaves
from router.cluster.copy.plan import Leaf
from router.cluster.copy.worker import SNAPSHOT_HINT
from router.errors import PgmeshError, describe

__all__ = ["SnapshotLocks", "give_way"]

logger = logging.getLogger(__name__)

# The tables as the snapshot sees them (a table created after it is not there: the DDL that created it
# reaches the new node from the donor's stream), with their columns in order (generated ones left out).
_TABLES_SQL: Final = """
SELECT n.nspname, c.relname,
       array(SELECT a.attname::text FROM pg_catalog.pg_attribute a
             WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
             ORDER BY a.attnum)
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE (n.nspname, c.relname) IN (SELECT * FROM unnest(%s::text[], %s::text[]))
ORDER BY n.nspname, c.relname
"""
# Relations whose file is no longer the one the snapshot knew: TRUNCATE, a rewriting ALTER TABLE, VACUUM
# FULL... committed between the snapshot and the lock (`_changed`).
_REWRITTEN_SQL: Final = """
SELECT c.oid::int8, n.nspname, c.relname
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE (n.nspname, c.relname) IN (SELECT * FROM unnest(%s::text[], %s::text[]))
  AND c.relfilenode IS DISTINCT FROM pg_catalog.pg_relation_filenode(c.oid)
"""
# What a rewriting ALTER TABLE changes in a relation's catalog rows besides its file (a TRUNCATE changes
# none of it): its columns' and defaults' row versions, its access method and persistence. Read under the
# snapshot (the holder) and as committed now (a session of its own), and compared.
_CATALOG_SQL: Final = """
SELECT c.oid::int8, c.relam::int8, c.relpersistence::text,
       array(SELECT a.attnum || ':' || a.xmin::text FROM pg_catalog.pg_attribute a
             WHERE a.attrelid = c.oid AND a.attnum > 0 ORDER BY a.attnum)::text,
       array(SELECT d.adnum || ':' || d.xmin::text FROM pg_catalog.pg_attrdef d
             WHERE d.adrelid = c.oid ORDER BY d.adnum)::text
FROM pg_catalog.pg_class c WHERE c.oid = ANY(%s::oid[])
"""


class SnapshotLocks:
    """The open holder: `tables` (what to copy, as the snapshot sees them) and `leaves` (the plan's
    input). Keep it open until the copy has ended; `close()` ends its transaction and its locks."""

    __slots__ = ("_conn", "leaves", "pid", "tables", "truncated")

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        tables: list[CopyTable],
        leaves: list[Leaf],
        truncated: list[tuple[str, str]],
    ) -> None:
        self._conn = conn
        self.pid = conn.info.backend_pid
        self.tables = tables
        self.leaves = leaves
        self.truncated = truncated  # tables truncated after the snapshot: not copied, not locked

    @classmethod
    def open(
        cls,
        dsn: str,
        snapshot: str,
        tables: Sequence[tuple[str, str]],
        *,
        lock_wait_s: float,
        application_name: str,
        node: str = "donor",
    ) -> SnapshotLocks:
        """Import `snapshot`, lock `tables`, check and plan them. Blocking: run it in a thread.

        Tables truncated after the snapshot are left out (`truncated`; the holder then locks again
        without them). Raises `PgmeshError` with SQL state 55P03 when a lock was not granted within
        `lock_wait_s`, and 40001 when a table was rewritten (by ALTER TABLE) after the snapshot: both
        mean "take a new snapshot and start again" (`router.errors.retry_join`).
        """
        truncated: list[tuple[str, str]] = []
        wanted = list(tables)
        while True:
            try:
                conn = psycopg.connect(dsn, autocommit=True, application_name=application_name)
            except psycopg.Error as exc:
                raise PgmeshError(f"cannot connect: {describe(exc)}", node=node,
                                  sqlstate=exc.sqlstate) from None
            try:
                seen, leaves, emptied = _lock_and_plan(conn, dsn, snapshot, wanted, lock_wait_s, node)
            except BaseException:
                _close(conn)
                raise
            if not emptied:
                return cls(conn, seen, leaves, truncated)
            _close(conn)  # not to hold them: the application truncates them again meanwhile
            truncated += sorted(emptied)
            names = ", ".join(f"{schema}.{name}" for schema, name in sorted(emptied))
            logger.info("node %s: %s truncated after the join's snapshot: not copied (the new node replays"
                        " the TRUNCATE and what follows)", node, names)
            wanted = [t for t in wanted if tuple(t) not in emptied]

    def close(self) -> None:
        """End the holder's transaction: its locks go, and the application's waiting statements run."""
        _close(self._conn)


def _close(conn: psycopg.Connection[Any]) -> None:
    with contextlib.suppress(psycopg.Error):
        conn.execute("ROLLBACK")
    with contextlib.suppress(psycopg.Error):
        conn.close()


def _lock_and_plan(
    conn: psycopg.Connection[Any], dsn: str, snapshot: str, tables: Sequence[tuple[str, str]],
    lock_wait_s: float, node: str,
) -> tuple[list[CopyTable], list[Leaf], set[tuple[str, str]]]:
    conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(max(1, round(lock_wait_s * 1000)))))
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
    try:
        conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
    except psycopg.Error as exc:
        raise PgmeshError(f"cannot import snapshot {snapshot!r}: {describe(exc)}", node=node,
                          sqlstate=exc.sqlstate, hint=SNAPSHOT_HINT) from None
    schemas, names = [t[0] for t in tables], [t[1] for t in tables]
    seen = [
        CopyTable(schema=schema, name=name, columns=tuple(columns))
        for schema, name, columns in conn.execute(_TABLES_SQL, [schemas, names]).fetchall()
    ]
    for schema, name in sorted(set(tables) - {(t.schema, t.name) for t in seen}):
        logger.info("table %s.%s is not in the snapshot (created after it): its DDL and rows come from "
                    "the donor's stream", schema, name)
    if not seen:
        return [], [], set()
    relations = sql.SQL(", ").join(sql.Identifier(t.schema, t.name) for t in seen)
    try:
        conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(relations))
    except psycopg.Error as exc:
        state = exc.sqlstate
        raise PgmeshError(
            f"the join could not lock the tables to copy within {lock_wait_s:g} s ({describe(exc)}):"
            " another session holds or waits for a conflicting lock (TRUNCATE, ALTER TABLE, VACUUM FULL...)",
            node=node, sqlstate=state,
            hint="the join tries again with a new snapshot; if it keeps failing, end the long transaction"
            " that holds the lock (pg_locks, pg_blocking_pids)",
        ) from None
    leaves = plan_leaves(conn, seen, node=node)
    names_of_leaves = ([leaf.schema for leaf in leaves], [leaf.name for leaf in leaves])
    changed = {int(oid): (str(schema), str(name))
               for oid, schema, name in conn.execute(_REWRITTEN_SQL, names_of_leaves).fetchall()}
    if not changed:
        return seen, leaves, set()
    emptied, moved = _classify(conn, dsn, changed, node)
    rewritten = sorted(f"{schema}.{name}" for schema, name in moved)
    if rewritten:
        raise PgmeshError(
            "rewritten after the join's snapshot (by ALTER TABLE): " + ", ".join(rewritten),
            node=node, relation=rewritten[0], sqlstate="40001",
            hint="the join tries again with a new snapshot",
        )
    hit = {leaf.table for leaf in leaves if (leaf.schema, leaf.name) in emptied}
    leaves = [leaf for leaf in leaves if (leaf.schema, leaf.name) not in emptied]
    copied = {leaf.table for leaf in leaves}  # a table with a leaf left to copy stays (and locked)
    return seen, leaves, {(seen[i].schema, seen[i].name) for i in hit - copied}


def _classify(
    conn: psycopg.Connection[Any], dsn: str, changed: dict[int, tuple[str, str]], node: str
) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """Of the relations whose file changed since the snapshot: those truncated and those rewritten by
    ALTER TABLE (module docstring). The others (the snapshot still sees their rows: VACUUM FULL, CLUSTER,
    SET TABLESPACE) are copied as usual."""
    oids = list(changed)
    then = {row[0]: row[1:] for row in conn.execute(_CATALOG_SQL, [oids]).fetchall()}
    try:
        with psycopg.connect(dsn, autocommit=True, application_name="pgmesh join catalog") as now_conn:
            now = {row[0]: row[1:] for row in now_conn.execute(_CATALOG_SQL, [oids]).fetchall()}
    except psycopg.Error as exc:
        raise PgmeshError(f"cannot read the catalog: {describe(exc)}", node=node,
                          sqlstate=exc.sqlstate) from None
    emptied: set[tuple[str, str]] = set()
    rewritten: set[tuple[str, str]] = set()
    for oid, name in changed.items():
        row = conn.execute(sql.SQL("SELECT NOT EXISTS (SELECT FROM ONLY {})").format(sql.Identifier(*name)))
        if not (row.fetchone() or (False,))[0]:
            continue  # its rows kept their versions: the snapshot sees them
        same = then.get(oid) is not None and then.get(oid) == now.get(oid)
        (emptied if same else rewritten).add(name)
    return emptied, rewritten


# ---------------------------------------------------------------------------------------------------------
# Giving way

# The oldest lock wait of a session that is not the join's, blocked by one of the join's sessions (those
# whose application_name starts with the join's tag): an application's TRUNCATE or ALTER TABLE behind the
# holder, or behind a copy task.
_WAITER_SQL: Final = """
WITH ours AS (
    SELECT coalesce(array_agg(pid), '{}'::int[]) AS pids FROM pg_catalog.pg_stat_activity
    WHERE pg_catalog.starts_with(application_name, %(tag)s))
SELECT a.pid, a.application_name, pg_catalog.left(a.query, 120), l.relation::regclass::text,
       coalesce(extract(epoch FROM pg_catalog.clock_timestamp() - l.waitstart), 0)::float8
FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid, ours
WHERE NOT l.granted AND a.pid <> ALL(ours.pids) AND pg_catalog.pg_blocking_pids(a.pid) && ours.pids
ORDER BY l.waitstart NULLS LAST
LIMIT 1
"""
# The join's statements that are running (or waiting for a lock): cancelled when the join gives way.
_CANCEL_SQL: Final = """
SELECT pg_catalog.pg_cancel_backend(pid) FROM pg_catalog.pg_stat_activity
WHERE pg_catalog.starts_with(application_name, %(tag)s) AND pid <> pg_catalog.pg_backend_pid()
  AND state = 'active' AND backend_type = 'client backend'
"""


async def give_way(dsn: str, tag: str, abort: CopyAbort, *, lock_wait_s: float, node: str) -> None:
    """Watch the donor until cancelled: once a session that is not the join's has waited `lock_wait_s`
    for a lock held (or queued for) by one of the join's sessions (application_name starting with
    `tag`), request `abort` with an error naming it (SQL state 55P03: the join starts again) and cancel
    the join's running statements; again at every poll after that, until the caller ends the attempt
    (closing the lock holder ends the application's wait)."""
    poll = min(1.0, lock_wait_s / 4)
    try:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, application_name=f"{tag}-watch")
    except psycopg.Error as exc:
        logger.warning("node %s: the join cannot watch for sessions waiting on its locks (%s); its lock"
                       " waits stay bounded, the application's may last until the copy ends", node,
                       describe(exc))
        return
    try:
        while True:
            await asyncio.sleep(poll)
            if abort.error is None:
                cur = await conn.execute(_WAITER_SQL, {"tag": tag})
                row = await cur.fetchone()
                if row is None or row[4] < lock_wait_s:
                    continue
                pid, application, query, relation, waited = row
                logger.warning("node %s: session %s (%s) has waited %.1f s for a lock the join holds on %s:"
                               " the join gives way", node, pid, application or "no application_name",
                               waited, relation)
                error = PgmeshError(
                    f"the join gave way to session {pid} ({application or 'no application_name'}:"
                    f" {' '.join(str(query).split())[:80]!r}), which waited {waited:.0f} s for a lock the"
                    " join held",
                    node=node, relation=relation, sqlstate="55P03",
                    hint="the join copies again, leaving out the tables truncated since its snapshot",
                )
                await asyncio.to_thread(abort.request, error)
            else:
                await asyncio.to_thread(abort.request, abort.error)  # a job started since: cancel it too
            await conn.execute(_CANCEL_SQL, {"tag": tag})
    except psycopg.Error as exc:
        logger.warning("node %s: the join stopped watching for sessions waiting on its locks: %s", node,
                       describe(exc))
    finally:
        with contextlib.suppress(psycopg.Error):
            await conn.close()
