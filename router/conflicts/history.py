"""Bounded history: each node's `pgmesh.conflict_history`, and the quarantine entries no longer pending,
kept for `[conflicts] keep` and pruned in small batches by the active router.

What is pruned, on every member node, each round (every `prune_interval(keep)`: a tenth of keep, at
least 1 s and at most 60 s):
- conflict_history rows whose `at` (the node's clock when the row was written) is older than the node's
  `now() - keep`, oldest first, found through the `at` index (conflict_history_at_idx);
- with `keep_rows` > 0, the rows whose id is at or below the newest id less keep_rows, oldest id first:
  the ids are the history's insert counter (a bigserial), so the rows left never number more than
  keep_rows plus what was written during one round, whatever the rate; a warning says when this cut
  rows younger than keep;
- `pgmesh.quarantine` entries with `state <> 'pending' AND resolved_at < now() - keep` (replayed or
  discarded long enough ago). A pending entry is data waiting for an operator: never pruned, neither by
  age nor by the row cap. Skipped while the table does not exist (a node installed before it).

Each batch is one DELETE of at most `BATCH_ROWS` rows picked `FOR UPDATE SKIP LOCKED` (a row a
recorder or a replay holds is left for the next round: the deletion never waits on a row lock), its own
short transaction on the pruner's own session (`application_name` pgmesh-history, `lock_timeout` and
`statement_timeout` short, `synchronous_commit` off), never an applier's. Applies only insert into the
history, so they never wait for it. A node's deletions stop for the round after `ROUND_BUDGET_S`.

Counting: a link counts the conflicts recorded on its target by id (router.apply.link `history_at`: every
row of its source with an id above it is still to be counted, for its stats and /metrics). A row not yet
counted is never pruned: each round reads every running link's `history_at` (`counted`), and a row of
source S on T may go only when its id is at or below what the link S -> T has counted (a link that has
not read its start yet starts after the newest id anyway: no limit). `history_at` only grows, so the
reading may be old, never wrong.

`HistoryPruner` is the I/O shell, one long-lived task of the router, started beside tombstone pruning
(router.conflicts.pruning) by the supervisor's streaming task group: only while this router holds the
[ha] lease. Its counters (`HistoryStats`, read whole by /metrics and the tests): rows pruned per node and
table, the statistics' live rows of conflict_history, the age of its oldest row.

Must not: decide or record conflicts, touch a pending quarantine entry, write anything but those
deletions, or use a session other than its own (one per node).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Protocol

import msgspec
import psycopg

from router.config.model import PGMESH_SCHEMA, Config, NodeConfig
from router.errors import describe

__all__ = [
    "BATCH_ROWS",
    "PRUNE_CAP_SQL",
    "PRUNE_OLD_SQL",
    "PRUNE_QUARANTINE_SQL",
    "ROUND_BUDGET_S",
    "HistoryMetrics",
    "HistoryPruner",
    "HistoryStats",
    "counted_ids",
    "prune_interval",
]

logger = logging.getLogger(__name__)

BATCH_ROWS: Final = 5_000  # rows deleted per transaction
ROUND_BUDGET_S: Final = 10.0  # one node's deletions per round at most this long (the rest: next round)
NODE_TIMEOUT_S: Final = 60.0  # one node's part of a round at most (a hung node waits for the next)
INTERVAL_MIN_S: Final = 1.0
INTERVAL_MAX_S: Final = 60.0
CAP_WARN_S: Final = 600.0  # the row cap's warning, at most once this often per node
# The pruner's session: a DDL waiting on the history (or holding it) makes a batch give up, not queue
SESSION_SQL: Final = ("SET lock_timeout = '1s'; SET statement_timeout = '30s'; SET synchronous_commit = off")

_H: Final = f'"{PGMESH_SCHEMA}".conflict_history'
_Q: Final = f'"{PGMESH_SCHEMA}".quarantine'
_NEVER: Final = 9_223_372_036_854_775_807  # no limit (bigint's largest)
# A row of source S not yet counted by the link S -> T stays (`counted`: {source: its history_at}).
_COUNTED: Final = f"h.id <= coalesce((%(counted)s::jsonb ->> h.source)::bigint, {_NEVER})"
_OLD: Final = "h.at < pg_catalog.now() - pg_catalog.make_interval(secs => %(keep)s)"
PRUNE_OLD_SQL: Final = (
    f"DELETE FROM {_H} WHERE id = ANY (ARRAY(SELECT h.id FROM {_H} h WHERE {_OLD} AND {_COUNTED}"
    " ORDER BY h.at LIMIT %(limit)s FOR UPDATE SKIP LOCKED))"
)
PRUNE_CAP_SQL: Final = (
    f"WITH gone AS (DELETE FROM {_H} WHERE id = ANY (ARRAY(SELECT h.id FROM {_H} h"
    f" WHERE h.id <= %(below)s AND {_COUNTED} ORDER BY h.id LIMIT %(limit)s FOR UPDATE SKIP LOCKED))"
    " RETURNING at)"
    " SELECT pg_catalog.count(*), pg_catalog.min(at) FROM gone"
)
_NEWEST_ID_SQL: Final = f"SELECT pg_catalog.max(id) FROM {_H}"
_RESOLVED: Final = (
    "q.state <> 'pending' AND q.resolved_at < pg_catalog.now() - pg_catalog.make_interval(secs => %(keep)s)"
)
# Rechecked in the DELETE itself: an entry is pruned only as it is when deleted
PRUNE_QUARANTINE_SQL: Final = (
    f"DELETE FROM {_Q} q WHERE q.id = ANY (ARRAY(SELECT q.id FROM {_Q} q WHERE {_RESOLVED}"
    f" ORDER BY q.id LIMIT %(limit)s FOR UPDATE SKIP LOCKED)) AND {_RESOLVED}"
)
_QUARANTINE_EXISTS_SQL: Final = f"SELECT pg_catalog.to_regclass('{_Q}') IS NOT NULL"
# Cheap: the statistics' live tuples (no scan), and the oldest row's age through the `at` index
_SIZE_SQL: Final = (
    f"SELECT pg_catalog.pg_stat_get_live_tuples('{_H}'::regclass),"
    f" pg_catalog.date_part('epoch', pg_catalog.now() - (SELECT h.at FROM {_H} h ORDER BY h.at LIMIT 1))"
)


def prune_interval(keep_s: float) -> float:
    """Seconds between rounds: a tenth of keep, at least INTERVAL_MIN_S, at most INTERVAL_MAX_S."""
    return min(INTERVAL_MAX_S, max(INTERVAL_MIN_S, keep_s / 10))


def counted_ids(counted: Mapping[tuple[str, str], int | None], target: str) -> dict[str, int]:
    """{source: the id up to which the link source -> `target` has counted its conflicts}, for the links
    into `target` that have read where they start (None: not yet, so no limit)."""
    return {source: at for (source, into), at in counted.items() if into == target and at is not None}


class HistoryMetrics(Protocol):
    """The metric families the pruner sets (router.service.metrics.Metrics has them), by node."""

    conflict_history_rows: Any
    conflict_history_oldest_seconds: Any
    conflict_history_pruned_total: Any
    quarantine_pruned_total: Any


class HistoryStats(msgspec.Struct):
    """One node's history pruning, read whole by the metrics and the tests."""

    rounds: int = 0  # rounds that reached this node
    pruned: int = 0  # conflict_history rows deleted since the router started (by age or by the cap)
    capped: int = 0  # of those, deleted by keep_rows
    batches: int = 0  # DELETE transactions of conflict_history that deleted something
    quarantine_pruned: int = 0  # resolved quarantine entries deleted
    rows: int = 0  # conflict_history's live rows (the statistics' count) after the last round
    oldest_s: float | None = None  # the age of its oldest row after the last round (None: empty)
    last_error: str | None = None


