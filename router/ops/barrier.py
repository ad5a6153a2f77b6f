"""The replication barrier: wait until everything committed on every member before the call (or up to given
positions) has been applied on every other member, as the running router's links report it.

`pgmesh ddl --wait`, `pgmesh part` (its drain), `pgmesh compare` and `pgmesh join` wait behind it.

Must not: change anything on a node, or put a DSN in a message.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from protocol.lsn import format_lsn, parse_lsn
from router.cluster.members import members_of
from router.config.model import Config
from router.errors import PgmeshError
from router.nodes.connect import connect
from router.progress.positions import BARRIER_POSITION_SQL
from router.service.admin import ask_router
from router.service.status import StatusReport

__all__ = ["barrier"]


async def barrier(
    config: Config, limit: float = 300.0, wanted: dict[str, int] | None = None
) -> dict[str, int]:
    """Wait until every node's position when called (`BARRIER_POSITION_SQL`; or `wanted`: node ->
    position) is flushed by every other node: everything committed anywhere before has been applied
    everywhere. Asks the running router (each link's `synced_lsn`: the slots' confirmed positions may run
    ahead of the targets on the router log's account)."""
    if wanted:
        return await _wait_synced(config, limit, wanted)
    config = await members_of(config)  # a parted node is not waited for
    conns = {node.name: await connect(node, purpose="pgmesh ddl") for node in config.nodes}
    try:
        wanted = {}
        for name, conn in conns.items():
            cur = await conn.execute(BARRIER_POSITION_SQL)
            row = await cur.fetchone()
            assert row is not None
            wanted[name] = int(row[0])
    finally:
        for conn in conns.values():
            await conn.close()
    return await _wait_synced(config, limit, wanted)


async def _wait_synced(config: Config, limit: float, wanted: dict[str, int]) -> dict[str, int]:
    deadline = time.monotonic() + limit
    while True:
        reply = await ask_router(config, "GET", "/status")
        if reply is None or reply[0] != 200:
            raise PgmeshError("replication barrier: the router does not answer",
                              hint="is `pgmesh run` running? the barrier waits for its links")
        report = msgspec.json.decode(reply[1], type=StatusReport)
        late = {
            f"{link.source} -> {link.target}": wanted[link.source] for link in report.links
            if link.source in wanted and parse_lsn(link.synced_lsn) < wanted[link.source]
        }
        if not late:
            return wanted
        if time.monotonic() > deadline:
            text = ", ".join(f"{n} (wants {format_lsn(lsn)})" for n, lsn in sorted(late.items()))
            raise PgmeshError(
                f"replication barrier not reached after {limit:.0f} s: {text}",
                hint="is every link streaming? see `pgmesh status`",
            )
        await asyncio.sleep(0.1)
