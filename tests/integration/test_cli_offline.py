"""`pgmesh pause` / `resume` with no router running: the links' state recorded on the target nodes.

Owns: that an offline pause writes `pgmesh.links` on the targets it names (and only those), that resume
clears it, and that `pgmesh status` shows it. A node that is down: tests/unit/router/ops/test_cli.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from router.testing.mesh import fetch, free_port
from tests.fix_mesh import MeshFactory

SCHEMA = "CREATE TABLE items (id int PRIMARY KEY, v text);"


def pgmesh(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


async def test_pause_and_resume_without_a_router_record_the_state_on_the_target(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    m = await mesh(nodes=3, schema=SCHEMA, admin_port=free_port(), init=False)
    a, b, c = m.nodes
    config = m.write_config(tmp_path / "config.toml")
    init = pgmesh("init", "--config", str(config))
    assert init.returncode == 0, init.stdout + init.stderr

    paused = pgmesh("pause", "--config", str(config), "--target", "b")
    assert paused.returncode == 0, paused.stderr
    assert paused.stdout.strip() == "paused (router not running; it will start that way): a -> b, c -> b"
    assert await fetch(b.dsn(), "SELECT source, paused FROM pgmesh.links ORDER BY source") == [
        ("a", True), ("c", True)
    ]
    assert await fetch(a.dsn(), "SELECT source FROM pgmesh.links WHERE paused") == []
    status = pgmesh("status", "--config", str(config))
    assert "a -> b         paused" in status.stdout and "a -> c         down" in status.stdout

    resumed = pgmesh("resume", "--config", str(config))
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.startswith("resumed (router not running; it will start that way): b -> a, c -> a")
    for node in (a, b, c):
        assert await fetch(node.dsn(), "SELECT source FROM pgmesh.links WHERE paused") == []
