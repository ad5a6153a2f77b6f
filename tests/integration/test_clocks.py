"""Clocks (issue 18, item 4), on real clusters with node b's server under Debian's libfaketime: its clock
runs behind the router's by the offset written in a file it re-reads at every call, so a test can move it.

- init and status (with and without a router) and /metrics show b's offset, about right;
- beyond [clocks] max_offset_ms the links into and out of b hold ("clock skew") with the node, the offset
  and the bound, apply nothing, and run again by themselves once b's clock is back;
- under the bound, a change from a is applied on b only once b's clock has passed its commit time: a
  write on b made right after it arrived is newer, and wins on both nodes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest

from router.cluster.checks import check_cluster
from router.cluster.clocks import ClockLevel
from router.cluster.install import init_cluster
from router.config.model import ClocksSection
from router.errors import ConfigError
from router.ops.control import offline_status, render_status
from router.service.supervisor import Router
from router.testing.mesh import Mesh, execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
SCHEMA = "CREATE TABLE t (id bigint PRIMARY KEY, v text);"
LAG_S = 3.0

pytestmark = pytest.mark.skipif(not LIBFAKETIME.exists(), reason="libfaketime is not installed (./dev setup)")


def set_lag(node: Any, seconds: float) -> None:
    """The offset b's server adds to every clock reading, from its next one."""
    (node.base_dir / "faketime").write_text(f"{-seconds:+.3f}s\n" if seconds else "+0\n")


def lag_clock(node: Any, seconds: float) -> None:
    """Restart `node`'s server under libfaketime, its clock `seconds` behind."""
    set_lag(node, seconds)
    node.stop()
    node.env = {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME_TIMESTAMP_FILE": str(node.base_dir / "faketime"),
        "FAKETIME_NO_CACHE": "1",  # re-read the file at every call: the test moves the clock
    }
    node.start()


async def lagging_mesh(mesh: MeshFactory, extra: str = "") -> Mesh:
    m = await mesh(nodes=2, schema=SCHEMA, extra=extra, init=False)
    lag_clock(m.nodes[1], LAG_S)
    return m


def near_lag(offset_ms: float | None, round_trip_ms: float | None) -> bool:
    """The measured offset is the lag, give or take half the round trip (and 50 ms for the load)."""
    assert offset_ms is not None and round_trip_ms is not None
    return abs(offset_ms + LAG_S * 1000) <= round_trip_ms / 2 + 50


async def test_init_status_and_metrics_show_each_node_offset(mesh: MeshFactory) -> None:
    m = await lagging_mesh(mesh, extra="[clocks]\nmax_offset_ms = 10000\n")
    strict = msgspec.structs.replace(m.config, clocks=ClocksSection())  # max_offset_ms = 500
    report = await check_cluster(strict)
    assert not report.ok
    clock = {c.node: c for c in report.checks if c.check == "clock"}
    assert clock["a"].ok and not clock["b"].ok, report.render()
    assert "max_offset_ms = 500" in clock["b"].detail, clock["b"].detail
    assert abs(float(clock["b"].detail.split(" ms")[0]) + LAG_S * 1000) < 200, clock["b"].detail
    assert "sync the node's clock" in (clock["b"].hint or "")
    assert [c.check for c in report.problems] == ["clock"], report.render()
    with pytest.raises(ConfigError, match="clock"):
        await init_cluster(strict)

    report, _ = await init_cluster(m.config)  # the bound raised: init passes, b's offset shown
    assert report.ok, report.render()
    detail = {c.node: c for c in report.checks if c.check == "clock"}["b"].detail
    assert abs(float(detail.split(" ms")[0]) + LAG_S * 1000) < 200, detail

    offline = {c.node: c for c in (await offline_status(m.config)).clocks}
    assert near_lag(offline["b"].offset_ms, offline["b"].round_trip_ms), offline["b"]
    assert abs(offline["a"].offset_ms or 0) < 50 + (offline["a"].round_trip_ms or 0)

    async with running_router(m.config) as router:
        await wait_for(lambda: router.clocks.rounds > 0, "the first clock measurement")
        shown = {c.node: c for c in router.status().clocks}
        assert near_lag(shown["b"].offset_ms, shown["b"].round_trip_ms), shown["b"]
        assert shown["b"].level == "warn" and shown["a"].level == "ok"
        text = render_status(router.status())
        assert "clock b: -" in text, text
        assert "beyond [clocks] warn_offset_ms = 50" in text
        await wait_for(lambda: 'pgmesh_clock_offset_seconds{node="b"} -' in router.metrics.render(),
                       "b's offset in /metrics")
        line = next(x for x in router.metrics.render().splitlines()
                    if x.startswith('pgmesh_clock_offset_seconds{node="b"}'))
        assert -LAG_S - 0.2 < float(line.split()[-1]) < -LAG_S + 0.2, line
        assert 'pgmesh_clock_offset_seconds{node="a"}' in router.metrics.render()
        # the encoded status (`pgmesh status --json`) carries them too
        decoded = msgspec.json.decode(msgspec.json.encode(router.status()))
        assert {c["node"] for c in decoded["clocks"]} == {"a", "b"}


