"""`pgmesh ddl`: run a statement cluster-wide on purpose, optionally behind a replication barrier.

The statement runs on one node (default: the first in the config); the capture trigger
(`router.ddl.capture`) replicates it like any other DDL. With `--wait`, a barrier first lets every link
catch up (every node's slot confirmed up to that node's WAL position when asked), and a second one
returns once the statement has reached every node. The barrier needs the router running.

Under `[ddl] mode = "locked"` the nodes refuse direct DDL (`router.ddl.capture`); this is the way in: it
always drains first (the barrier: no change in flight anywhere), runs the statement in a session with
`pgmesh.ddl = on` (which the capture trigger accepts), then waits until every node replayed it. So is
`ALTER TYPE ... ADD VALUE` in every mode (the nodes refuse it typed directly: labels added on two nodes at
once would sort differently on each): it always waits, too.

Runs that wait take a cluster-wide lock first (`CLUSTER_LOCK`, a session advisory lock on the first
member node, held until the statement is on every node): two `pgmesh ddl` started at once from two shells
run one after the other, each behind its barriers, so their commands reach every node in one order.

Must not: parse arguments (that is `router.ops.cli`), replicate anything itself, or put a DSN into a
message (psycopg errors go through `describe`).
"""

from __future__ import annotations

import asyncio
import re
import time

import psycopg

from router.cluster.members import members_of
from router.config.model import Config, NodeConfig
from router.ddl.capture import ALLOWED_SETTING
from router.errors import PgmeshError, describe
from router.nodes.connect import Conn, connect
from router.ops.barrier import barrier

__all__ = ["CLUSTER_LOCK", "cmd_ddl", "orders_itself"]

# pg_advisory_lock(classid, objid) of `pgmesh ddl` runs that wait ("pgmesh", "ddl" in ASCII)
CLUSTER_LOCK = (0x70676D65, 0x64646C)

# commands whose effect depends on the order they run in across nodes (enum labels' sort order)
_ORDERED = re.compile(r"\balter\s+type\b.*\badd\s+value\b", re.IGNORECASE | re.DOTALL)


def orders_itself(statement: str) -> bool:
    """Whether `statement` must run behind the barrier and the cluster lock whatever the mode (it adds
    enum labels; a comment that looks so only makes it wait)."""
    return _ORDERED.search(statement) is not None


async def cmd_ddl(
    config: Config, statement: str, *, node: str | None = None, wait: bool = False, limit: float = 300.0
) -> int:
    """Run `statement` on one node (default: the first); the capture trigger replicates it. With `wait`
    (always under `[ddl] mode = "locked"`), first let every link catch up, then wait until the statement
    has reached every node."""
    target = next((n for n in config.nodes if node is None or n.name == node), None)
    if target is None:
        raise PgmeshError(f"no node {node!r} in the config")
    wait = wait or config.ddl.mode == "locked" or orders_itself(statement)
    if not wait:
        await _run(target, statement)
        return 0
    holder = await connect((await members_of(config)).nodes[0], purpose="pgmesh ddl")
    try:
        await _lock(holder, limit)
        await barrier(config, limit)
        print("barrier: every link has caught up")
        await _run(target, statement)
        await barrier(config, limit)
        print("barrier: applied on every node")
    finally:
        await holder.close()  # (the lock goes with the session)
    return 0


async def _lock(holder: Conn, limit: float) -> None:
    """The cluster-wide lock of `pgmesh ddl` runs that wait (`CLUSTER_LOCK`), within `limit` seconds."""
    deadline = time.monotonic() + limit
    while True:
        cur = await holder.execute("SELECT pg_catalog.pg_try_advisory_lock(%s, %s)", list(CLUSTER_LOCK))
        row = await cur.fetchone()
        if row is not None and row[0]:
            return
        if time.monotonic() > deadline:
            raise PgmeshError(
                f"another `pgmesh ddl` still runs after {limit:.0f} s",
                hint="see pg_stat_activity (application_name 'pgmesh ddl') on the first node",
            )
        await asyncio.sleep(0.2)


async def _run(target: NodeConfig, statement: str) -> None:
    async with await connect(target, purpose="pgmesh ddl") as conn:
        try:
            # the locked capture trigger lets this session's DDL through (a guard, not a boundary); so
            # does the refusal of ADD VALUE typed directly
            await conn.execute("SELECT pg_catalog.set_config(%s, 'on', false)", [ALLOWED_SETTING])
            await conn.execute(statement.encode())  # the operator's own SQL, as given
        except psycopg.Error as exc:
            raise PgmeshError(
                f"the statement failed: {describe(exc)}", node=target.name, sqlstate=exc.sqlstate,
                hint=exc.diag.message_hint,
            ) from None
    print(f"node {target.name}: done")
