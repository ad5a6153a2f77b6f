"""A node joining while the router runs: the record that keeps it out of the router's members, and the pins
that keep every source's slot from being confirmed past what the new node will read (docs/join.md).

While `pgmesh join N` copies, the router streams among the other nodes. The new node reads each source X
from a position fixed at the snapshot (P_X), so X's slot must keep everything after it until N is one of
the router's targets. Join writes, on every member X, a row `(N, pin)` in `pgmesh.joining`, the pin being
X's slot's confirmed position read while the router holds; the router reads the pins at its start and
after every hold (`read_pins`) and never confirms X's slot past the lowest pin on X. The same rows keep N
out of the router's members (the second answer of `read_pins`) until join has installed pgmesh on N and
set its origins; join then deletes them (`unpin`) while the router still holds, and releases it.

A join that fails before it installs pgmesh on N deletes its rows as it exits. Rows of a join killed
midway (or failing later) stay, and hold WAL on every node: the router warns at each start, the next
`pgmesh join N` writes them again, `pgmesh part N` and a successful join delete them.

A joined node also takes over the donor's `pgmesh.auto_identity` (`copy_auto_identity`), so that a primary
key added later makes its tables REPLICA IDENTITY DEFAULT again there as on the others.

Must not: decide positions (router.ops.join does). Join passes its own sessions; `read_pins`
connects to each node for the router, within a bound, and a node that does not answer pins nothing then.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Final

import psycopg
from psycopg import sql

from protocol.lsn import format_lsn, parse_lsn
from router.config.model import PGMESH_SCHEMA, Config, NodeConfig
from router.errors import PgmeshError, describe
from router.nodes.connect import Conn

__all__ = ["JOINING_DDL", "copy_auto_identity", "pin_sources", "read_pins", "unpin"]

logger = logging.getLogger(__name__)

JOINING_DDL: Final = sql.SQL(
    "CREATE TABLE IF NOT EXISTS {}.joining (node text PRIMARY KEY, pin pg_lsn NOT NULL,"
    " at timestamptz NOT NULL DEFAULT now())"
).format(sql.Identifier(PGMESH_SCHEMA))
_READ_SQL: Final = "SELECT node, pin::text, round(extract(epoch FROM now() - at)) FROM pgmesh.joining"
_CONFIRMED_SQL: Final = (
    "SELECT confirmed_flush_lsn::text FROM pg_catalog.pg_replication_slots WHERE slot_name = %s"
)


async def pin_sources(conns: Mapping[str, Conn], config: Config, node: str) -> dict[str, int]:
    """On every member (`conns`: name -> session, the new node not among them), record `node` as joining
    with its slot's confirmed position as the pin; return the pins. Run while the router holds (or is
    not running): then nothing confirms a slot further, and a confirmation the router sent before it knew
    the pin is already in the position read."""
    pins: dict[str, int] = {}
    for name, conn in conns.items():
        try:
            cur = await conn.execute(_CONFIRMED_SQL, [config.slot_name])
            row = await cur.fetchone()
            if row is None or row[0] is None:
                raise PgmeshError(f"pgmesh's slot {config.slot_name} is missing", node=name,
                                  hint="run `pgmesh init` on the existing nodes first")
            pins[name] = parse_lsn(str(row[0]))
            await conn.execute(JOINING_DDL)
            await conn.execute(
                "INSERT INTO pgmesh.joining (node, pin) VALUES (%s, %s::pg_lsn)"
                " ON CONFLICT (node) DO UPDATE SET pin = excluded.pin, at = now()",
                [node, format_lsn(pins[name])],
            )
        except psycopg.Error as exc:
            raise PgmeshError(f"cannot record the join: {describe(exc)}", node=name,
                              sqlstate=exc.sqlstate) from None
    return pins


async def unpin(conns: Mapping[str, Conn], node: str) -> None:
    """`node` is no longer joining (joined, or parted): its rows go from every node in `conns`."""
    for name, conn in conns.items():
        try:
            cur = await conn.execute("SELECT pg_catalog.to_regclass('pgmesh.joining') IS NOT NULL")
            row = await cur.fetchone()
            if row is not None and row[0]:
                await conn.execute("DELETE FROM pgmesh.joining WHERE node = %s", [node])
        except psycopg.Error as exc:
            raise PgmeshError(f"cannot clear the join's record: {describe(exc)}", node=name,
                              sqlstate=exc.sqlstate) from None


async def _rows(node: NodeConfig, wait_s: float) -> list[tuple[str, int, float]]:
    """`node`'s joining rows (none when the table is missing or the node does not answer)."""
    try:
        async with asyncio.timeout(wait_s):
            conn = await psycopg.AsyncConnection.connect(
                node.dsn, autocommit=True, connect_timeout=max(1, round(wait_s)), application_name="pgmesh"
            )
            async with conn:
                if (await (await conn.execute(
                    "SELECT pg_catalog.to_regclass('pgmesh.joining') IS NOT NULL"
                )).fetchone() or (False,))[0]:
                    cur = await conn.execute(_READ_SQL)
                    return [(str(r[0]), parse_lsn(str(r[1])), float(r[2])) for r in await cur.fetchall()]
    except (psycopg.Error, TimeoutError, OSError):
        pass
    return []


async def read_pins(config: Config, wait_s: float = 5.0) -> tuple[dict[str, int], set[str]]:
    """What the router needs at its start and after a hold: for each node, the lowest pin on it (its slot
    is confirmed no further), and the nodes joining (left out of its members). A node that does not
    answer pins nothing now; the router reads again after its next hold or start."""
    answers = await asyncio.gather(*(_rows(n, wait_s) for n in config.nodes))
    pins: dict[str, int] = {}
    joining: set[str] = set()
    for node, rows in zip(config.nodes, answers, strict=True):
        for name, pin, age in rows:
            joining.add(name)
            pins[node.name] = min(pins.get(node.name, pin), pin)
            logger.warning(
                "node %s is joining (recorded %d s ago): %s's slot is confirmed no further than %s until the"
                " join ends; if no join runs, run `pgmesh join %s` again or `pgmesh part %s`",
                name, age, node.name, format_lsn(pin), name, name,
            )
    return pins, joining



async def copy_auto_identity(donor: Conn, new: Conn) -> int:
    """The new node takes over the donor's `pgmesh.auto_identity` (the tables pgmesh made REPLICA IDENTITY
    FULL, by name: the OIDs differ): the dump gave it those tables FULL already, so its own install did
    not list them, and a primary key added later would have left them FULL there alone. How many."""
    try:
        cur = await donor.execute(
            "SELECT format('%I.%I', n.nspname, c.relname) FROM pgmesh.auto_identity a"
            " JOIN pg_catalog.pg_class c ON c.oid = a.relid JOIN pg_catalog.pg_namespace n"
            " ON n.oid = c.relnamespace"
        )
        names = [str(row[0]) for row in await cur.fetchall()]
        if not names:
            return 0
        cur = await new.execute(
            "INSERT INTO pgmesh.auto_identity SELECT c.oid FROM unnest(%s::text[]) t"
            " JOIN pg_catalog.pg_class c ON c.oid = pg_catalog.to_regclass(t) AND c.relreplident = 'f'"
            " ON CONFLICT DO NOTHING",
            [names],
        )
        return cur.rowcount
    except psycopg.Error as exc:
        raise PgmeshError(f"cannot take over the donor's replica identities: {describe(exc)}",
                          sqlstate=exc.sqlstate) from None
