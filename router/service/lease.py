"""The standby router's lease ([ha] enabled; the argument is docs/ha.md).

Every node holds one row per cluster, `pgmesh.lease (cluster, holder, term, expires_at)`. A router applies
only while it holds the lease:

- **Acquire** (`Lease.acquire`, a standby polls every lease_s / 3, or just after a majority of the rows it
  read expire when that is sooner): read the row on every node reached;
  when a majority of the configured nodes show it free or expired by their own clocks, compare-and-set
  each of those to (this router, highest term seen + 1, now() + lease_s). It holds the lease once a
  majority took the new term; otherwise it gives back the rows it took and tries again later.
- **Renew** (`_keep`, every lease_s / 3, each round bounded by the validity left): `expires_at = now() +
  lease_s` where the row names this router and term; a row with a lower term (a node that was out of
  reach) is taken over. With a majority renewed in a round started at `t0` on the monotonic clock, the
  lease is valid until `t0 + lease_s * (1 - drift) / (1 + drift) - margin_s`. At that moment without a
  newer renewal, or at once when any node shows a higher term, `lost` is set: the router stops applying
  (router.service.supervisor) and becomes a standby again.
- **Fence** (`_take`): on each node it takes over, after the row names it, the router terminates the
  applying sessions of every other holder (router.apply.fence) and the walsender on the cluster's slot,
  and waits for them to end; only then may its own applying sessions open there (`FENCE.claimed`).
- **Release** (`give_up`, a clean stop): the row expires at once, so a standby takes over at its next poll.

Must not: apply, stream, or decide what stopping means (the supervisor does); hold a row past a failed
acquisition.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final

import asyncpg

from router.apply.fence import FENCE, application_prefix
from router.apply.sessions import asyncpg_connect_args
from router.config.model import PGMESH_SCHEMA, Config
from router.errors import describe
from router.service.status import LeaseNode, LeaseStatus

__all__ = ["Lease", "LeaseRow", "lease_for"]

logger = logging.getLogger(__name__)

_T: Final = f'"{PGMESH_SCHEMA}".lease'
_CREATE: Final = (f"CREATE TABLE IF NOT EXISTS {_T} (cluster text PRIMARY KEY, holder text,"
                  " term bigint NOT NULL DEFAULT 0, expires_at timestamptz NOT NULL DEFAULT '-infinity')")
_ROW: Final = f"INSERT INTO {_T} (cluster) VALUES ($1) ON CONFLICT (cluster) DO NOTHING"
_READ: Final = (f"SELECT holder, term,"  # (seconds left: -Infinity for a row never held)
                 " (extract(epoch FROM expires_at) - extract(epoch FROM pg_catalog.now()))::float8"
                f" FROM {_T} WHERE cluster = $1")
_EXPIRES: Final = "pg_catalog.now() + $4 * interval '1 second'"
_CAS: Final = (f"UPDATE {_T} SET holder = $2, term = $3, expires_at = {_EXPIRES} WHERE cluster = $1"
               " AND term < $3 AND (holder IS NULL OR expires_at < pg_catalog.now()) RETURNING 1")
_RENEW: Final = (f"UPDATE {_T} SET expires_at = {_EXPIRES}"
                 " WHERE cluster = $1 AND holder = $2 AND term = $3 RETURNING 1")
_TAKE: Final = (f"UPDATE {_T} SET holder = $2, term = $3, expires_at = {_EXPIRES}"
                " WHERE cluster = $1 AND term < $3 RETURNING 1")
_GIVE_BACK: Final = (f"UPDATE {_T} SET expires_at = '-infinity' WHERE cluster = $1 AND holder = $2"
                     " AND term = $3")
# The sessions of other holders on this node, and the walsender on the slot: terminated, waited for (5 s).
_END_OTHERS: Final = (
    "SELECT pg_catalog.bool_and(pg_catalog.pg_terminate_backend(pid, 5000)) FROM ("
    " SELECT pid FROM pg_catalog.pg_stat_activity WHERE pg_catalog.starts_with(application_name, $1)"
    " AND application_name <> $2 AND pid <> pg_catalog.pg_backend_pid()"
    " UNION SELECT active_pid FROM pg_catalog.pg_replication_slots WHERE slot_name = $3"
    " AND active_pid IS NOT NULL) s"
)


def lease_for(config: Config) -> Lease | None:
    """The router's lease with [ha] enabled; else None, and no session of this process is fenced."""
    if not config.ha.enabled:
        FENCE.clear()
        return None
    return Lease(config)


class LeaseRow:
    """A node's lease row as last read: holder, term, seconds to expiry by the node's clock."""

    __slots__ = ("expires_in", "holder", "term")

    def __init__(self, holder: str | None, term: int, expires_in: float) -> None:
        self.holder, self.term, self.expires_in = holder, term, expires_in


