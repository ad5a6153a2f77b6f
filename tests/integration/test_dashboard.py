"""The Grafana dashboard (deploy/grafana/pgmesh.json) against a real router's /metrics.

Every `pgmesh_*` name in a panel's PromQL or a variable's query must be a series a running router
exports over a real mesh (read from a live scrape, never from router/service/metrics.py), and every label
a selector matches on must be one of that series' labels. The mesh is made to show what a quiet one
would not: a conflict (the same key inserted on both nodes before the router starts) and a WAL limit
(`max_slot_wal_keep_size`, so the slot's safe size is reported), an apply error (a CHECK one node breaks).
Series a healthy router does not export at all (retries, schema drift, divergent resolvers appear only
once they happen) are left off the dashboard; docs/deploy.md suggests alerts on them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from router.service.admin import admin_request
from router.testing.mesh import NODE_SETTINGS, execute, free_port, running_router, wait_for
from tests.fix_mesh import MeshFactory

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pgmesh.json"
SCHEMA = "CREATE TABLE items (id int PRIMARY KEY, v text);"
NAME = re.compile(r"\bpgmesh_[a-zA-Z0-9_]+")
SELECTOR = re.compile(r"\b(pgmesh_[a-zA-Z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+\S+")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="')
PANEL_KINDS = {"row", "stat", "table", "timeseries"}


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            yield f"variable {var['name']}", query


def scraped(text: str) -> dict[str, set[str]]:
    """Series name -> the label names its samples carry, from Prometheus text exposition."""
    series: dict[str, set[str]] = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match and not line.startswith("#"):
            series.setdefault(match.group(1), set()).update(LABEL.findall(match.group(2) or ""))
    return series


def missing(dashboard: dict[str, Any], series: dict[str, set[str]]) -> list[str]:
    out = []
    for where, expr in queries(dashboard):
        out += [f"{where}: {name}" for name in NAME.findall(expr) if name not in series]
        for name, matchers in SELECTOR.findall(expr):
            unknown = set(MATCHER.findall(matchers)) - series.get(name, set())
            if name in series and unknown:
                out.append(f"{where}: {name} has no label {sorted(unknown)}")
    return out


def test_dashboard_is_grafana_json_with_the_asked_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "pgmesh" and dashboard["schemaVersion"] >= 36
    titles = [p["title"] for p in dashboard["panels"]]
    assert len(set(titles)) == len(titles)
    assert {p["type"] for p in dashboard["panels"]} <= PANEL_KINDS
    names = {n for _, expr in queries(dashboard) for n in NAME.findall(expr)}
    asked = {"pgmesh_lag_seconds", "pgmesh_lag_bytes", "pgmesh_applied_transactions_total",
             "pgmesh_conflicts_total", "pgmesh_queue_transactions", "pgmesh_router_log_bytes",
             "pgmesh_retained_wal_bytes", "pgmesh_link_state"}
    assert asked <= names, asked - names
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    # ids unique and panels on the 24-column grid
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids)
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in dashboard["panels"])


async def test_every_series_the_dashboard_queries_is_in_metrics(mesh: MeshFactory) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    port = free_port()
    settings = {**NODE_SETTINGS, "max_slot_wal_keep_size": "1GB"}  # pgmesh_retained_wal_safe_bytes
    m = await mesh(nodes=2, schema=SCHEMA, settings=settings, admin_port=port)
    a, b = m.nodes
    # the same key on both nodes before the router runs: each applies the other's insert as a conflict
    await execute(a.dsn(), "INSERT INTO items VALUES (1, 'from a')")
    await execute(b.dsn(), "INSERT INTO items VALUES (1, 'from b')")
    # an apply error (pgmesh_apply_errors_total): b adds a CHECK that a's row 2 breaks, so b refuses the row
    # (link a -> b pauses) and a refuses the replicated ALTER (link b -> a pauses)
    await execute(b.dsn(), "ALTER TABLE items ADD CONSTRAINT not_refused CHECK (v <> 'refused')")
    await execute(a.dsn(), "INSERT INTO items VALUES (2, 'refused')")
    last: dict[str, Any] = {"missing": ["no scrape yet"]}

    async def complete() -> bool:
        code, body = await admin_request("127.0.0.1", port, "GET", "/metrics", timeout=5)
        assert code == 200
        last["missing"] = missing(dashboard, scraped(body.decode()))
        return not last["missing"]

    async with running_router(m.config):
        try:
            await wait_for(complete, "every series the dashboard queries in /metrics", 60)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {last['missing']}") from None
