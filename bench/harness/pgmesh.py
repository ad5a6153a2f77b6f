"""pgmesh as a bench system: a full mesh of two or three nodes, its router run inside the bench process.

Owns: `Pgmesh2` (a <-> b) and `Pgmesh3` (a, b, c; a's changes measured on each link): `pgmesh init` on
fresh nodes (`router.testing.mesh.setup_mesh`), starting the router on the bench's event loop (uvloop,
`nodes.run_async`) and stopping it (cancelling a stuck source task again, and counting it), the
settling between workloads (the router reads the echoes the last workload left in every node's WAL),
and the counters it reports (applied transactions and rows per link, conflicts on every link).

Must not: time or report anything, or reach into the router beyond its public surface (`Router.run`,
`started`, `health()`, `appliers` and their `stats`).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from typing import ClassVar

import msgspec

from bench.harness.nodes import CLUSTER, EXTRA_SCHEMA
from bench.harness.system import System
from router.config.model import Config
from router.service.supervisor import Router
from router.testing.localnodes import LocalNode
from router.testing.mesh import fetch, setup_mesh

STOP_WAIT_S = 3.0
STOP_ATTEMPTS = 20
SETTLE_LIMIT_S = 120.0


class Pgmesh2(System):
    """A two-node pgmesh mesh a <-> b: the router runs inside the bench process on uvloop (its CPU is
    `bench_cpu_s` in suite.json); every node's walsender also decodes what pgmesh applies there (to filter
    echoes), on the same cores. Started and stopped by starting and stopping the router. Conflicts: those
    decided on every link."""

    name = "pgmesh2"
    multimaster = True
    unsupported: ClassVar[dict[str, str]] = {}
    lanes: ClassVar[int] = 1  # replication.apply_lanes
    transport: ClassVar[str] = "pipeline"  # replication.apply_transport
    log: ClassVar[bool] = True  # [log] enabled: the router's log of each source (router.stream.log.store)

    def __init__(self, nodes: Sequence[LocalNode]) -> None:
        super().__init__(nodes)
        self.config: Config | None = None
        self.router: Router | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._last: dict[str, int] = {}
        self.stuck_shutdowns = 0

    async def setup(self) -> None:
        config = await setup_mesh(self.data_nodes, EXTRA_SCHEMA, cluster=CLUSTER)
        links = {n.name: self.link_dsn(n) for n in self.data_nodes}  # the router's connections
        self.config = msgspec.structs.replace(
            config, nodes=[msgspec.structs.replace(n, dsn=links[n.name]) for n in config.nodes],
            replication=msgspec.structs.replace(config.replication, apply_lanes=self.lanes,
                                                apply_transport=self.transport),
            log=msgspec.structs.replace(config.log, enabled=self.log),
        )
        self.origin = self.config.origin_name(self.a.name)

    async def start(self) -> None:
        """What `router.testing.mesh.running_router` does, keeping the task to watch its shutdown."""
        assert self.config is not None, "setup() first"
        self.router = Router(self.config, admin=False)
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self.router.run(self._stop), name="bench router")
        started = asyncio.create_task(self.router.started.wait())
        done, _ = await asyncio.wait({self._task, started}, return_when=asyncio.FIRST_COMPLETED)
        if self._task in done:
            started.cancel()
            self._task.result()  # raises the start-up error
        self.running = True

    async def stop(self) -> None:
        """Stop the router; if its shutdown hangs, cancel its source tasks again (and count it)."""
        task, self._task = self._task, None
        if task is None or self.router is None:
            return
        self._last = self.applied()
        self.running = False
        self._stop.set()
        for _ in range(STOP_ATTEMPTS):
            done, _ = await asyncio.wait({task}, timeout=STOP_WAIT_S)
            if done:
                break
            # Seen on Python 3.11: `asyncio.wait_for` in the source's wait for a readable socket returns
            # normally when the socket became readable in the same loop iteration as the cancel,
            # swallowing the cancellation; the router's shutdown then waits for that source task forever.
            self.stuck_shutdowns += 1
            stuck = [t for t in asyncio.all_tasks() if t.get_name().startswith("source ") and not t.done()]
            print(f"pgmesh: router shutdown stuck for {STOP_WAIT_S:.0f} s (source tasks not ending:"
                  f" {', '.join(t.get_name() for t in stuck) or 'none'}); cancelling them again",
                  file=sys.stderr)
            for t in stuck:
                t.cancel()
        else:
            task.cancel()
            raise RuntimeError("pgmesh: the router did not stop")
        task.result()
        self.router = None

    async def check(self) -> None:
        if self.router is not None:
            ok, why = self.router.health()
            if not ok:
                raise RuntimeError(f"pgmesh: {why}")

    async def settle(self) -> None:
        """Also let the router read what the last workload left in every node's WAL: in a full mesh on
        PostgreSQL 15 each node's walsender decodes what pgmesh applied there (to filter the echoes),
        and that work belongs to the workload that caused it, not to the next one (a 300k-row echo
        decoded during the lag window raised its p99 from ~6 ms to ~44 ms). The router runs until every
        slot is confirmed up to each node's WAL position of now (or SETTLE_LIMIT_S passed)."""
        wanted = {n.name: (await fetch(n.dsn(), "SELECT pg_current_wal_lsn()::text"))[0][0]
                  for n in self.data_nodes}
        began = time.monotonic()
        await self.start()
        try:
            deadline = time.monotonic() + SETTLE_LIMIT_S
            while True:
                behind = [n.name for n in self.data_nodes if (await fetch(
                    n.dsn(), "SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'logical'"
                    " AND (confirmed_flush_lsn IS NULL OR confirmed_flush_lsn < %s::pg_lsn)",
                    [wanted[n.name]]))[0][0]]
                if not behind:
                    break
                if time.monotonic() > deadline:
                    print(f"{self.name}: settle: slots on {', '.join(behind)} not caught up after"
                          f" {SETTLE_LIMIT_S:.0f} s; going on", file=sys.stderr)
                    break
                await asyncio.sleep(0.1)
        finally:
            await self.stop()
        print(f"{self.name}: settled in {time.monotonic() - began:.1f} s", file=sys.stderr)
        await super().settle()

    def applied(self) -> dict[str, int]:
        """Per link from a (named `... a->x` when there are several targets), conflicts on every link,
        and how many times stopping the router got stuck; while stopped, what it said at the last stop."""
        if self.router is None:
            return {**self._last, "stuck_shutdowns_so_far": self.stuck_shutdowns}
        counts: dict[str, int] = {}
        for target in self.targets:
            stats = self.router.appliers[(self.a.name, target.name)].stats
            link = f" a->{target.name}" if len(self.targets) > 1 else ""
            counts[f"applied_transactions{link}"] = stats.applied_transactions
            counts[f"applied_rows{link}"] = stats.applied_rows
        counts["stuck_shutdowns_so_far"] = self.stuck_shutdowns
        counts["conflicts_so_far"] = self.conflicts() or 0
        return counts

    def conflicts(self) -> int | None:
        """Conflicts decided on every link since the router started (None while it is stopped)."""
        if self.router is None:
            return None
        return sum(applier.stats.conflicts for applier in self.router.appliers.values())