def link_states(router: Router) -> dict[str, str]:
    return {f"{link.source}->{link.target}": link.state for link in router.status().links}


async def test_links_hold_beyond_the_bound_and_run_again_when_the_clock_is_back(
    mesh: MeshFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="router.service.clocks")
    m = await lagging_mesh(mesh, extra="[clocks]\nmax_offset_ms = 10000\n")
    report, _ = await init_cluster(m.config)
    assert report.ok, report.render()
    a, b = m.nodes
    config = msgspec.structs.replace(m.config, clocks=ClocksSection(max_offset_ms=1000))
    async with running_router(config) as router:
        router.clocks.refresh_s = 0.5
        await wait_for(lambda: set(link_states(router).values()) == {"clock skew"}, "both links held")
        for link in router.status().links:
            error = link.last_error or ""
            assert "node b" in error and "max_offset_ms = 1000" in error and " ms from the router's" in error
        text = render_status(router.status())
        assert "clock skew" in text and "beyond [clocks] max_offset_ms = 1000" in text, text
        held = [f'pgmesh_link_state{{source="{s}",state="clock_skew",target="{t}"}} 1.0'
                for s, t in ("ab", "ba")]
        # /metrics is brought up to date at each status tick, a tick after the links' own state
        await wait_for(lambda: all(line in router.metrics.render() for line in held), "both in /metrics")
        metrics = router.metrics.render()
        assert 'pgmesh_link_state{source="a",state="clock_skew",target="b"} 1.0' in metrics
        assert 'pgmesh_link_state{source="b",state="clock_skew",target="a"} 1.0' in metrics
        assert not router.health()[0] and "node b" in router.health()[1]

        # held: a's row does not reach b, over two more refreshes
        await execute(a.dsn(), "INSERT INTO t VALUES (1, 'from a')")
        seen = router.clocks.rounds
        await wait_for(lambda: router.clocks.rounds >= seen + 2, "two more clock refreshes")
        assert await fetch(b.dsn(), "SELECT v FROM t") == []
        assert router.clocks.levels["b"] is ClockLevel.OVER

        # b's clock is set right: the links run again by themselves and the row arrives
        set_lag(b, 0)
        await wait_for(lambda: set(link_states(router).values()) <= {"streaming", "catching up"},
                       "both links running again")
        await wait_converged(m.nodes, ["t"])
        assert all(link.last_error is None for link in router.status().links)
        assert router.health()[0], router.health()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("clock of node b")]
    assert len(lines) == 2, lines  # beyond the bound once, within again once (not at every refresh)
    assert "max_offset_ms = 1000" in lines[0] and "within" in lines[1]


async def test_a_change_waits_for_the_target_clock_to_pass_its_commit_time(mesh: MeshFactory) -> None:
    m = await lagging_mesh(mesh, extra="[clocks]\nmax_offset_ms = 10000\n")
    report, _ = await init_cluster(m.config)
    assert report.ok, report.render()
    a, b = m.nodes
    async with running_router(m.config) as router:
        await wait_for(lambda: router.clocks.rounds > 0, "the first clock measurement")
        await execute(a.dsn(), "INSERT INTO t VALUES (1, 'from a')")

        async def arrived() -> bool:
            return bool(await fetch(b.dsn(), "SELECT 1 FROM t WHERE id = 1"))

        await wait_for(arrived, "a's row on b")
        # on b the applied row carries a's commit time, and b's own clock has passed it already
        [(committed, b_now)] = await fetch(
            b.dsn(), "SELECT pg_xact_commit_timestamp(xmin), clock_timestamp() FROM t WHERE id = 1"
        )
        assert b_now >= committed, (b_now, committed)
        # so a local write on b right after the row arrived is newer, and wins on both nodes (had the
        # router's clock been the guard, b's write would carry a time about 3 s older than a's row, and
        # a would keep its own row for ever)
        await execute(b.dsn(), "UPDATE t SET v = 'from b' WHERE id = 1")
        [(b_write,)] = await fetch(b.dsn(), "SELECT pg_xact_commit_timestamp(xmin) FROM t WHERE id = 1")
        assert b_write > committed, (b_write, committed)
        await wait_converged(m.nodes, ["t"])
        assert await fetch(a.dsn(), "SELECT v FROM t") == [("from b",)]
        assert await fetch(b.dsn(), "SELECT v FROM t") == [("from b",)]
