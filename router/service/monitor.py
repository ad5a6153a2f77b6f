"""The router's monitoring connection to each node: flushed origin progress, paused links, retained WAL.

A node with physical standbys named in `synchronized_standby_slots` (17+; docs/failover.md) counts an
origin position as flushed only once those standbys have flushed the node's WAL up to it (`StandbyGate`):
the sources' slots are never confirmed past what a promoted standby would have, so after a failover the
other nodes still hold, and send again, what the standby had not received.

Must not: apply anything, or hold a replication origin. One psycopg connection per node,
`application_name` pgmesh-monitor, reopened on the next call after a failure.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import deque
from typing import Any, Final

import psycopg

from protocol.lsn import parse_lsn
from router.cluster.standbys import slot_names
from router.config.model import Config, NodeConfig
from router.progress.applied import FLUSHED_SQL
from router.service.status import RetainedWal
from router.stream.slots import FAILOVER_SLOTS_SINCE

__all__ = ["MonitorTarget", "StandbyGate"]

logger = logging.getLogger(__name__)

# The node's WAL flushed now, the standbys it waits for (17+; '' before), each physical slot's restart_lsn
# (for a physical slot: what its standby has flushed).
_STANDBY_SQL: Final = (
    "SELECT pg_catalog.pg_current_wal_flush_lsn()::text,"
    " coalesce(pg_catalog.current_setting('synchronized_standby_slots', true), ''),"
    " (SELECT pg_catalog.json_object_agg(slot_name, restart_lsn::text) FROM pg_catalog.pg_replication_slots"
    "  WHERE slot_type = 'physical')"
)
_SAMPLES_MAX: Final = 1000  # an older sample dropped only delays a position: later ones are higher


class StandbyGate:
    """Origin positions read on a node, let through once its standbys have the WAL they were read at.

    `let_through(positions, wal_flush, standby_flush)`: `positions` were read before the node's WAL was
    flushed to `wal_flush` (so their commits are at or below it); `standby_flush` is the least that the
    standbys have flushed (None: no standby to wait for, the positions pass as they are). Returns, per
    source, the newest positions whose `wal_flush` every standby has reached (0 before any).
    """

    __slots__ = ("_samples", "_through")

    def __init__(self) -> None:
        self._samples: deque[tuple[int, dict[str, int]]] = deque(maxlen=_SAMPLES_MAX)
        self._through: dict[str, int] = {}

    def let_through(
        self, positions: dict[str, int], wal_flush: int, standby_flush: int | None
    ) -> dict[str, int]:
        if standby_flush is None:
            self._samples.clear()
            self._keep(positions)
            return dict(positions)
        self._samples.append((wal_flush, positions))
        while self._samples and self._samples[0][0] <= standby_flush:
            self._keep(self._samples.popleft()[1])
        return {source: min(lsn, self._through.get(source, 0)) for source, lsn in positions.items()}

    def _keep(self, positions: dict[str, int]) -> None:
        for source, lsn in positions.items():
            self._through[source] = max(lsn, self._through.get(source, 0))


# pgmesh's slot on a node: WAL it keeps (from its restart_lsn to the node's WAL end), and PostgreSQL's own
# view of it: wal_status (reserved, extended, unreserved, lost) and safe_wal_size (NULL: no limit)
RETAINED_COLUMNS: Final = "(pg_catalog.pg_current_wal_lsn() - restart_lsn)::bigint, wal_status, safe_wal_size"
_RETAINED_SQL: Final = f"SELECT {RETAINED_COLUMNS} FROM pg_catalog.pg_replication_slots WHERE slot_name = %s"


class MonitorTarget:
    """The router's monitoring connection to one node as a target (flushed origin progress)."""

    def __init__(self, config: Config, node: NodeConfig) -> None:
        self.config = config
        self.node = node
        self.conn: psycopg.AsyncConnection[Any] | None = None
        self.error: str | None = None
        self.down_since: float | None = None  # since when the node has not answered (router's clock)
        self.retained: RetainedWal | None = None  # the node's slot, as last read (`read_retained`)
        self.gate = StandbyGate()
        self.started: object = None  # the node's pg_postmaster_start_time() as last read
        # it restarted since the router last saw it (`started` changed): set by `query`, taken by the
        # supervisor, whose links into the node then connect again (router.service.supervisor)
        self.restarted = False

    async def query(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        if self.conn is None or self.conn.closed:
            self.conn = await psycopg.AsyncConnection.connect(
                self.node.dsn, autocommit=True, application_name="pgmesh-monitor", connect_timeout=5
            )
            if self.config.synchronous(self.node.name) > 0:  # its writes never wait for the router itself
                await self.conn.execute("SET synchronous_commit = local")
            # (as text: psycopg parses no timestamptz in every DateStyle)
            cur = await self.conn.execute("SELECT pg_catalog.pg_postmaster_start_time()::text")
            started = (await cur.fetchall())[0][0]
            if self.started is not None and started != self.started:
                self.restarted = True
            self.started = started
        cur = await self.conn.execute(sql, params)
        return await cur.fetchall() if cur.description else []

    @property
    def connection_lost(self) -> bool:
        """No open connection to the node: the last connect failed, or the node ended the session."""
        return self.conn is None or self.conn.closed

    async def probe(self) -> dict[str, int]:
        """`origin_progress`, once more on a new connection when the one it had was lost (the node
        restarted, or its session was terminated). An error with `connection_lost` set after it means the
        node cannot be reached now (stopped, refusing connections, gone); any other is the node's answer."""
        fresh = self.connection_lost
        try:
            return await self.origin_progress()
        except psycopg.Error:
            if fresh or not self.connection_lost:
                raise
        self.drop()
        return await self.origin_progress()

    async def origin_progress(self) -> dict[str, int]:
        """source node -> flushed position of its origin on this target (and on the standbys it waits
        for: `StandbyGate`)."""
        prefix = self.config.origin_name("")
        rows = await self.query(
            FLUSHED_SQL, [prefix, prefix],
        )
        positions = {r[0][len(prefix):]: parse_lsn(r[1]) if r[1] else 0 for r in rows}
        if self.conn is None or self.conn.info.server_version < FAILOVER_SLOTS_SINCE:
            return self.gate.let_through(positions, 0, None)  # no synchronized_standby_slots before 17
        flushed, listed, slots = (await self.query(_STANDBY_SQL))[0]  # read after: at or above positions
        names = slot_names(str(listed))
        if not names:
            return self.gate.let_through(positions, 0, None)
        found = json.loads(slots) if isinstance(slots, str) else (slots or {})
        standby = min((parse_lsn(found[n]) if found.get(n) else 0 for n in names), default=0)
        return self.gate.let_through(positions, parse_lsn(flushed), standby)

    async def read_retained(self, slot: str) -> RetainedWal | None:
        """What pgmesh's slot `slot` keeps of the node's WAL (None: no such slot, e.g. a node being
        joined); kept in `retained`. A warning when PostgreSQL is about to remove WAL the slot needs."""
        rows = await self.query(_RETAINED_SQL, [slot])
        retained = RetainedWal(int(rows[0][0] or 0), rows[0][1], rows[0][2]) if rows else None
        was = self.retained.wal_status if self.retained is not None else None
        status = retained.wal_status if retained is not None else None
        if retained is not None and status in ("unreserved", "lost") and was != status:
            logger.warning(
                "node %s: slot %s keeps %d bytes of WAL and is %s: past max_slot_wal_keep_size, PostgreSQL"
                " %s the WAL it still needs to send; see docs/limits.md (retained WAL)",
                self.node.name, slot, retained.bytes, retained.wal_status,
                "removes at its next checkpoint" if retained.wal_status == "unreserved" else "has removed",
            )
        self.retained = retained
        return retained

    async def paused_sources(self) -> dict[str, str | None]:
        rows = await self.query("SELECT source, reason FROM pgmesh.links WHERE paused")
        return {r[0]: r[1] for r in rows}

    async def set_paused(self, source: str, paused: bool, reason: str | None) -> None:
        await self.query(
            "INSERT INTO pgmesh.links (source, paused, reason, updated) VALUES (%s, %s, %s, now())"
            " ON CONFLICT (source) DO UPDATE SET paused = excluded.paused, reason = excluded.reason,"
            " updated = now()",
            [source, paused, reason],
        )

    def drop(self) -> None:
        """Forget the connection without a goodbye (the node may not be reading: a close could hang)."""
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.pgconn.finish()

    async def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                await self.conn.close()