class Pgmesh3(Pgmesh2):
    """A three-node pgmesh mesh a, b, c (six links, one router in the bench process); a's changes go to b
    and to c, each link reported on its own."""

    name = "pgmesh3"
    node_names = ("a", "b", "c")


class Pgmesh2Lanes(Pgmesh2):
    """`Pgmesh2` with two apply lanes a link (`replication.apply_lanes = 2`): where parallel apply wins."""

    name = "pgmesh2lanes"
    lanes = 2


class Pgmesh2Script(Pgmesh2):
    """`Pgmesh2` applying by SQL text (`replication.apply_transport = "script"`, as before issue 39): the
    pipelined transport's before, in the same run."""

    name = "pgmesh2script"
    transport = "script"


class Pgmesh2NoLog(Pgmesh2):
    """`Pgmesh2` without the router's log (`[log] enabled = false`): what the log costs (issue 21)."""

    name = "pgmesh2nolog"
    log = False


class Pgmesh2NoLogB(Pgmesh2NoLog):
    """A second `Pgmesh2NoLog`: the A/A control that sizes the suite's noise between two systems."""

    name = "pgmesh2nologb"


class Pgmesh2B(Pgmesh2):
    """A second `Pgmesh2` (log on), listed after the others: the same code in the other place of the A/A
    control (`pgmesh2nologb` showed one place of the suite's list about 4% ahead of another)."""

    name = "pgmesh2b"


class Pgmesh5(Pgmesh2):
    """Five nodes a..e (20 links): a's changes to each of the four others, each link reported on its own
    (per-link throughput against the number of nodes, issue 20)."""

    name = "pgmesh5"
    node_names = ("a", "b", "c", "d", "e")


class Pgmesh8(Pgmesh2):
    """Eight nodes a..h (56 links), as `Pgmesh5`."""

    name = "pgmesh8"
    node_names = ("a", "b", "c", "d", "e", "f", "g", "h")


class Pgmesh3Script(Pgmesh3):
    """`Pgmesh3` applying by SQL text, as `Pgmesh2Script`: the before of pgmesh3's links in the same run."""

    name = "pgmesh3script"
    transport = "script"


class Pgmesh5Script(Pgmesh5):
    """`Pgmesh5` applying by SQL text, as `Pgmesh2Script` (bench.micro.meshsize --script)."""

    name = "pgmesh5script"
    transport = "script"


class Pgmesh8Script(Pgmesh8):
    """`Pgmesh8` applying by SQL text, as `Pgmesh2Script` (bench.micro.meshsize --script)."""

    name = "pgmesh8script"
    transport = "script"
