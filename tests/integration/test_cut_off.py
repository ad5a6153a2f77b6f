"""A node cut off from the router (its connections open but carrying nothing) shows within seconds.

The router reaches node b through a TCP proxy that can blackhole: bytes accepted, nothing delivered, no
connection closed, which TCP alone would take many minutes to notice. Within `node_timeout_ms` the
progress query to b gets no answer: both links of b show "down" naming b, /healthz is not ok, and the
router drops its sessions to b. Writes on a go on meanwhile; once the proxy forwards again, the router's
new sessions reach b, the links stream again and the nodes converge with nothing lost.
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.config.model import Config
from router.testing.mesh import execute, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE kv (id bigint PRIMARY KEY, v int NOT NULL);"
TABLES = ["kv"]


def through_proxy(config: Config, node: Any, proxy: Any) -> Config:
    """`config` with the router reaching `node` through `proxy`, and a quick tick and node timeout."""
    dsn = node.dsn().replace(f"port={node.port}", f"port={proxy.port}")
    return msgspec.structs.replace(
        config,
        nodes=[msgspec.structs.replace(n, dsn=dsn) if n.name == node.name else n for n in config.nodes],
        replication=msgspec.structs.replace(config.replication, status_interval_ms=200, node_timeout_ms=1500),
    )


async def insert(node: Any, first: int, count: int) -> None:
    for i in range(first, first + count):
        await execute(node.dsn(), "INSERT INTO kv VALUES (%s, %s)", params=[i, i])


async def test_a_node_cut_off_shows_down_within_seconds_and_catches_up(
    mesh: MeshFactory, tcp_proxy: Any
) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    proxy = tcp_proxy("127.0.0.1", b.port)
    config = through_proxy(m.config, b, proxy)
    async with running_router(config) as router:
        await insert(a, 1, 20)
        await insert(b, 1001, 20)
        await wait_converged(m.nodes, TABLES)

        def states() -> dict[str, tuple[str, str | None]]:
            return {f"{lk.source}->{lk.target}": (lk.state, lk.last_error) for lk in router.status().links}

        assert {s for s, _ in states().values()} == {"streaming"}
        # what each node's slot keeps of its WAL, read every tick, in status and /metrics
        def retained() -> dict[str, Any]:
            return {s.node: s.retained for s in router.status().sources}

        await wait_for(lambda: None not in retained().values(), "a status tick to read the slots")
        sources = retained()
        assert all(r.bytes >= 0 and r.wal_status == "reserved" for r in sources.values()), sources
        assert sorted(sources) == ["a", "b"]
        await wait_for(lambda: all(f'pgmesh_retained_wal_bytes{{node="{n}"}}' in router.metrics.render()
                                   for n in "ab"), "/metrics to show each node's retained WAL")
        proxy.blackhole()
        await wait_for(lambda: all(s == "down" for s, _ in states().values()), "b's links to show down", 60)
        assert all(e is not None and "node b" in e and "no answer" in e for _, e in states().values())
        ok, why = router.health()
        assert not ok and "node b" in why
        # pause and resume answer at once (within node_timeout_ms) and show the new state at once
        paused = await router.pause("b")
        assert paused and all("not recorded on node b" in p for p in paused), paused
        assert states()["a->b"][0] == "paused"
        await router.resume("b")
        assert states()["a->b"][0] in ("down", "streaming", "catching up")
        await wait_for(lambda: states()["a->b"][0] == "down", "a -> b to show down again", 30)
        await insert(a, 21, 20)  # applied to b once it is reachable again
        proxy.restore()
        await wait_for(lambda: router.health()[0], "the router to be healthy again", 90)
        await wait_converged(m.nodes, TABLES, limit=120)
        await wait_for(lambda: {s for s, _ in states().values()} == {"streaming"}, "b's links to stream", 60)


async def test_a_router_starts_while_a_node_is_cut_off(mesh: MeshFactory, tcp_proxy: Any) -> None:
    """Started while b accepts connections but answers nothing, the router does not wait for b: its
    links start down and catch up once b answers."""
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    proxy = tcp_proxy("127.0.0.1", b.port)
    config = through_proxy(m.config, b, proxy)
    proxy.blackhole()
    await insert(a, 1, 10)
    async with running_router(config) as router:
        assert not router.health()[0]
        proxy.restore()
        await wait_converged(m.nodes, TABLES, limit=120)
        await wait_for(lambda: router.health()[0], "the router to be healthy", 90)
