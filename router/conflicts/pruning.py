"""Tombstone pruning: each node's `pgmesh.tombstones` is cut behind a horizon no late change can cross.

A tombstone at node T says "key k of table t was deleted at d" (d: the commit time of the deleting
transaction, `pg_xact_commit_timestamp(xid(xid))`, on the clock of the node that committed it). The
conflict path reads it when a remote insert or update meets no row on T: the change loses to the deletion
when its own commit time is older (docs/conflicts.md). A tombstone is therefore needed only as long as a
change with commit time < d can still arrive at T. Changes reach T over the links X -> T alone, one per
other node X, and each carries only X's own transactions, in X's commit (LSN) order.

The horizon of T (`horizon`, pure) is the minimum over its incoming links of the link's safe time minus
`[conflicts] tombstone_margin_ms`. The safe time of X -> T (`link_safe_time`) is a commit time, on X's
clock, up to which all of X's transactions are applied on T; the later of
- the commit time of the last transaction the link applied since the router started, counted only once
  T's replication origin for X is flushed at or past that transaction's end (a target that crashed and
  lost commits it had not flushed has not applied them: they come again), and
- `now()` read on X together with X's flushed WAL position F (`SOURCE_SQL`), once X's slot is
  confirmed at or past F (in the same reading when X is idle, else in a later round): the router
  confirms a slot only up to what every link out of X has durably applied, so every transaction X had
  flushed at that `now()` is applied on T, and every transaction X flushed later committed (took its
  commit time) at about that `now()` or later. This moves the horizon on while X writes nothing of its
  own, even while it applies the others' changes.
Any change from X with commit time c <= d < horizon <= safe(X -> T) - margin is then already committed
on T: pruning the tombstone cannot change a decision still to come. Clocks of different nodes are never
compared with each other here: X's commit times are measured against X's own times, so skew between
nodes does not matter. The margin covers what the argument takes as exact and is not: commit times do
not quite follow commit LSN order (a commit time is taken just before the commit record is inserted, and
the record may be flushed a little later, up to about 3 x wal_writer_delay with asynchronous commit),
and a clock on X stepping backwards. A step or a flush stall longer than the margin is excluded
(docs/conflicts.md, Tombstone pruning).

Pruning changes no outcome when a change newer than a deletion wins against it with or without its
tombstone: true of last_update_wins and node_priority (window 0). Under the resolvers accepted only with
allow_divergence, and custom ones, a change arriving after its key's tombstone went meets no row.

A link that is not running (paused, down, in error, held on schema drift) or that has not reported
since the router started stops the horizon of its target: nothing is pruned there meanwhile. A tombstone
whose commit time is unknown (NULL: its xid is older than the commit timestamps kept) is pruned: it is
older than anything commit timestamps still order.

`TombstonePruner` is the I/O shell, one long-lived task of the router: every
`[conflicts] tombstone_prune_interval_ms` it reads each source's caught-up time and each target's flushed
origin positions, deletes on each target at most `BATCHES` x `BATCH_ROWS` tombstones older than its
horizon (short transactions, so the conflict path is never held long), and updates the metrics.

A tombstone behind the horizon is still kept for `[conflicts] tombstone_keep` (1 h by default) after its
commit (`prune_before`): the conflict path no longer needs it, but `pgmesh repair` and continuous
verification's auto_repair do, to tell a row deleted on one node from a row another node lost (without it,
repair keeps the row and says so). The given-up unique values go at the horizon itself.

Table tombstones (a TRUNCATE's, `pgmesh.table_tombstones`) follow the same horizon, but go with a last
sweep of their table, which needs the recorder's replication origin: the pruner writes each node's
horizon into `pgmesh.node_info` (`tombstone_horizon`), and the node's tombstone recorder
(router.apply.recorder) drops the table tombstones behind it.

Must not: decide conflicts, write anything but `pgmesh.tombstones` (and `pgmesh.given_up`) deletions and
the horizon, or prune on a node whose horizon is unknown. It owns its connections (one per node,
`application_name` pgmesh-pruner).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Protocol

import msgspec
import psycopg

from protocol.lsn import format_lsn, parse_lsn, pg_us_to_datetime, unix_seconds_to_pg_us
from router.config.model import PGMESH_SCHEMA, Config, NodeConfig
from router.errors import describe
from router.progress.applied import FLUSHED_SQL
from router.progress.positions import LinkProgress

__all__ = [
    "BATCHES",
    "BATCH_ROWS",
    "SOURCE_SQL",
    "HorizonTracker",
    "LinkReport",
    "PruneMetrics",
    "PruneStats",
    "TombstonePruner",
    "horizon",
    "link_safe_time",
    "prune_before",
]

logger = logging.getLogger(__name__)

BATCH_ROWS: Final = 5_000  # tombstones deleted per transaction
BATCHES: Final = 40  # transactions per node and round at most (the rest waits for the next round)
NODE_TIMEOUT_S: Final = 60.0  # one node's part of a round at most (a hung node waits for the next)

# On a source: its clock, its flushed WAL position (read after the clock), its slot's confirmed position.
SOURCE_SQL: Final = (
    "SELECT pg_catalog.date_part('epoch', pg_catalog.now()),"  # not in the node's DateStyle
    " pg_catalog.pg_current_wal_flush_lsn()::text, s.confirmed_flush_lsn::text"
    " FROM pg_catalog.pg_replication_slots s WHERE s.slot_name = %s"
)
PENDING_MAX: Final = 100  # a source's readings kept until its slot reaches them (the oldest go first)
_OLD: Final = (
    "coalesce(pg_catalog.pg_xact_commit_timestamp(pg_catalog.xid(xid)) < %(horizon)s::timestamptz, true)"
)
_T: Final = f'"{PGMESH_SCHEMA}".tombstones'
# The rows are locked as they are picked, skipping those an apply holds (it may be writing that key's
# tombstone again, newer): the deletion never waits on an apply, so never deadlocks with one.
_PRUNE_SQL: Final = (
    f"DELETE FROM {_T} WHERE ctid = ANY (ARRAY(SELECT ctid FROM {_T} WHERE {_OLD} LIMIT %(limit)s"
    f" FOR UPDATE SKIP LOCKED)) AND {_OLD}"
)
# The given-up unique values (router.conflicts.given_up) go behind the same horizon: a claim older than
# the hold they record can no longer arrive.
_GIVEN_UP: Final = f'"{PGMESH_SCHEMA}".given_up'
_PRUNE_GIVEN_UP_SQL: Final = (
    f"DELETE FROM {_GIVEN_UP} WHERE ctid = ANY (ARRAY(SELECT ctid FROM {_GIVEN_UP} WHERE {_OLD}"
    f" LIMIT %(limit)s FOR UPDATE SKIP LOCKED)) AND {_OLD}"
)
# A cheap count: the statistics' live tuples (exact enough for a gauge, no scan).
_COUNT_SQL: Final = f"SELECT pg_catalog.pg_stat_get_live_tuples('{_T}'::regclass)"
# The horizon, for the recorder's table tombstones (ISO 8601 in UTC, as installed_at)
_HORIZON_SQL: Final = (
    f'INSERT INTO "{PGMESH_SCHEMA}".node_info (key, value) VALUES (\'tombstone_horizon\', %(horizon)s)'
    " ON CONFLICT (key) DO UPDATE SET value = excluded.value"
)


def link_safe_time(applied: tuple[int, int] | None, flushed: int | None, caught_up: int | None) -> int | None:
    """A commit time (microseconds since 2000, the source's clock) up to which every transaction of the
    source is applied on the target, or None when the link has not said.

    `applied`: (end LSN, commit time) of the last transaction the link applied; `flushed`: the target's
    flushed origin position for the source (the commit time counts only once that reaches the end);
    `caught_up`: the source's clock when its slot was last seen confirmed up to its flushed WAL.
    """
    best = caught_up
    if applied is not None and flushed is not None and flushed >= applied[0]:
        best = applied[1] if best is None else max(best, applied[1])
    return best



class PruneMetrics(Protocol):
    """The metric families the pruner sets (router.service.metrics.Metrics has them): prometheus_client's
    labelled gauges and counter, by node."""

    tombstones: Any
    tombstones_pruned_total: Any
    tombstone_horizon_age_seconds: Any

class Link(Protocol):
    """What the pruner reads of a link's applier: its source and target, whether it runs (applies
    whatever comes: not paused, held or failing), and the last transaction it committed (its end LSN in
    `progress.applied`, its commit time): read each round, not noted per transaction."""

    source: str
    progress: LinkProgress

    @property
    def last_commit_time(self) -> int | None: ...

    @property
    def target(self) -> NodeConfig: ...

    @property
    def ready_for_more(self) -> bool: ...


class LinkReport(msgspec.Struct, frozen=True):
    """One link as the router sees it now: whether it runs (applies whatever comes)."""

    source: str
    target: str
    running: bool


def prune_before(horizon_at: int, now_us: int, keep_us: int) -> int:
    """Tombstones committed before this go (microseconds since 2000): the horizon, but none younger than
    `keep_us` (`[conflicts] tombstone_keep`)."""
    return min(horizon_at, now_us - keep_us)


def horizon(safe_times: Iterable[int | None], margin_us: int) -> int | None:
    """The target's horizon: the least safe time of its incoming links minus the margin; None when a
    link has none (not running, or not reported) or the target has no incoming link."""
    times = list(safe_times)
    if not times or any(t is None for t in times):
        return None
    return min(t for t in times if t is not None) - margin_us


class PruneStats(msgspec.Struct):
    """One node's pruning, read whole by the metrics and the tests."""

    rounds: int = 0  # rounds that looked at this node (its horizon known or not)
    pruned: int = 0  # tombstones deleted since the router started
    tombstones: int = 0  # the statistics' count of live tombstones, after the last round
    horizon: int | None = None  # the last horizon pruned behind (microseconds since 2000)
    last_error: str | None = None


