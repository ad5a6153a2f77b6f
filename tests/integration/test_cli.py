"""The `pgmesh` command line end to end: init, run, status, pause, resume, metrics, SIGTERM, demo."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from router.ops.control import cmd_pause, cmd_resume
from router.ops.demo import run_demo
from router.service.admin import admin_request
from router.testing.mesh import execute, fetch, free_port, running_router, wait_for
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE items (id int PRIMARY KEY, v text);"


def pgmesh(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


async def status_json(config: Path) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "status", "--config", str(config), "--json",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    result: dict[str, Any] = json.loads(out)
    return result


def links_by_name(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"{lk['source']}->{lk['target']}": lk for lk in status["links"]}


async def test_init_run_status_pause_resume_metrics_and_sigterm(mesh: MeshFactory, tmp_path: Path) -> None:
    port = free_port()
    m = await mesh(nodes=2, schema=SCHEMA, admin_port=port, init=False)  # init: by the command line
    a, b = m.nodes
    config = m.write_config(tmp_path / "config.toml")

    first = pgmesh("init", "--config", str(config))
    assert first.returncode == 0, first.stdout + first.stderr
    assert "ready" in first.stdout and "created" in first.stdout
    second = pgmesh("init", "--config", str(config))
    assert second.returncode == 0 and "nothing changed" in second.stdout

    offline = await status_json(config)
    assert offline["running"] is False and {lk["state"] for lk in offline["links"]} == {"down"}

    log = (tmp_path / "router.log").open("wb")
    router = subprocess.Popen(  # noqa: ASYNC220 - a long-lived child, waited for below
        [sys.executable, "-m", "router", "run", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        async def up() -> bool:
            try:
                code, _ = await admin_request("127.0.0.1", port, "GET", "/healthz", timeout=1)
            except OSError:
                return False
            return code == 200

        await wait_for(up, "the router's admin listener", 30)
        await execute(a.dsn(), "INSERT INTO items VALUES (1, 'one')")
        await wait_for(lambda: _has(b, 1), "row 1 on b")
        status = await status_json(config)
        assert status["running"] is True
        assert links_by_name(status)["a->b"]["state"] == "streaming"
        assert links_by_name(status)["a->b"]["applied_transactions"] == 1

        code, body = await admin_request("127.0.0.1", port, "GET", "/metrics")
        text = body.decode()
        assert code == 200
        assert 'pgmesh_applied_transactions_total{source="a",target="b"} 1.0' in text
        assert 'pgmesh_link_state{source="a",state="streaming",target="b"} 1.0' in text

        paused = pgmesh("pause", "--config", str(config), "--target", "b")
        assert paused.returncode == 0 and "a -> b" in paused.stdout
        await execute(a.dsn(), "INSERT INTO items VALUES (2, 'two')")

        async def queued_for_b() -> bool:
            link = links_by_name(await status_json(config))["a->b"]
            return bool(link["state"] == "paused" and link["queued"] >= 1)

        await wait_for(queued_for_b, "the paused link to hold the new transaction")
        assert not await _has(b, 2)
        (held,) = await fetch(b.dsn(), "SELECT paused FROM pgmesh.links WHERE source = 'a'")
        assert held == (True,)  # survives a router restart
        resumed = pgmesh("resume", "--config", str(config), "--target", "b")
        assert resumed.returncode == 0
        # the very next status shows the link running again (not "paused" until its next batch)
        assert links_by_name(await status_json(config))["a->b"]["state"] in ("streaming", "catching up")
        await wait_for(lambda: _has(b, 2), "row 2 on b after resume")
        running = pgmesh("status", "--config", str(config))  # each source's router log, in the status
        assert "router log" in running.stdout and "(appending" in running.stdout, running.stdout

        router.send_signal(signal.SIGTERM)
        assert router.wait(30) == 0
    finally:
        if router.poll() is None:
            router.kill()
        log.close()
    after = await status_json(config)
    assert after["running"] is False
    human = pgmesh("status", "--config", str(config))
    assert "NOT running" in human.stdout and "a -> b" in human.stdout
    assert "slot keeps" in human.stdout and "of WAL (reserved, no limit)" in human.stdout
    assert all(s["retained"]["wal_status"] == "reserved" for s in after["sources"])


async def test_one_link_pauses_and_resumes_alone(mesh: MeshFactory) -> None:
    """`pgmesh pause --source a --target b` stops the link a -> b only: b still gets c's changes and c
    gets a's; resumed, b gets a's. Without a router the same options record only the links they name."""
    m = await mesh(nodes=3, schema=SCHEMA, admin_port=free_port())
    a, b, c = m.nodes
    out = io.StringIO()
    async with running_router(m.config) as router:
        # no token (router.service.admintoken): refused, nothing paused
        port = m.config.admin_host_port[1]
        assert (await admin_request("127.0.0.1", port, "POST", "/pause"))[0] == 401
        assert all(x.state != "paused" for x in router.status().links)
        assert await cmd_pause(m.config, "b", out, source="a") == 0
        assert out.getvalue().strip() == "paused: a -> b"
        await execute(a.dsn(), "INSERT INTO items VALUES (1, 'from a')")
        await execute(c.dsn(), "INSERT INTO items VALUES (2, 'from c')")
        await wait_for(lambda: _has(b, 2), "c's row on b")
        await wait_for(lambda: _has(c, 1), "a's row on c")
        await wait_for(lambda: router.appliers[("a", "b")].pending >= 1, "a -> b to hold a's transaction")
        assert not await _has(b, 1)
        states = {(x.source, x.target): x.state for x in router.status().links}
        assert states.pop(("a", "b")) == "paused" and set(states.values()) <= {"streaming", "catching up"}
        assert await cmd_resume(m.config, None, out, source="a") == 0
        await wait_for(lambda: _has(b, 1), "a's row on b after resume")
    out = io.StringIO()
    assert await cmd_pause(m.config, None, out, source="c") == 0  # no router: recorded on the targets
    assert out.getvalue().startswith("paused (router not running") and "c -> a, c -> b" in out.getvalue()
    for node, expected in ((a, [("b", False), ("c", True)]), (b, [("a", False), ("c", True)])):
        rows = await fetch(node.dsn(), "SELECT source, coalesce(paused, false) FROM pgmesh.links ORDER BY 1")
        assert rows == expected, (node.name, rows)


async def _has(node: Any, key: int) -> bool:
    return bool(await fetch(node.dsn(), "SELECT 1 FROM items WHERE id = %s", [key]))


async def test_demo_converges() -> None:
    out = io.StringIO()
    assert await run_demo(seconds=2, out=out) == 0, out.getvalue()
    assert "converged: YES" in out.getvalue()
    assert os.environ.get("PGMESH_DEMO_KEEP") is None
