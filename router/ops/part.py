"""`pgmesh part NODE [--clean]`: the cluster forgets a node, with the router running or not.

1. Drain (the router running): a barrier on NODE alone (`router.ops.barrier`): every link out of
   NODE has applied everything NODE committed before the part began. Then the router is held (`POST
   /hold`: it stops streaming, writes go on) and NODE's slot is read without consuming it
   (`pg_logical_slot_peek_binary_changes`): a transaction of NODE's own (no replication origin) with row
   changes that ends past what some other node has applied from NODE was committed after the drain, or
   is held only in the router's log: the router is released and the drain runs again, at most
   `DRAIN_ROUNDS` times; then the part is refused (stop the application's writes to NODE first). Without
   the router the same check runs on the slot as it is, so a part never drops what NODE committed and
   no other node has.
2. The part is recorded on every other node (`pgmesh.parted`): the cluster's own state, so the config
   needs no edit. The router leaves parted nodes out (`without_parted`: at start and after a hold), as
   does `pgmesh init`; `pgmesh join NODE` brings one back (it clears the record).
3. The others drop what they keep for NODE (its replication origins, its link row); NODE's slot is
   dropped (it holds no WAL any more). `--clean` removes all of pgmesh from NODE, its snowflake ids turned
   into its own sequences first (router.sequences.convert.to_local): a standalone database that keeps
   working.
4. The router is released: it rebuilds without NODE.

Must not: put a DSN in a message, or drop anything before the drain is shown complete.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Final

import psycopg

from protocol.lsn import format_lsn
from router.cluster.install import uninstall
from router.cluster.joining import unpin
from router.cluster.members import PARTED_DDL
from router.config.model import Config
from router.errors import PgmeshError, describe
from router.nodes.connect import Conn, connect, one
from router.ops.barrier import barrier
from router.progress.applied import position_sql
from router.progress.positions import BARRIER_POSITION_SQL
from router.service.admin import ask_router

__all__ = ["DRAIN_ROUNDS", "cmd_part", "part_node"]

logger = logging.getLogger(__name__)

DRAIN_ROUNDS: Final = 3
# NODE's slot, read without consuming: each transaction's rows (pgoutput v1, binary), from its confirmed
# position on. A message's first byte is its type: B(egin), O(rigin), I/U/D/T (rows), C(ommit).
_PEEK_SQL: Final = (
    "SELECT xid::text::bigint, data FROM pg_catalog.pg_logical_slot_peek_binary_changes(%s, NULL, NULL,"
    " 'proto_version', '1', 'publication_names', %s)"
)
_ROW_TYPES: Final = frozenset(b"IUDT")


# ---------------------------------------------------------------------------------------------------------
# The drain


def _late_transactions(rows: Sequence[tuple[int, bytes]], applied: int) -> list[tuple[int, int]]:
    """From a peek of NODE's slot: (xid, end LSN) of NODE's own transactions with row changes that end
    past `applied` (the least any other node has applied from NODE)."""
    late: list[tuple[int, int]] = []
    own: dict[int, bool] = {}
    rows_in: dict[int, bool] = {}
    for xid, data in rows:
        kind = data[:1]
        if kind == b"B":
            own[xid], rows_in[xid] = True, False
        elif kind == b"O":
            own[xid] = False
        elif kind and kind[0] in _ROW_TYPES:
            rows_in[xid] = True
        elif kind == b"C" and len(data) >= 18:
            end = int.from_bytes(data[10:18], "big")  # C, flags (1), commit LSN (8), end LSN (8)
            if own.get(xid, True) and rows_in.get(xid, False) and end > applied:
                late.append((xid, end))
    return late


async def _undrained(config: Config, name: str, conns: dict[str, Conn]) -> list[tuple[int, int]]:
    """NODE's own transactions that some other node has not applied (see `_late_transactions`)."""
    applied = None
    position = f"SELECT ({position_sql('%s', '%s', True)} - '0/0')::bigint"
    for other, conn in conns.items():
        if other == name:
            continue
        if await one(conn, "SELECT 1 FROM pg_catalog.pg_replication_origin WHERE roname = %s",
                      [config.origin_name(name)]) is None:
            continue  # forgotten here already (an earlier part)
        lsn = await one(conn, position, [config.origin_name(name), name])
        applied = int(lsn or 0) if applied is None else min(applied, int(lsn or 0))
    conn = conns[name]
    try:
        if applied is None or await one(conn, "SELECT 1 FROM pg_catalog.pg_replication_slots"
                                          " WHERE slot_name = %s", [config.slot_name]) is None:
            return []  # no slot, or no one keeps its position: parted before (or never streamed)
        cur = await conn.execute(_PEEK_SQL, [config.slot_name, config.publication_name])
    except psycopg.Error as exc:
        raise PgmeshError(f"cannot read this node's slot to check the drain: {describe(exc)}", node=name,
                          sqlstate=exc.sqlstate,
                          hint="a router streaming from it must have its admin listener on (part holds it)"
                          ) from None
    rows = [(int(x), bytes(d)) for x, d in await cur.fetchall()]
    return _late_transactions(rows, applied)


