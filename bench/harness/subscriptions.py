"""The one-way systems a subscriber pulls: native logical replication and pglogical, a -> b.

Owns: `Native` (CREATE PUBLICATION / CREATE SUBSCRIPTION) and `Pglogical` (pglogical 2 provider and
subscriber): their setup on fresh nodes, switching replication on and off, the replication origin on b
that tracks a, and telling a failed apply worker from a slow one.

Must not: time or report anything, or take writes on b (both are one-way: `multimaster` is n/a).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from bench.harness.nodes import EXTRA_SCHEMA
from bench.harness.system import System
from router.testing.localnodes import LocalNode
from router.testing.mesh import execute, fetch

STOP_TIMEOUT_S = 60.0


class Native(System):
    """CREATE PUBLICATION FOR ALL TABLES on a, a SUBSCRIPTION on each target (copy_data = false); started
    and stopped with ALTER SUBSCRIPTION ENABLE / DISABLE."""

    name = "native"

    def __init__(self, nodes: Sequence[LocalNode]) -> None:
        super().__init__(nodes)
        self._origins: dict[str, str] = {}

    def _subscription(self, target: LocalNode) -> str:
        """The subscription on `target` (its slot on a has the same name, so each target's is its own)."""
        return f"s_{target.name}"

    @property
    def origins(self) -> dict[str, str]:
        return dict(self._origins)

    async def setup(self) -> None:
        for node in self.data_nodes:
            await execute(node.dsn(), EXTRA_SCHEMA)
        await execute(self.a.dsn(), "CREATE PUBLICATION p FOR ALL TABLES")
        connection = self.link_dsn(self.a).replace("'", "''")
        for target in self.targets:
            name = self._subscription(target)
            await execute(
                target.dsn(),
                f"CREATE SUBSCRIPTION {name} CONNECTION '{connection}' PUBLICATION p"
                " WITH (copy_data = false, enabled = false)",
            )
            rows = await fetch(
                target.dsn(), f"SELECT 'pg_' || oid FROM pg_subscription WHERE subname = '{name}'"
            )
            self._origins[target.name] = rows[0][0]
        self.origin = self._origins[self.b.name]

    async def start(self) -> None:
        for target in self.targets:
            await execute(target.dsn(), f"ALTER SUBSCRIPTION {self._subscription(target)} ENABLE")
        self.running = True

    async def stop(self) -> None:
        """Disable the subscriptions and wait until their workers have exited and a's slots are free."""
        if not self.running:
            return
        self.running = False
        for target in self.targets:
            await execute(target.dsn(), f"ALTER SUBSCRIPTION {self._subscription(target)} DISABLE")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            workers = 0
            for target in self.targets:
                rows = await fetch(
                    target.dsn(),
                    "SELECT count(*) FROM pg_stat_subscription"
                    " WHERE subname LIKE 's\\_%' AND pid IS NOT NULL",
                )
                workers += rows[0][0]
            active = await fetch(self.a.dsn(), "SELECT count(*) FROM pg_replication_slots WHERE active")
            if workers == 0 and active[0][0] == 0:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"{self.name}: a subscription's worker did not stop within 60 s")

    async def check(self) -> None:
        for target in self.targets:
            rows = await fetch(
                target.dsn(),
                "SELECT apply_error_count FROM pg_stat_subscription_stats WHERE subname ="
                f" '{self._subscription(target)}'",
            )
            if rows and rows[0][0]:
                raise RuntimeError(
                    f"{self.name}: the apply worker on {target.name} failed; see {target.logfile}"
                )


class Native3(Native):
    """Native logical replication from a to two subscribers, b and c: the control for pgmesh3's per-link
    figures (what a second target costs PostgreSQL's own apply on the same cores)."""

    name = "native3"
    node_names = ("a", "b", "c")


class Pglogical(System):
    """pglogical 2: provider a, subscriber b, replication set `default` (all public tables), no initial
    copy; started and stopped with pglogical.alter_subscription_enable / disable."""

    name = "pglogical"

    def __init__(self, nodes: Sequence[LocalNode]) -> None:
        super().__init__(nodes)
        self._down = 0

    async def setup(self) -> None:
        for node in (self.a, self.b):
            await execute(node.dsn(), EXTRA_SCHEMA, "CREATE EXTENSION pglogical")
            await execute(node.dsn(), "SELECT pglogical.create_node(%s, %s)", params=[node.name, node.dsn()])
        await execute(self.a.dsn(),
                      "SELECT pglogical.replication_set_add_all_tables('default', ARRAY['public'])")
        await execute(
            self.b.dsn(),
            "SELECT pglogical.create_subscription('s', %s, synchronize_structure := false,"
            " synchronize_data := false, forward_origins := '{}')",
            params=[self.a.dsn()],
        )
        await self._wait_status("replicating")
        rows = await fetch(self.b.dsn(), "SELECT slot_name FROM pglogical.show_subscription_status('s')")
        self.origin = rows[0][0]  # pglogical names the origin on b after the slot on a
        self.running = True
        await self.stop()

    async def _status(self) -> str:
        rows = await fetch(self.b.dsn(), "SELECT status FROM pglogical.show_subscription_status('s')")
        return str(rows[0][0]) if rows else "missing"

    async def _wait_status(self, wanted: str) -> None:
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while (status := await self._status()) != wanted:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"pglogical: the subscription is {status!r}, not {wanted!r}; see {self.b.logfile}"
                )
            await asyncio.sleep(0.05)

    async def start(self) -> None:
        await execute(self.b.dsn(), "SELECT pglogical.alter_subscription_enable('s', true)")
        self.running = True

    async def stop(self) -> None:
        if not self.running:
            return
        self.running = False
        await execute(self.b.dsn(), "SELECT pglogical.alter_subscription_disable('s', true)")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while (await fetch(self.a.dsn(), "SELECT count(*) FROM pg_replication_slots WHERE active"))[0][0]:
            if time.monotonic() > deadline:
                raise RuntimeError("pglogical: the apply worker did not stop within 60 s")
            await asyncio.sleep(0.05)

    async def check(self) -> None:
        """A worker that keeps failing shows 'down' (it restarts in between): three checks in a row."""
        self._down = self._down + 1 if await self._status() == "down" else 0
        if self._down >= 3:
            raise RuntimeError(f"pglogical: the subscription is down; see {self.b.logfile}")
