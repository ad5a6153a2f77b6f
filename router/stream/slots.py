"""A node's logical slot as its source reports it, and the snapshot exported when the slot was created.

`router.stream.connection.ReplicationConnection` runs the slot commands on its replication connection
(CREATE_REPLICATION_SLOT, DROP_REPLICATION_SLOT) and reads the slot's row in `pg_replication_slots`;
what it hands back is defined here: `SlotInfo` (that row), `SlotCreated` (the new slot's name and
consistent point) and `ExportedSnapshot`. The replication connection that exports a snapshot loses it
at its next command, so `keep_snapshot` imports it at once on a holder connection of its own and
re-exports it; the re-exported name stays valid while the holder's transaction is open, whatever the
source does next. `check_slot_name` is the rule for slot names; `FAILOVER_SLOTS_SINCE` the server from
which a permanent slot is created with failover (kept in step on a physical standby with
`sync_replication_slots = on`, so it survives the standby's promotion: docs/failover.md).

Must not: touch the replication connection (router.stream.connection is the only code that does), or create,
drop or advance a slot.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Final

import msgspec
import psycopg
from psycopg import sql

from router.errors import SlotError, describe

__all__ = [
    "FAILOVER_SLOTS_SINCE", "ExportedSnapshot", "SlotCreated", "SlotInfo", "check_slot_name", "keep_snapshot",
]

_SLOT_NAME: Final = re.compile(r"^[a-z0-9_]{1,63}$")
# server_version_num from which a logical slot can be a failover slot (a temporary one never is)
FAILOVER_SLOTS_SINCE: Final = 170000


class SlotInfo(msgspec.Struct, frozen=True):
    name: str
    plugin: str | None
    slot_type: str
    database: str | None
    temporary: bool
    active: bool
    active_pid: int | None
    restart_lsn: int | None
    confirmed_flush_lsn: int | None
    wal_status: str | None


class ExportedSnapshot:
    """A snapshot taken when a slot was created, importable by any connection until `close()`.

    The replication connection that exports a snapshot loses it at its next command, so a holder
    connection imports it at once and re-exports it with `pg_export_snapshot()`; the re-exported name
    stays valid while the holder's transaction is open, whatever the source does next.
    """

    __slots__ = ("_holder", "exported_name", "name")

    def __init__(self, name: str, exported_name: str, holder: psycopg.AsyncConnection[Any]) -> None:
        self.name = name
        self.exported_name = exported_name
        self._holder = holder

    async def lock(self, tables: list[tuple[str, str]]) -> None:
        """ACCESS SHARE locks on `tables` in the holder's transaction: DDL that would rewrite them (and
        hide rows from the snapshot) waits until `close()`."""
        for schema, table in tables:
            await self._holder.execute(
                sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(sql.Identifier(schema, table))
            )

    async def close(self) -> None:
        with contextlib.suppress(psycopg.Error):
            await self._holder.execute("ROLLBACK")
        await self._holder.close()

    async def __aenter__(self) -> ExportedSnapshot:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class SlotCreated(msgspec.Struct, frozen=True):
    name: str
    consistent_point: int
    snapshot: ExportedSnapshot | None = None


def check_slot_name(name: str, node: str) -> str:
    if not _SLOT_NAME.match(name):
        raise SlotError(
            f"invalid replication slot name {name!r}",
            node=node,
            hint="slot names use only lower-case letters, digits and underscores, at most 63",
        )
    return name


async def keep_snapshot(
    dsn: str, exported: str, *, slot: str, node: str, application_name: str
) -> ExportedSnapshot:
    """The snapshot `exported` by the creation of slot `slot`, imported at once on a holder connection
    (`application_name`-snapshot) and exported again from there."""
    holder: psycopg.AsyncConnection[Any] | None = None
    try:
        holder = await psycopg.AsyncConnection.connect(
            dsn, autocommit=True, application_name=f"{application_name}-snapshot"
        )
        await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        await holder.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(exported)))
        cur = await holder.execute("SELECT pg_export_snapshot()")
        row = await cur.fetchone()
    except BaseException as exc:
        if holder is not None:  # not left open when the import fails (or is cancelled)
            with contextlib.suppress(psycopg.Error):
                await holder.close()
        if isinstance(exc, psycopg.Error):
            raise SlotError(
                f"cannot hold the snapshot exported by slot {slot!r}: {describe(exc)}",
                node=node,
            ) from exc
        raise
    assert row is not None
    return ExportedSnapshot(str(row[0]), exported, holder)
