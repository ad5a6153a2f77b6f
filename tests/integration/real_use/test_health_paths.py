"""What an operator and a health check see, as they see it: `/healthz` and `/metrics` over HTTP from a
`pgmesh run` process, `pgmesh status` and `pgmesh conflicts` as commands, the router's own log.

- A node stopped on an idle three-node cluster (`pg_ctl stop`): /healthz answers 503 naming it, and the
  links into and out of it leave `streaming` in /metrics, within seconds; all back once it restarts.
- A node frozen (SIGSTOP: connections open, nothing answers): found within the node timeout.
- `pgmesh status` never counts lag from 0/0 (a link that never applied), and says what is true without a
  router (the WAL written since, not 0).
- The router logs its start and its stop (what it left); a hold and its release; `/metrics` has every
  link's error counters at 0; `pgmesh conflicts` gives totals; a missing database is named as such.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

from router.service.adminclient import admin_request
from router.testing.mesh import wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.real_use.users import RouterProcess, pgmesh, psql, wait_identical

SCHEMA = "CREATE TABLE kv (id bigint PRIMARY KEY, v text NOT NULL);"
LINKS = [f"{s}->{t}" for s in "abc" for t in "abc" if s != t]
STATE = re.compile(r'^pgmesh_link_state\{source="(\w+)",state="(\w+)",target="(\w+)"\} 1\.0$', re.M)


async def _get(router: RouterProcess, path: str) -> tuple[int, str]:
    try:
        code, body = await admin_request("127.0.0.1", router.port, "GET", path, timeout=5)
    except OSError as exc:
        return 0, f"no answer: {exc}"
    return code, body.decode()


async def _link_states(router: RouterProcess) -> dict[str, str]:
    """source->target: the state /metrics says (pgmesh_link_state ... 1)."""
    _, text = await _get(router, "/metrics")
    return {f"{s}->{t}": state for s, state, t in STATE.findall(text)}


async def _healthy(router: RouterProcess) -> bool:
    return await _get(router, "/healthz") == (200, "ok\n") and set(
        (await _link_states(router)).items()) == {(link, "streaming") for link in LINKS}


async def _started(tmp_path: Path, made: Any) -> tuple[RouterProcess, Path]:
    router = RouterProcess(tmp_path, made)
    router.start()
    await _wait_healthy(router, 60)
    return router, tmp_path / "r.toml"


async def _wait_healthy(router: RouterProcess, limit: float) -> None:
    try:
        await wait_for(lambda: _healthy(router), "/healthz ok and every link streaming", limit)
    except AssertionError as exc:
        seen = (await _get(router, "/healthz"), await _link_states(router))
        raise AssertionError(f"{exc}: {seen}\n{router.output()}") from None


async def _node_down_shows(router: RouterProcess, node: str, last: dict[str, Any]) -> bool:
    """/healthz is not 200 and names `node`; every link into and out of it is not streaming."""
    last["health"] = await _get(router, "/healthz")
    last["links"] = await _link_states(router)
    code, body = last["health"]
    touching = [link for link in LINKS if node in link.split("->")]
    return (code not in (0, 200) and f"node {node}" in body
            and all(last["links"].get(link, "streaming") != "streaming" for link in touching))


async def test_a_stopped_node_shows_in_healthz_and_link_states_and_comes_back(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    """The issue's path: three idle nodes, `pg_ctl stop` on one. Before, /healthz said 200 `ok` and every
    link `streaming` for as long as it was tried. The router's log says when it starts and stops."""
    made = await mesh(nodes=3, schema=SCHEMA)
    a, _, c = made.nodes
    router, config = await _started(tmp_path, made)
    try:
        psql(a, "INSERT INTO kv VALUES (1, 'a')")
        await wait_identical(made.nodes)
        c.stop()  # idle: nothing is written anywhere
        last: dict[str, Any] = {}
        try:
            await wait_for(lambda: _node_down_shows(router, "c", last),
                           "/healthz and c's links to show c down", 15)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {last}") from None
        code, body = last["health"]
        assert code == 503 and "not reachable" in body, body
        status = json.loads(pgmesh(config, "status", "--json", check=True).stdout)
        assert {f"{lk['source']}->{lk['target']}": lk["state"] for lk in status["links"]
                if "c" in (lk["source"], lk["target"])} == {"a->c": "down", "b->c": "down", "c->a": "down",
                                                            "c->b": "down"}
        assert all("node c" in (lk["last_error"] or "") for lk in status["links"] if lk["state"] == "down")
        psql(a, "INSERT INTO kv VALUES (2, 'a while c is down')")
        c.start()
        await _wait_healthy(router, 90)
        psql(c, "INSERT INTO kv VALUES (3, 'c after its restart')")
        await wait_identical(made.nodes)
    finally:
        await router.stop()
    log = router.output()  # (`pgmesh run` logs at INFO by default; RouterProcess says so too)
    assert re.search(r"INFO .*cluster \w+: router running: nodes a, b, c; 6 links; admin on 127\.0\.0\.1:"
                     + str(router.port), log), log
    assert re.search(r"INFO .*cluster \w+: streaming stopped; slots confirmed to what the targets flushed"
                     r" \(a \d+/[0-9A-F]+, b \d+/[0-9A-F]+, c \d+/[0-9A-F]+\); 0 transaction\(s\)", log), log
    assert re.search(r"INFO .*cluster \w+: router stopped", log), log


async def test_a_frozen_node_shows_down_within_the_node_timeout(mesh: MeshFactory, tmp_path: Path) -> None:
    """Not stopped but unreachable: the postmaster and every backend of node b SIGSTOPped (connections
    stay open, nothing answers). Found by the router's bounded probe (node_timeout_ms, 10 s by default),
    with no write anywhere; streaming again once b runs on."""
    made = await mesh(nodes=3, schema=SCHEMA)
    a, b, _ = made.nodes
    router, _config = await _started(tmp_path, made)
    pids = _server_pids(b)
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        last: dict[str, Any] = {}
        try:
            await wait_for(lambda: _node_down_shows(router, "b", last),
                           "/healthz and b's links to show b down", 30)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {last}") from None
        assert "no answer" in last["health"][1], last
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    try:
        await _wait_healthy(router, 90)
        psql(a, "INSERT INTO kv VALUES (10, 'after b ran on')")
        await wait_identical(made.nodes)
    finally:
        await router.stop()


def _server_pids(node: Any) -> list[int]:
    """The postmaster of `node` (postmaster.pid's first line) and its children (backends, walsenders)."""
    postmaster = int((Path(node.datadir) / "postmaster.pid").read_text().split()[0])
    return [postmaster, *(pid for pid in _all_pids() if _parent_of(pid) == postmaster)]


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1
