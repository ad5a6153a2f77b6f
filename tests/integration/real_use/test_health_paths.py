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

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from router.config.model import load_config
from router.service.adminclient import admin_request, ask_router
from router.testing.mesh import config_text, wait_for
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
    log = (tmp_path / "r.log").read_text()  # the whole log (`pgmesh run` logs at INFO by default)
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


def _lags(config: Path) -> dict[str, Any]:
    status = json.loads(pgmesh(config, "status", "--json", check=True).stdout)
    return {f"{lk['source']}->{lk['target']}": lk["lag_bytes"] for lk in status["links"]}


async def test_status_never_counts_lag_from_0_0_and_says_it_without_a_router(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    """A link that never applied anything (its origin at 0/0: a fresh cluster) with a one-row backlog:
    before, `pgmesh status` showed the source's whole WAL position as its lag (tens of MB here, 209 MB in
    the issue). Without a router, status showed lag 0 while writes went on; now the WAL written since."""
    made = await mesh(nodes=3, schema=SCHEMA)
    a = made.nodes[0]
    router, config = await _started(tmp_path, made)
    try:
        pgmesh(config, "pause", "--target", "b", "--source", "a", check=True)
        psql(a, "INSERT INTO kv VALUES (1, 'one row waits for b')")
        await wait_for(lambda: (_lags(config)["a->b"] or 0) > 0, "a -> b to show its backlog", 30)
        lags = _lags(config)
        assert 0 < lags["a->b"] < 1_000_000, lags  # one row's WAL, not the WAL from 0/0
        text = pgmesh(config, "status", check=True).stdout
        assert re.search(r"a -> b\s+paused", text), text
        pgmesh(config, "resume", check=True)
        await wait_identical(made.nodes)
    finally:
        await router.stop()
    psql(a, "INSERT INTO kv SELECT g, repeat('x', 100) FROM generate_series(100, 1099) g")  # no router
    offline = pgmesh(config, "status", "--json", check=True).stdout
    links = {f"{lk['source']}->{lk['target']}": lk for lk in json.loads(offline)["links"]}
    assert links["a->b"]["lag_bytes"] > 100_000 and links["a->c"]["lag_bytes"] > 100_000, links
    assert links["a->b"]["lag_seconds"] is None  # unknown without a router, not 0
    text = pgmesh(config, "status", check=True).stdout
    assert "router NOT running" in text and re.search(r"a -> b\s+down\s+\S+\s+-\s+\d{6,}\s+-", text), text
    again = _run(config, tmp_path / "again.log")  # the same config: the same router log directory
    try:
        await _wait_healthy(router, 60)
        await wait_identical(made.nodes)
    finally:
        again.terminate()
        await asyncio.to_thread(again.wait, 60)
    log = (tmp_path / "again.log").read_text()  # no --log-level: `pgmesh run` says when it starts and stops
    assert re.search(r"INFO router\.service\.supervisor: cluster \w+: router running: nodes a, b, c", log)
    assert re.search(r"INFO router\.service\.supervisor: cluster \w+: router stopped", log), log


def _run(config: Path, log: Path) -> subprocess.Popen[bytes]:
    """`pgmesh run --config CONFIG` as a process, its output in `log`."""
    return subprocess.Popen([sys.executable, "-m", "router", "run", "--config", str(config)],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


async def test_what_the_router_logs_and_exports_and_what_conflicts_says(
    mesh: MeshFactory, tmp_path: Path
) -> None:
    """A hold and its release are logged (INFO; before: the hold at WARNING and no release); /metrics has
    every link's error and retry counters at 0 (before: no sample until the first error, so rate() missed
    it); `pgmesh conflicts` says how many there are in all, by table and type, and how to see more
    (before: 100 rows, no total); a parted node is named as parted, not told to run init."""
    made = await mesh(nodes=3, schema=SCHEMA)
    a, b, c = made.nodes
    for node in (a, b):  # the same keys on two nodes before the router runs: conflicts
        psql(node, f"INSERT INTO kv SELECT g, '{node.name}' FROM generate_series(1, 30) g")
    router, config = await _started(tmp_path, made)
    try:
        await wait_identical(made.nodes)
        _, text = await _get(router, "/metrics")
        for link in LINKS:
            source, target = link.split("->")
            for name in ("pgmesh_apply_errors_total", "pgmesh_apply_retries_total",
                         "pgmesh_skipped_transactions_total"):
                assert f'{name}{{source="{source}",target="{target}"}} 0.0' in text, (name, link, text)
        loaded = load_config(config)
        assert await ask_router(loaded, "POST", "/hold", limit=60) is not None
        await wait_for(lambda: "held for `pgmesh join`" in router.output(), "the hold in the log", 30)
        assert (await ask_router(loaded, "POST", "/release"))[0] == 200  # type: ignore[index]
        await _wait_healthy(router, 60)
        log = (tmp_path / "r.log").read_text()
        assert re.search(r"INFO .*cluster \w+: held for `pgmesh join` or `part` \(replication waits;"
                         r" writes go on\) until released", log), log
        assert re.search(r"INFO .*cluster \w+: released after \d+\.\d s; streaming again", log), log
        assert "WARNING router.service.supervisor: cluster" not in log, log
    finally:
        await router.stop()
    done = pgmesh(config, "conflicts", "--limit", "5")
    assert done.returncode == 0, done
    assert len(done.stdout.splitlines()) == 6, done.stdout  # the header and the newest 5
    recorded = re.search(r"^(\d+) conflict\(s\) recorded; 5 shown, (\d+) more: --limit \1 shows them all",
                         done.stderr, re.M)
    assert recorded and int(recorded.group(1)) >= 30, done.stderr
    assert re.search(r"^\s+public\.kv\s+insert_exists\s+\d+$", done.stderr, re.M), done.stderr
    parted = pgmesh(config, "part", "c", "--clean")
    assert parted.returncode == 0, parted
    done = pgmesh(config, "conflicts")
    assert done.returncode == 0, done
    assert "node c: parted from the cluster" in done.stderr and "pgmesh init" not in done.stdout + done.stderr
    psql(c, "SELECT 1")  # c stays a database of its own


class _Named:
    def __init__(self, name: str, dsn: str) -> None:
        self.name, self._dsn = name, dsn

    def dsn(self) -> str:
        return self._dsn


async def test_a_missing_database_is_named_as_such(mesh: MeshFactory, tmp_path: Path) -> None:
    """A dsn naming a database that does not exist on a running node: `pgmesh init` says so (before:
    "check that node b is running")."""
    made = await mesh(nodes=2, schema=SCHEMA, init=False)
    a, b = made.nodes
    wrong = b.dsn().replace(f"dbname={b.dbname}", "dbname=no_such_db")
    assert wrong != b.dsn()
    config = tmp_path / "pgmesh.toml"
    config.write_text(config_text([a, _Named("b", wrong)], cluster="t"))
    done = pgmesh(config, "init")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert 'database "no_such_db" named in its dsn does not exist there' in out, out
    assert "check that node b is running" not in out, out


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