class Lease:
    """This router's part in the lease of `config`'s cluster (module docstring)."""

    def __init__(self, config: Config, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        ha = config.ha
        base = (ha.name or socket.gethostname())[:24]
        self.holder = f"{base}-{os.getpid()}-{secrets.token_hex(2)}"
        self.term = 0
        self.valid_until = 0.0  # monotonic
        self.role = "standby"
        self.why = "starting"
        self.rows: dict[str, LeaseRow] = {}
        self.lost = asyncio.Event()
        self.period = ha.lease_s / 3
        self._conns: dict[str, asyncpg.Connection] = {}
        self._keeper: asyncio.Task[None] | None = None
        FENCE.configure(config.cluster.name, self.holder)

    @property
    def quorum(self) -> int:
        return len(self.config.nodes) // 2 + 1

    @property
    def _app(self) -> str:
        return application_prefix(self.config.cluster.name) + self.holder

    def _validity(self, t0: float) -> float:
        ha = self.config.ha
        return t0 + ha.lease_s * (1 - ha.drift) / (1 + ha.drift) - ha.margin_s

    def valid_for(self) -> float:
        return max(0.0, self.valid_until - self.clock()) if self.role == "active" else 0.0

    # ---------------------------------------------------------------- per node

    async def _conn(self, node: str) -> asyncpg.Connection:
        conn = self._conns.get(node)
        if conn is not None and not conn.is_closed():
            return conn
        args = asyncpg_connect_args(self.config.node(node).dsn)
        args["server_settings"] = {**args.get("server_settings", {}),
                                   "application_name": f"pgmesh lease {self.config.cluster.name}"}
        args["timeout"] = self.period
        conn = await asyncpg.connect(**args)
        try:
            if await conn.fetchval("SELECT pg_catalog.to_regclass($1) IS NULL", f"{PGMESH_SCHEMA}.lease"):
                await conn.execute(_CREATE)
            await conn.execute(_ROW, self.config.cluster.name)
        except BaseException:
            conn.terminate()
            raise
        self._conns[node] = conn
        return conn

    async def _each(self, nodes: Iterable[str],
                    step: Callable[[str, asyncpg.Connection], Awaitable[Any]]) -> dict[str, Any]:
        """`step` on every node in parallel, each within one period; a failure is that node's result."""
        async def one(node: str) -> Any:
            try:
                async with asyncio.timeout(self.period):
                    return await step(node, await self._conn(node))
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
                # a node out of reach is what a lease is for; an SQL error is worth saying
                logger.log(logging.WARNING if isinstance(exc, asyncpg.PostgresError) else logging.DEBUG,
                           "lease: node %s: %s", node, describe(exc))
                conn = self._conns.pop(node, None)
                if conn is not None:
                    conn.terminate()
                return exc
        names = list(nodes)
        return dict(zip(names, await asyncio.gather(*(one(n) for n in names)), strict=True))

    async def _read(self, node: str, conn: asyncpg.Connection) -> LeaseRow:
        holder, term, left = await conn.fetchrow(_READ, self.config.cluster.name)
        row = LeaseRow(holder, int(term), float(left))
        self.rows[node] = row
        return row

    async def _take(self, node: str, conn: asyncpg.Connection) -> bool:
        """Fence a node whose row now names this router: end the other holders' sessions there."""
        ended = await conn.fetchval(_END_OTHERS, application_prefix(self.config.cluster.name), self._app,
                                    self.config.slot_name)
        if ended is False:
            raise TimeoutError("another router's session on it did not end within 5 s")
        FENCE.claimed.add(self.config.node(node).dsn)
        return True

    # ---------------------------------------------------------------- acquire, keep, give up

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait as a standby until this router holds the lease (True), or `stop` is set (False)."""
        self.lost.clear()
        self.role, self.term = "standby", 0
        FENCE.term, FENCE.claimed = 0, set()
        while not stop.is_set():
            try:
                if await self._try_acquire():
                    self._keeper = asyncio.create_task(self._keep(), name="lease")
                    return True
            except Exception as exc:  # a bug must not make a standby give up: it says so and polls on
                logger.error("lease: acquiring failed: %s", describe(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._pause())
        return False

    def _pause(self) -> float:
        """Until the next try: a poll period (with jitter, so that standbys do not race in step), or less
        when the rows read show a majority expiring sooner: just after that (each by its node's clock)."""
        wait = self.period * (0.75 + random.random() / 2)
        if len(self.rows) >= self.quorum:
            left = sorted(max(0.0, r.expires_in) for r in self.rows.values())[self.quorum - 1]
            wait = min(wait, left + 0.02 + random.random() * 0.05)
        return wait

    async def _try_acquire(self) -> bool:
        rows = {n: r for n, r in (await self._each(self.config.node_names, self._read)).items()
                if isinstance(r, LeaseRow)}
        if len(rows) < self.quorum:
            self.why = f"{len(rows)} of {len(self.config.nodes)} nodes reached; a majority is {self.quorum}"
            return False
        free = [n for n, r in rows.items() if r.holder is None or r.expires_in < 0]
        if len(free) < self.quorum:
            holders = sorted({r.holder or "" for r in rows.values() if r.expires_in >= 0})
            self.why = f"held by {', '.join(holders)}"
            return False
        term = max(r.term for r in rows.values()) + 1
        cluster, lease_s = self.config.cluster.name, self.config.ha.lease_s
        t0 = self.clock()

        async def cas(_node: str, conn: asyncpg.Connection) -> bool:
            return bool(await conn.fetchval(_CAS, cluster, self.holder, term, lease_s))

        won = [n for n, ok in (await self._each(free, cas)).items() if ok is True]
        if len(won) < self.quorum:
            async def give_back(_node: str, conn: asyncpg.Connection) -> None:
                await conn.execute(_GIVE_BACK, cluster, self.holder, term)

            await self._each(won, give_back)
            self.why = f"term {term}: {len(won)} of {len(free)} free rows taken; another router raced"
            return False
        self.term, FENCE.term = term, term
        self.valid_until = self._validity(t0)
        for node in won:
            self.rows[node] = LeaseRow(self.holder, term, lease_s)
        fenced = [n for n, ok in (await self._each(won, self._take)).items() if ok is True]
        if self.clock() >= self.valid_until or len(fenced) < self.quorum:
            self.why = f"term {term}: fenced {len(fenced)} nodes before the deadline; trying again"
            await self.give_up()
            return False
        self.role, self.why = "active", f"term {term} on {', '.join(sorted(won))}"
        logger.warning("lease: this router (%s) holds term %d on %s: it applies", self.holder, term,
                       ", ".join(sorted(won)))
        return True

    async def _keep(self) -> None:
        """Renew until stepped down or out of time; then set `lost`."""
        cluster, lease_s = self.config.cluster.name, self.config.ha.lease_s
        higher: list[str] = []

        async def renew(node: str, conn: asyncpg.Connection) -> bool:
            if await conn.fetchval(_RENEW, cluster, self.holder, self.term, lease_s):
                self.rows[node] = LeaseRow(self.holder, self.term, lease_s)
                if self.config.node(node).dsn not in FENCE.claimed:
                    await self._take(node, conn)
                return True
            row = await self._read(node, conn)
            if row.term > self.term:
                higher.append(f"node {node} shows term {row.term} ({row.holder})")
                return False
            if await conn.fetchval(_TAKE, cluster, self.holder, self.term, lease_s):
                self.rows[node] = LeaseRow(self.holder, self.term, lease_s)
                logger.info("lease: node %s taken into term %d", node, self.term)
                return await self._take(node, conn)
            return False

        why = "renewals reached no majority before the lease ran out"
        while True:
            left = self.valid_until - self.clock()
            if left <= 0:
                break
            t0 = self.clock()
            try:
                async with asyncio.timeout(left):
                    got = await self._each(self.config.node_names, renew)
            except TimeoutError:
                break
            if higher:
                why = "; ".join(higher)
                break
            if sum(1 for ok in got.values() if ok is True) >= self.quorum:
                self.valid_until = self._validity(t0)
            now = self.clock()
            await asyncio.sleep(max(0.0, min(t0 + self.period - now, self.valid_until - now)))
        self._lose(why)

    def _lose(self, why: str) -> None:
        self.role, self.why = "standby", f"lost term {self.term}: {why}"
        FENCE.term, FENCE.claimed = 0, set()
        logger.error("lease: this router (%s) stops applying: %s", self.holder, self.why)
        self.lost.set()

    async def give_up(self) -> None:
        """Let the lease go now (a clean stop, after every applier stopped): a standby takes over at once."""
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
            self._keeper = None
        if self.term:
            cluster, term = self.config.cluster.name, self.term

            async def give_back(_node: str, conn: asyncpg.Connection) -> None:
                await conn.execute(_GIVE_BACK, cluster, self.holder, term)

            await self._each(self.config.node_names, give_back)
        self.role, self.term = "standby", 0
        FENCE.term, FENCE.claimed = 0, set()

    async def close(self) -> None:
        for conn in self._conns.values():
            conn.terminate()
        self._conns = {}

    def report(self) -> LeaseStatus:
        """For /status and /metrics: this router's role and term, its lease's validity, each node's row."""
        return LeaseStatus(self.role, self.holder, self.term, round(self.valid_for(), 3), self.why,
                           {n: LeaseNode(r.holder, r.term, round(r.expires_in, 3))
                            for n, r in sorted(self.rows.items())})