async def _slot_let_go(config: Config, name: str, conn: Conn, limit: float = 60.0) -> None:
    """Wait until no walsender holds the node's slot (the router's, held: it ends a moment after)."""
    deadline = asyncio.get_running_loop().time() + limit
    query = "SELECT active_pid FROM pg_catalog.pg_replication_slots WHERE slot_name = %s"
    while await one(conn, query, [config.slot_name]) is not None:
        if asyncio.get_running_loop().time() > deadline:
            raise PgmeshError(f"the router held, but the slot stayed active for {limit:g} s", node=name)
        await asyncio.sleep(0.05)


async def _drain(config: Config, name: str, conns: dict[str, Conn], limit: float) -> bool:
    """With the router running: barrier on NODE, hold, check; True when held and drained."""
    for round_ in range(1, DRAIN_ROUNDS + 1):
        position = int(await one(conns[name], BARRIER_POSITION_SQL))
        await barrier(config, limit, wanted={name: position})
        answer = await ask_router(config, "POST", "/hold", limit=150.0)
        if answer is None or answer[0] != 200:
            raise PgmeshError("the router did not take a hold", hint="is `pgmesh run` still running?")
        try:
            await _slot_let_go(config, name, conns[name])
            late = await _undrained(config, name, conns)
        except BaseException:
            await ask_router(config, "POST", "/release")  # (part_node releases only a drained hold)
            raise
        if not late:
            return True
        logger.info("part %s: %d transaction(s) committed there after the drain (round %d); draining again",
                    name, len(late), round_)
        await ask_router(config, "POST", "/release")
    raise PgmeshError(
        f"node {name} is still being written to: after {DRAIN_ROUNDS} drains, transactions it committed"
        " have not reached every other node", node=name,
        hint="stop the application's writes to this node, then run part again (nothing was changed)",
    )


# ---------------------------------------------------------------------------------------------------------
# The part


async def part_node(config: Config, name: str, *, clean: bool = False, limit: float = 300.0) -> list[str]:
    """The cluster forgets `name` (see the module docstring); one line per thing done."""
    config.node(name)
    conns: dict[str, Conn] = {}
    unreachable: list[str] = []
    held = False
    for node in config.nodes:
        try:
            conns[node.name] = await connect(node, purpose="pgmesh part", admin=True)
        except PgmeshError as exc:
            if node.name != name:
                unreachable.append(f"{node.name} ({exc.message})")
    lines: list[str] = []
    try:
        if unreachable:
            raise PgmeshError(
                f"every other node must be reachable to part a node; cannot reach {', '.join(unreachable)}",
                hint="start them, then run part again (nothing was changed)",
            )
        if name in conns:
            if await ask_router(config, "GET", "/status") is not None:
                held = await _drain(config, name, conns, limit)
                lines.append(f"node {name}: drained (everything it committed is on every other node)")
            else:
                late = await _undrained(config, name, conns)
                if late:
                    xid, end = late[0]
                    raise PgmeshError(
                        f"{len(late)} transaction(s) committed here have not reached every other node (the"
                        f" first: xid {xid}, ending at {format_lsn(end)})", node=name,
                        hint="start `pgmesh run` and run part again: it drains them first",
                    )
        lines += await _forget(config, name, conns, clean)
    finally:
        for conn in conns.values():
            await conn.close()
        if held:
            await ask_router(config, "POST", "/release")
    return lines


async def _forget(config: Config, name: str, conns: dict[str, Conn], clean: bool) -> list[str]:
    lines: list[str] = []
    for other, conn in conns.items():
        if other == name:
            continue
        if await one(conn, "SELECT pg_catalog.to_regnamespace('pgmesh')") is not None:
            await conn.execute(PARTED_DDL)
            await conn.execute("INSERT INTO pgmesh.parted (node) VALUES (%s) ON CONFLICT (node) DO NOTHING",
                               [name])
            await conn.execute("DELETE FROM pgmesh.links WHERE source = %s", [name])
        for origin in (config.origin_name(name), config.early_origin_name(name)):
            if await one(conn, "SELECT roident FROM pg_replication_origin WHERE roname = %s",
                          [origin]) is not None:
                await conn.execute("SELECT pg_replication_origin_drop(%s)", [origin])
                lines.append(f"node {other}: dropped replication origin {origin}")
    await unpin({other: conn for other, conn in conns.items() if other != name}, name)  # a join's pins
    lines.append(f"recorded on {', '.join(n for n in conns if n != name)}: {name} is parted")
    if name not in conns:
        return [*lines, f"node {name} is not reachable: its slot stays until you drop it there"]
    if clean:
        return lines + await uninstall(config, name)
    conn = conns[name]
    if await one(conn, "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", [config.slot_name]):
        await conn.execute("SELECT pg_drop_replication_slot(%s)", [config.slot_name])
        lines.append(f"node {name}: dropped slot {config.slot_name} (it holds no WAL any more)")
    return lines


async def cmd_part(config: Config, node: str, *, clean: bool = False) -> int:
    for line in await part_node(config, node, clean=clean):
        print(line)
    print(f"node {node} is parted: the router leaves it out (the config may keep it; `pgmesh join {node}`"
          " brings it back); its database stays usable on its own"
          + ("" if clean else f" (`pgmesh part {node} --clean` removes pgmesh's objects from it)"))
    return 0
