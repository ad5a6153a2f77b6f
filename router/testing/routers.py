"""Router processes for tests and benches of standby routers ([ha], router.service.lease): each a `python -m
router run` of its own, with its own config (admin port, router-log directory, `[ha] name`), read through
its admin listener, signalled by process group, and stopped at the end.

Must not: start or stop nodes (router.testing.localnodes), or decide what a test checks.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from router.testing.mesh import config_text, free_port, log_directory

__all__ = ["Routers", "ha_section"]


def ha_section(lease_s: float, margin_s: float = 0.5) -> str:
    return f"[ha]\nenabled = true\nlease_s = {lease_s}\nmargin_s = {margin_s}\n"


class Routers:
    """Router processes of one test or bench run, by name; `stop` ends every one still running."""

    def __init__(self, tmp: Path, ha: str, cluster: str = "t", log_level: str = "INFO") -> None:
        self.tmp = tmp
        self.ha = ha
        self.cluster = cluster
        self.log_level = log_level
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}

    def start(self, name: str, nodes: Sequence[Any]) -> None:
        """Start router `name` over `nodes` (objects with `name` and `dsn()`); again after it ended, on the
        same admin port."""
        port = self.ports.setdefault(name, free_port())
        path = self.tmp / f"{name}.toml"
        ha = self.ha.replace("[ha]\n", f'[ha]\nname = "{name}"\n')
        path.write_text(config_text(nodes, cluster=self.cluster, admin_port=port, extra=ha,
                                    log_dir=log_directory()))
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "router", "--log-level", self.log_level, "run", "--config", str(path)],
            stdout=(self.tmp / f"{name}.log").open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
        )

    def signal(self, name: str, sig: signal.Signals) -> None:
        os.killpg(self.procs[name].pid, sig)

    async def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)
        await asyncio.to_thread(self.procs[name].wait)

    async def lease(self, name: str) -> dict[str, Any] | None:
        """The router's /status `lease` (None: no answer)."""
        def get() -> dict[str, Any] | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[name]}/status", timeout=2) as r:
                    lease: dict[str, Any] | None = json.loads(r.read())["lease"]
                    return lease
            except (OSError, ValueError, KeyError):
                return None
        return await asyncio.to_thread(get)

    async def role(self, name: str) -> str | None:
        lease = await self.lease(name)
        return None if lease is None else str(lease["role"])

    async def is_(self, name: str, role: str) -> bool:
        return await self.role(name) == role

    async def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    await asyncio.to_thread(proc.wait, 60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    await asyncio.to_thread(proc.wait)

    def output(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("*.log")))
