"""The lease fence of this process's applying sessions ([ha], docs/ha.md "A fence besides time").

With a standby router configured, every session that applies or decides on a node (`open_session`:
appliers, their lanes and side sessions, the tombstone recorder) is named `pgmesh router <cluster>
<holder>` (its application_name), and opens only while this process holds the lease and the node's lease
row names this process and term. A router that takes a node's lease row over terminates the sessions of
every other holder on that node afterwards (router.service.lease): so a session of an older router either
ended before the new one applies there, or was opened before the takeover and is terminated by it, or
was opened after it and refuses here. A paused router (SIGSTOP, a frozen VM) that wakes past its deadline
therefore commits nothing more, whatever its clock says.

Must not: decide who holds the lease (router.service.lease), or connect.
"""

from __future__ import annotations

from typing import Final, Protocol

import asyncpg

from router.config.model import PGMESH_SCHEMA
from router.errors import ConnectionLost

__all__ = ["FENCE", "Fence", "application_prefix"]

_CHECK: Final = (f'SELECT 1 FROM "{PGMESH_SCHEMA}".lease'
                 " WHERE cluster = $1 AND holder = $2 AND term = $3")


class Reads(Protocol):
    """A session the fence reads its lease row through (asyncpg's, or the pipe's: router.apply.pipe)."""

    async def fetchval(self, query: str, *args: object) -> object: ...


def application_prefix(cluster: str) -> str:
    """What the application_name of every fenced session of `cluster` starts with."""
    return f"pgmesh router {cluster} "


class Fence:
    """Who this process is (`holder`) and which term it holds (0: none right now); `cluster` None: no
    [ha], nothing fenced."""

    __slots__ = ("claimed", "cluster", "holder", "term")

    def __init__(self) -> None:
        self.cluster: str | None = None
        self.holder = ""
        self.term = 0
        self.claimed: set[str] = set()  # DSNs of the nodes taken into `term` and fenced there

    def configure(self, cluster: str, holder: str) -> None:
        self.cluster, self.holder, self.term, self.claimed = cluster, holder, 0, set()

    def clear(self) -> None:
        """No [ha] (a test's next router in the same process)."""
        self.cluster, self.holder, self.term, self.claimed = None, "", 0, set()

    @property
    def application_name(self) -> str | None:
        return None if self.cluster is None else application_prefix(self.cluster) + self.holder

    async def check(self, conn: Reads | asyncpg.Connection, dsn: str) -> None:
        """Refuse a session on a node not yet fenced in this term, or whose lease row does not name this
        process and its term."""
        if self.cluster is None:
            return
        if (self.term == 0 or dsn not in self.claimed
                or not await conn.fetchval(_CHECK, self.cluster, self.holder, self.term)):
            raise ConnectionLost(
                f"this router ({self.holder}) does not hold the lease on this node (term {self.term}):"
                " another router applies, or this one lost its lease"
            )


FENCE: Final = Fence()