class HorizonTracker:
    """What the links have reported, and the horizon of each target from it. Pure: no I/O; the clock
    (seconds since 1970, like `time.time`) is only for the horizon's age."""

    __slots__ = ("_applied", "_caught_up", "_pending", "clock", "margin_us")

    def __init__(self, margin_ms: int, clock: Callable[[], float] = time.time) -> None:
        self.margin_us = margin_ms * 1000
        self.clock = clock
        self._applied: dict[tuple[str, str], tuple[int, int]] = {}  # link -> (end LSN, commit time)
        self._caught_up: dict[str, int] = {}  # source -> its clock when its slot was caught up
        self._pending: dict[str, list[tuple[int, int]]] = {}  # source -> (clock, flushed LSN) not yet reached

    def note_applied(self, source: str, target: str, end_lsn: int, commit_time: int) -> None:
        """The link committed a transaction on its target (in order; after a lost commit, lower again)."""
        self._applied[(source, target)] = (end_lsn, commit_time)

    def note_source(self, source: str, at: int, flushed: int, confirmed: int) -> None:
        """A reading on the source: its clock `at`, its flushed WAL position then, and its slot's confirmed
        position. Each reading counts (`note_caught_up`) once the slot is confirmed up to its position."""
        pending = self._pending.setdefault(source, [])
        pending.append((at, flushed))
        reached = [t for t, lsn in pending if lsn <= confirmed]
        if reached:
            self.note_caught_up(source, max(reached))
        pending[:] = [(t, lsn) for t, lsn in pending if lsn > confirmed][-PENDING_MAX:]

    def note_caught_up(self, source: str, at: int) -> None:
        """The source's slot was confirmed up to its flushed WAL when its clock read `at`."""
        self._caught_up[source] = max(at, self._caught_up.get(source, at))

    def safe_time(self, source: str, target: str, flushed: int | None) -> int | None:
        return link_safe_time(self._applied.get((source, target)), flushed, self._caught_up.get(source))

    def horizon_for(self, target: str, links: Iterable[LinkReport], flushed: Mapping[str, int]) -> int | None:
        """`target`'s horizon from its incoming links (`flushed`: source -> the target's origin position)."""
        incoming = [link for link in links if link.target == target]
        return horizon(
            (self.safe_time(link.source, target, flushed.get(link.source)) if link.running else None
             for link in incoming),
            self.margin_us,
        )

    def age_seconds(self, at: int | None) -> float:
        """Seconds from the horizon `at` to now on the router's clock (+Inf: no horizon yet)."""
        if at is None:
            return math.inf
        return max(0.0, (unix_seconds_to_pg_us(self.clock()) - at) / 1_000_000)


