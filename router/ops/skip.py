"""`pgmesh skip --source A --target B --lsn X/Y`: the link A -> B leaves out A's transaction that ends at
X/Y (the LSN the link's error and `pgmesh status` show), as PostgreSQL's `ALTER SUBSCRIPTION ... SKIP`.

With a router running, through its admin listener (`POST /skip`): the router refuses an LSN at or
before what B applied, or another one than the transaction a link held on an error is stuck on, records
the skip on B and runs the link again. Without one, the skip is recorded on B (`pgmesh.links.skip_lsn`),
refused only at or before what B applied; the router reads it when its link connects. Either way the
link leaves out only a transaction that ends exactly there, records it in B's `pgmesh.conflict_history`
(type `skipped`, shown by `pgmesh conflicts`), and drops a skip that no transaction matches
(router.apply.skip).

Must not: apply, pause or resume anything itself, or record a skip the target cannot check.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO
from urllib.parse import urlencode

import msgspec
import psycopg

from protocol.lsn import parse_lsn
from router.apply.skip import check_skip, parse_skip, record_skip
from router.cluster.members import members_of
from router.config.model import Config
from router.errors import PgmeshError, describe
from router.progress.applied import position_sql
from router.service.admin import ask_router

__all__ = ["cmd_skip"]

_LIMIT_S = 10.0


async def cmd_skip(config: Config, source: str, target: str, lsn: str, out: TextIO = sys.stdout) -> int:
    """0: the skip is recorded (and, with a router, the link runs again); 1: the router refused it."""
    for name in (source, target):
        config.node(name)  # a clear error for an unknown node
    at = parse_skip(lsn)
    if source == target:
        raise PgmeshError(f"--source and --target are both {source}: a link joins two nodes")
    query = urlencode({"source": source, "target": target, "lsn": lsn})
    reply = await ask_router(config, "POST", f"/skip?{query}", limit=_LIMIT_S + 5)
    if reply is not None and reply[0] == 200:
        print(f"skip: {msgspec.json.decode(reply[1])}", file=out)
        return 0
    if reply is not None:
        body = reply[1].decode(errors="replace").strip()
        try:
            body = str(msgspec.json.decode(reply[1])["error"])
        except (msgspec.DecodeError, KeyError, TypeError):
            pass
        print(f"the router refused: HTTP {reply[0]}: {body}", file=out)
        return 1
    print(f"skip: {await _offline(config, source, target, at)}", file=out)
    return 0


async def _offline(config: Config, source: str, target: str, lsn: int) -> str:
    """No router: check the LSN against what the target applied, and record the skip there."""
    config = await members_of(config)
    if not any(n.name == target for n in config.nodes) or config.node(source).receive_only:
        raise PgmeshError(f"there is no link {source} -> {target} (not both members, or {source} only"
                          " receives)", node=target)
    try:
        conn = await psycopg.AsyncConnection.connect(config.node(target).dsn, autocommit=True,
                                                     connect_timeout=5)
    except psycopg.Error as exc:
        raise PgmeshError(f"cannot connect ({describe(exc)}); nothing skipped", node=target,
                          hint="bring the node up, or start `pgmesh run`, and run this again") from None
    async with conn:
        cur = await conn.execute(f"SELECT {position_sql('%s', '%s', True)}::text",
                                 [config.origin_name(source), source])
        row = await cur.fetchone()
        applied = int(parse_lsn(row[0])) if row and row[0] else 0
        text = check_skip(lsn, link=f"{source} -> {target}", target=target, applied=applied, stuck=None)

        async def query(sql: str, params: Any) -> object:
            return await conn.execute(sql, params)

        await record_skip(query, source, lsn, target, _LIMIT_S)
    return f"{text}; recorded on {target} (router not running: its link reads it when it starts)"
