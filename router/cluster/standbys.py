"""A node's physical standbys, and whether pgmesh's slot survives a standby's promotion (docs/failover.md).

Owns reading what `pgmesh init`'s `failover` line needs from a node (`read_standbys`: the physical
standbys streaming from it and their slots, every physical slot, `synchronized_standby_slots`, whether
pgmesh's slot is a failover slot) and the decision itself, a pure function of what was read
(`failover_finding`): nothing for a node without a standby; on 15/16 a warning that the slot is lost at
a promotion and what to do; on 17+ a warning for each thing that keeps the slot from being synced or
safe on a promoted standby; a failure only when `synchronized_standby_slots` names a slot that does not
exist (a failover slot's changes would wait for it for ever).
Must not: write anything to a node, or render the report (`router.cluster.checks` wraps the finding into
its `Check`).
"""

from __future__ import annotations

from typing import Any, Final

import msgspec
import psycopg

from router.stream.slots import FAILOVER_SLOTS_SINCE

__all__ = ["Finding", "StandbyFacts", "failover_finding", "read_standbys", "slot_names"]

# Physical standbys streaming from the node: their slot's name, or null for one streaming without a slot
# (logical walsenders, the router's own among them, hold a logical slot and are left out).
_STREAMING_SQL: Final = """
SELECT s.slot_name FROM pg_stat_replication r
LEFT JOIN pg_replication_slots s ON s.active_pid = r.pid
WHERE s.slot_type IS DISTINCT FROM 'logical'
ORDER BY 1
"""
_SETTINGS_SQL: Final = (
    "SELECT current_setting('server_version_num')::int,"
    " coalesce(current_setting('synchronized_standby_slots', true), '')"  # 17+
)
_STANDBY_SETTINGS: Final = (
    "on the standby: sync_replication_slots = on, hot_standby_feedback = on, primary_slot_name set and a"
    " dbname in primary_conninfo (docs/failover.md)"
)


class StandbyFacts(msgspec.Struct, frozen=True):
    """What one node says of its physical standbys."""

    version_num: int = 0
    streaming: list[str | None] = msgspec.field(default_factory=list)  # physical slot of each, or None
    physical_slots: list[str] = msgspec.field(default_factory=list)  # every physical slot, streamed or not
    synchronized: list[str] = msgspec.field(default_factory=list)  # synchronized_standby_slots (17+)
    slot_failover: bool | None = None  # 17+: whether pgmesh's slot is a failover slot (None: no slot / < 17)


class Finding(msgspec.Struct, frozen=True):
    """The failover line of one node: `ok` false is a failure, `warn` a warning that lets init go on."""

    ok: bool
    detail: str
    hint: str | None = None
    warn: bool = False


def slot_names(setting: str) -> list[str]:
    """The slot names of a `synchronized_standby_slots` value ('*' is not allowed there)."""
    return [name for part in setting.split(",") if (name := part.strip().strip('"'))]


async def read_standbys(conn: psycopg.AsyncConnection[Any], slot: str) -> StandbyFacts:
    """The node's standbys, its physical slots and settings; whether `slot` is a failover slot (17+)."""
    cur = await conn.execute(_SETTINGS_SQL)
    row = await cur.fetchone()
    assert row is not None
    version, setting = int(row[0]), str(row[1])
    cur = await conn.execute(_STREAMING_SQL)
    streaming: list[str | None] = [r[0] for r in await cur.fetchall()]
    cur = await conn.execute("SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'physical'")
    physical = [r[0] for r in await cur.fetchall()]
    failover = None
    if version >= FAILOVER_SLOTS_SINCE:
        cur = await conn.execute("SELECT failover FROM pg_replication_slots WHERE slot_name = %s", [slot])
        own = await cur.fetchone()
        failover = bool(own[0]) if own else None
    return StandbyFacts(version, streaming, physical, slot_names(setting), failover)


def _problems(f: StandbyFacts, slot: str) -> list[tuple[str, str]]:
    """17+: what keeps pgmesh's slot from being synced to, or safe on, a promoted standby (with fixes)."""
    named = sorted({s for s in f.streaming if s is not None})
    found: list[tuple[str, str]] = []
    if f.slot_failover is False:
        found.append((f"slot {slot} is not a failover slot (made by an older pgmesh, or by hand)",
                      f"with the router stopped, run ALTER_REPLICATION_SLOT {slot} (FAILOVER true) on a"
                      " replication=database connection"))
    if None in f.streaming:
        found.append(("a standby streams without a replication slot: slots are synced only through one",
                      "give it a physical slot (primary_slot_name)"))
    unlisted = [s for s in named if s not in f.synchronized]
    if unlisted:
        found.append((f"synchronized_standby_slots does not name {', '.join(unlisted)}: other nodes may get"
                      " changes the standby does not have yet, which a promotion loses on this node alone",
                      f"ALTER SYSTEM SET synchronized_standby_slots = '{', '.join(named)}';"
                      " SELECT pg_reload_conf()"))
    idle = [s for s in f.synchronized if s in f.physical_slots and s not in named]
    if idle:
        found.append((f"the standby of slot {', '.join(idle)} is not streaming: this node's changes wait for"
                      " it", "start that standby, or take its slot out of synchronized_standby_slots"))
    return found


def failover_finding(f: StandbyFacts, slot: str) -> Finding | None:
    """Whether pgmesh's slot `slot` survives the promotion of the node's standby; None without one."""
    missing = [s for s in f.synchronized if s not in f.physical_slots]
    if missing:
        kept = ", ".join(s for s in f.synchronized if s not in missing)
        detail = (f"synchronized_standby_slots names {', '.join(missing)}, no physical slot here: pgmesh's"
                  " slot streams nothing until it exists (after a failover: the old primary's setting)")
        hint = f"ALTER SYSTEM SET synchronized_standby_slots = '{kept}'; SELECT pg_reload_conf()"
        return Finding(False, detail, hint)
    if not f.streaming and not f.synchronized:
        return None
    named = sorted({s for s in f.streaming if s is not None})
    standbys = f"physical standby slot {', '.join(named)}" if named else "a physical standby"
    if f.version_num < FAILOVER_SLOTS_SINCE:
        detail = (f"{standbys} streams from here, but PostgreSQL {f.version_num // 10000} does not carry"
                  f" logical slots to a standby: after its promotion the slot {slot} is missing there")
        hint = ("after a failover, re-join the promoted node (`pgmesh join` from a donor, docs/join.md), or"
                " upgrade to 17+ for failover slots (docs/failover.md)")
        return Finding(True, detail, hint, warn=True)
    found = _problems(f, slot)
    if found:
        hint = "; ".join(fix for _, fix in found) + f"; {_STANDBY_SETTINGS}"
        return Finding(True, "; ".join(what for what, _ in found), hint, warn=True)
    return Finding(True, f"{standbys} in synchronized_standby_slots, slot {slot} a failover slot"
                         f" ({_STANDBY_SETTINGS})")