class TombstonePruner:
    """The router's pruning task: a `HorizonTracker` fed by the nodes, and the deletions it allows."""

    def __init__(
        self,
        config: Config,
        nodes: Sequence[NodeConfig],
        links: Callable[[], Mapping[tuple[str, str], Link]],
        *,
        metrics: PruneMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`nodes`: the members; `links`: the router's appliers by (source, target), as they are now
        (called every round)."""
        self.config = config
        self.nodes = list(nodes)
        self._links = links
        self.metrics = metrics
        self.interval = config.conflicts.tombstone_prune_interval_ms / 1000
        self.tracker = HorizonTracker(config.conflicts.tombstone_margin_ms, clock)
        self.keep_us = int(config.conflicts.tombstone_keep_s * 1_000_000)
        self.stats = {node.name: PruneStats() for node in self.nodes}
        self._conns: dict[str, psycopg.AsyncConnection[Any]] = {}
        self._exported: dict[str, int] = {}  # node -> `pruned` when last added to the metrics

    async def run(self) -> None:
        """Prune every interval until cancelled; a node that fails is reported and tried next round."""
        try:
            while True:
                await asyncio.sleep(self.interval)
                try:
                    await self.prune_once()
                except Exception:  # a bug here must not stop the router: said, and tried next round
                    logger.exception("tombstone pruning round failed")
        finally:
            await self.close()

    async def prune_once(self) -> None:
        """One round: the sources' caught-up times, then each target's horizon and deletions."""
        for node in self.nodes:
            try:
                async with asyncio.timeout(NODE_TIMEOUT_S):
                    await self._read_caught_up(node)
            except (psycopg.Error, OSError, TimeoutError):
                await self._drop(node.name)  # a source that does not answer: no news (said below)
        appliers = self._links()
        for (source, target), applier in appliers.items():
            if (at := applier.last_commit_time) is not None:
                self.tracker.note_applied(source, target, applier.progress.applied, at)
        links = [LinkReport(source, target, applier.ready_for_more)
                 for (source, target), applier in appliers.items()]
        for node in self.nodes:
            stats = self.stats[node.name]
            stats.rounds += 1
            try:
                async with asyncio.timeout(NODE_TIMEOUT_S):
                    await self._prune(node, links, stats)
                stats.last_error = None
            except (psycopg.Error, OSError, TimeoutError) as exc:
                await self._drop(node.name)
                timed_out = isinstance(exc, TimeoutError)
                text = f"no answer within {NODE_TIMEOUT_S:.0f} s" if timed_out else describe(exc)
                if stats.last_error is None:
                    logger.warning("node %s: tombstone pruning failed: %s; trying again in %.0f s",
                                   node.name, text, self.interval)
                stats.last_error = text
            self._export(node.name, stats)

    async def _read_caught_up(self, node: NodeConfig) -> None:
        rows = await self._query(node, SOURCE_SQL, [self.config.slot_name])
        if rows and rows[0][1] and rows[0][2]:
            at = unix_seconds_to_pg_us(float(rows[0][0]))
            self.tracker.note_source(node.name, at, parse_lsn(rows[0][1]), parse_lsn(rows[0][2]))

    async def _prune(self, node: NodeConfig, links: list[LinkReport], stats: PruneStats) -> None:
        prefix = self.config.origin_name("")
        rows = await self._query(node, FLUSHED_SQL, [prefix, prefix])  # router.progress.applied
        flushed = {r[0][len(prefix):]: parse_lsn(r[1]) for r in rows if r[1]}
        at = self.tracker.horizon_for(node.name, links, flushed)
        if at is not None:
            before = stats.pruned
            await self._delete_before(node, at, stats)
            deleted = stats.pruned - before
            stats.horizon = at
            if deleted:
                logger.debug("node %s: %d tombstones pruned before %s (origins flushed at %s)", node.name,
                             deleted, pg_us_to_datetime(at).isoformat(),
                             ", ".join(f"{s} {format_lsn(lsn)}" for s, lsn in sorted(flushed.items())))
        rows = await self._query(node, _COUNT_SQL)
        stats.tombstones = int(rows[0][0]) if rows else 0

    async def _delete_before(self, node: NodeConfig, at: int, stats: PruneStats) -> None:
        """At most BATCHES transactions of BATCH_ROWS deletions each (each counted as it commits)."""
        params = {"horizon": pg_us_to_datetime(at), "limit": BATCH_ROWS}
        await (await self._conn(node)).execute(_HORIZON_SQL, {"horizon": pg_us_to_datetime(at).isoformat()})
        now_us = unix_seconds_to_pg_us(self.tracker.clock())
        kept = {"horizon": pg_us_to_datetime(prune_before(at, now_us, self.keep_us)), "limit": BATCH_ROWS}
        for _ in range(BATCHES):
            conn = await self._conn(node)
            cur = await conn.execute(_PRUNE_SQL, kept)
            stats.pruned += max(0, cur.rowcount)
            if cur.rowcount < BATCH_ROWS:
                break
        for _ in range(BATCHES):
            cur = await (await self._conn(node)).execute(_PRUNE_GIVEN_UP_SQL, params)
            if cur.rowcount < BATCH_ROWS:
                break

    def _export(self, node: str, stats: PruneStats) -> None:
        m = self.metrics
        if m is None:
            return
        m.tombstones.labels(node=node).set(stats.tombstones)
        m.tombstones_pruned_total.labels(node=node).inc(stats.pruned - self._exported.get(node, 0))
        self._exported[node] = stats.pruned
        m.tombstone_horizon_age_seconds.labels(node=node).set(self.tracker.age_seconds(stats.horizon))

    async def _conn(self, node: NodeConfig) -> psycopg.AsyncConnection[Any]:
        conn = self._conns.get(node.name)
        if conn is None or conn.closed:
            conn = await psycopg.AsyncConnection.connect(
                node.dsn, autocommit=True, application_name="pgmesh-pruner", connect_timeout=5
            )
            if self.config.synchronous(node.name) > 0:  # its deletes never wait for the router itself
                await conn.execute("SET synchronous_commit = local")
            self._conns[node.name] = conn
        return conn

    async def _query(self, node: NodeConfig, text: str, params: Any = None) -> list[tuple[Any, ...]]:
        conn = await self._conn(node)
        cur = await conn.execute(text, params)
        return await cur.fetchall() if cur.description else []

    async def _drop(self, name: str) -> None:
        conn = self._conns.pop(name, None)
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def close(self) -> None:
        for name in list(self._conns):
            await self._drop(name)
