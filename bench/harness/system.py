"""What a replicated system is to a bench: the interface every system class implements.

Owns: `System`, the base of one class per system (`subscriptions.Native`, `subscriptions.Pglogical`,
`pgmesh.Pgmesh2`, `pgmesh.Pgmesh3`, `bucardo.Bucardo`): the nodes created for it (`node_names`), the
replicated ones (`data_nodes`, the source `a` first), the targets of a's changes (`targets`), the
replication origin that tracks a on each target (`origins`, '' when the system has none, and
`positions()`), whether it takes writes on every node at once (`multimaster`), the workloads it does
not run (`unsupported`, or `slow` ones unless asked), its conflict count, and the life cycle: `setup()`
leaves replication stopped; `start()`/`stop()` switch replication of a's changes on and off, so a backlog
can be made while it is stopped; `settle()` before each workload; `close()` at the end.

Must not: time or report anything (`workloads`, `bench.suite`), or touch nodes it was not given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

from bench.harness.nodes import checkpoint, origin_position
from router.testing.localnodes import LocalNode
from router.testing.mesh import execute


class System:
    """One replicated system on fresh nodes; `nodes` are all nodes created for it (`node_names`)."""

    name: ClassVar[str] = ""
    node_names: ClassVar[tuple[str, ...]] = ("a", "b")
    multimaster: ClassVar[bool] = False
    # Workloads the suite does not run on this system, with the reason (shown as n/a in the report);
    # `slow` ones run with --include-slow.
    unsupported: ClassVar[dict[str, str]] = {"multimaster": "one-way replication only"}
    slow: ClassVar[dict[str, str]] = {}

    def __init__(self, nodes: Sequence[LocalNode]) -> None:
        self.nodes = list(nodes)
        self.a, self.b = self.nodes[0], self.nodes[1]
        self.origin = ""  # the replication origin that tracks a's changes on a target
        self.running = False
        # the DSN a replication connection uses for a node (a subscriber's CONNECTION, the router's node
        # DSNs): the node's own, or through a delaying proxy (bench.harness.delay); never the workloads'
        self.link_dsn: Callable[[LocalNode], str] = LocalNode.dsn

    async def setup(self) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def check(self) -> None:
        """Raise when replication has failed (so a bench never waits out its timeout on a broken link)."""

    def applied(self) -> dict[str, int]:
        """The system's own counters, when it has any (for the JSON)."""
        return {}

    @property
    def data_nodes(self) -> list[LocalNode]:
        return self.nodes

    @property
    def targets(self) -> list[LocalNode]:
        return self.data_nodes[1:]

    @property
    def origins(self) -> dict[str, str]:
        return {t.name: self.origin for t in self.targets}

    async def positions(self) -> dict[str, int]:
        """Each target's replication origin position for a's changes (0 when the system has no origin)."""
        return {t.name: await origin_position(t, self.origins[t.name]) for t in self.targets}

    def conflicts(self) -> int | None:
        """Conflicts the system detected so far (None when it does not expose them)."""
        return None

    async def settle(self) -> None:
        """Called (stopped) before each workload: housekeeping that the system would do by itself in time.
        Every system gets a VACUUM ANALYZE and then a CHECKPOINT on every node, so that no workload pays
        for the last one's dead rows (autovacuum starting inside a timed window) or dirty pages."""
        for node in self.data_nodes:
            await execute(node.dsn(), "VACUUM ANALYZE")
        await checkpoint(self.data_nodes)

    async def close(self) -> None:
        await self.stop()