class HistoryPruner:
    """The router's history pruning task (see the module's docstring)."""

    def __init__(
        self,
        config: Config,
        nodes: Sequence[NodeConfig],
        counted: Callable[[], Mapping[tuple[str, str], int | None]],
        *,
        metrics: HistoryMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`nodes`: the members; `counted`: each link's (source, target) -> the conflict_history id it has
        counted up to (router.apply.link `history_at`), as it is now (called every round)."""
        self.config = config
        self.nodes = list(nodes)
        self._counted = counted
        self.metrics = metrics
        self.clock = clock
        self.keep_s = config.conflicts.keep_s
        self.keep_rows = config.conflicts.keep_rows
        self.interval = prune_interval(self.keep_s)
        self.batch_rows = BATCH_ROWS  # rows per DELETE (a test makes it small)
        self.stats = {node.name: HistoryStats() for node in self.nodes}
        self._conns: dict[str, psycopg.AsyncConnection[Any]] = {}
        self._exported: dict[str, tuple[int, int]] = {}  # node -> (pruned, quarantine) last exported
        self._cap_warned: dict[str, float] = {}

    async def run(self) -> None:
        """Prune every interval until cancelled; a node that fails is reported and tried next round."""
        try:
            while True:
                await asyncio.sleep(self.interval)
                try:
                    await self.prune_once()
                except Exception:  # a bug here must not stop the router: said, and tried next round
                    logger.exception("conflict history pruning round failed")
        finally:
            await self.close()

    async def prune_once(self) -> None:
        """One round over every node."""
        counted = self._counted()
        for node in self.nodes:
            stats = self.stats[node.name]
            stats.rounds += 1
            try:
                async with asyncio.timeout(NODE_TIMEOUT_S):
                    await self._prune(node, counted_ids(counted, node.name), stats)
                if stats.last_error is not None:
                    logger.info("node %s: conflict history pruning works again", node.name)
                stats.last_error = None
            except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled) as exc:
                logger.debug("node %s: history pruning gave way (%s); again next round", node.name,
                             describe(exc))
            except (psycopg.Error, OSError, TimeoutError) as exc:
                await self._drop(node.name)
                text = f"no answer within {NODE_TIMEOUT_S:.0f} s" if isinstance(exc, TimeoutError) else (
                    describe(exc))
                if stats.last_error is None:
                    logger.warning("node %s: conflict history pruning failed: %s; trying again in %.0f s",
                                   node.name, text, self.interval)
                stats.last_error = text
            self._export(node.name, stats)

    async def _prune(self, node: NodeConfig, counted: dict[str, int], stats: HistoryStats) -> None:
        conn = await self._conn(node)
        until = self.clock() + ROUND_BUDGET_S
        params: dict[str, Any] = {"keep": self.keep_s, "limit": self.batch_rows,
                                  "counted": json.dumps(counted)}
        deleted = await self._batches(conn, PRUNE_OLD_SQL, params, until, stats)
        if self.keep_rows:
            rows = await (await conn.execute(_NEWEST_ID_SQL)).fetchall()
            newest = rows[0][0] if rows else None
            if newest is not None and newest > self.keep_rows:
                capped = await self._cap(conn, node.name, {**params, "below": newest - self.keep_rows}, until,
                                         stats)
                deleted += capped
        if deleted:
            logger.debug("node %s: %d conflict_history rows pruned", node.name, deleted)
        if (await (await conn.execute(_QUARANTINE_EXISTS_SQL)).fetchall())[0][0]:
            stats.quarantine_pruned += await self._batches(conn, PRUNE_QUARANTINE_SQL, params, until, None)
        rows = await (await conn.execute(_SIZE_SQL)).fetchall()
        stats.rows = int(rows[0][0]) if rows else 0
        stats.oldest_s = float(rows[0][1]) if rows and rows[0][1] is not None else None

    async def _batches(self, conn: psycopg.AsyncConnection[Any], text: str, params: Mapping[str, Any],
                       until: float, stats: HistoryStats | None) -> int:
        """Run `text` (one batch each time) until a batch deletes less than a batch or the budget ends;
        the rows deleted (added to `stats` as each batch commits, for conflict_history)."""
        total = 0
        while True:
            cur = await conn.execute(text, params)
            deleted = max(0, cur.rowcount)
            total += deleted
            if stats is not None and deleted:
                stats.pruned += deleted
                stats.batches += 1
            if deleted < self.batch_rows or self.clock() >= until:
                return total

    async def _cap(self, conn: psycopg.AsyncConnection[Any], node: str, params: Mapping[str, Any],
                   until: float, stats: HistoryStats) -> int:
        """The rows over keep_rows, oldest id first, in batches; warns (rarely) that rows younger than keep
        went."""
        total = 0
        oldest_at = None
        while True:
            rows = await (await conn.execute(PRUNE_CAP_SQL, params)).fetchall()
            deleted = int(rows[0][0]) if rows else 0
            if deleted:
                total += deleted
                stats.pruned += deleted
                stats.capped += deleted
                stats.batches += 1
                oldest_at = oldest_at or rows[0][1]
            if deleted < self.batch_rows or self.clock() >= until:
                break
        now = self.clock()
        if total and now - self._cap_warned.get(node, -math.inf) >= CAP_WARN_S:
            self._cap_warned[node] = now
            logger.warning(
                "node %s: pgmesh.conflict_history holds more than [conflicts] keep_rows = %d rows: the"
                " oldest %d pruned although younger than keep = %s (from %s on); conflicts are decided at a"
                " high rate (`pgmesh conflicts` shows where): raise keep_rows or lower keep to hold them",
                node, self.keep_rows, total, self.config.conflicts.keep,
                oldest_at.isoformat() if oldest_at is not None else "?",
            )
        return total

    def _export(self, node: str, stats: HistoryStats) -> None:
        m = self.metrics
        if m is None:
            return
        pruned, quarantine = self._exported.get(node, (0, 0))
        m.conflict_history_pruned_total.labels(node=node).inc(stats.pruned - pruned)
        m.quarantine_pruned_total.labels(node=node).inc(stats.quarantine_pruned - quarantine)
        self._exported[node] = (stats.pruned, stats.quarantine_pruned)
        if stats.last_error is None:
            m.conflict_history_rows.labels(node=node).set(stats.rows)
            m.conflict_history_oldest_seconds.labels(node=node).set(stats.oldest_s or 0.0)

    async def _conn(self, node: NodeConfig) -> psycopg.AsyncConnection[Any]:
        conn = self._conns.get(node.name)
        if conn is None or conn.closed:
            conn = await psycopg.AsyncConnection.connect(
                node.dsn, autocommit=True, application_name="pgmesh-history", connect_timeout=5
            )
            await conn.execute(SESSION_SQL)
            self._conns[node.name] = conn
        return conn

    async def _drop(self, name: str) -> None:
        conn = self._conns.pop(name, None)
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def close(self) -> None:
        for name in list(self._conns):
            await self._drop(name)
