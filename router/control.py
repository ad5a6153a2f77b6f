"""The operator's commands: init, run, status, pause, resume.

Each talks to a running router through its admin listener when there is one, and to the nodes when
there is not: `status` then reads the origins' progress and the slots (state "down: router not
running"), and `pause` / `resume` record the link's state in `pgmesh.links` on the target, which the
router reads when it starts. Rendering for the terminal lives here too; the CLI only parses arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from typing import Any, TextIO

import msgspec
import psycopg

from router.admin import admin_request
from router.catalog import init_cluster
from router.config import Config
from router.errors import ConfigError, describe
from router.supervisor import LinkStatus, Router, SourceStatus, StatusReport

__all__ = ["cmd_init", "cmd_pause", "cmd_resume", "cmd_run", "cmd_status", "render_status"]

logger = logging.getLogger(__name__)


async def cmd_init(config: Config, out: TextIO = sys.stdout) -> int:
    try:
        report, actions = await init_cluster(config)
    except ConfigError as exc:
        print(str(exc), file=out)
        return 1
    print(report.render(), file=out)
    for line in actions:
        print(line, file=out)
    return 0 if report.ok else 1


async def cmd_run(config: Config) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    router = Router(config)
    await router.run(stop)
    return 0


async def _admin(config: Config, method: str, path: str) -> tuple[int, bytes] | None:
    host, port = config.admin_host_port
    try:
        return await admin_request(host, port, method, path, timeout=5.0)
    except OSError:
        return None


async def offline_status(config: Config) -> StatusReport:
    """What the nodes say when no router is running: applied positions and slot positions."""
    links: list[LinkStatus] = []
    sources: list[SourceStatus] = []
    for node in config.nodes:
        try:
            conn = await psycopg.AsyncConnection.connect(node.dsn, autocommit=True, connect_timeout=5)
            async with conn:
                links += await _offline_links(conn, config, node.name)
                sources.append(await _offline_source(conn, config, node.name))
        except psycopg.Error as exc:
            sources.append(SourceStatus(node.name, "down", "?", "?", 0, 0, 0, describe(exc)))
    return StatusReport(config.cluster.name, False, links, sources)


async def _offline_links(
    conn: psycopg.AsyncConnection[Any], config: Config, target: str
) -> list[LinkStatus]:
    out = []
    for source in config.node_names:
        if source == target:
            continue
        cur = await conn.execute(
            "SELECT pg_catalog.pg_replication_origin_progress(%s, true)::text,"
            " (SELECT paused FROM pgmesh.links WHERE source = %s)",
            [config.origin_name(source), source],
        )
        row = await cur.fetchone()
        flushed = row[0] if row and row[0] else "0/0"
        state = "paused" if row and row[1] else "down"
        out.append(LinkStatus(source, target, state, flushed, flushed, None, 0, 0.0, 0, 0, 0, 0,
                              "router not running"))
    return out


async def _offline_source(conn: psycopg.AsyncConnection[Any], config: Config, node: str) -> SourceStatus:
    cur = await conn.execute(
        "SELECT confirmed_flush_lsn::text, pg_current_wal_lsn()::text FROM pg_catalog.pg_replication_slots"
        " WHERE slot_name = %s",
        [config.slot_name],
    )
    row = await cur.fetchone()
    if row is None:
        return SourceStatus(node, "no slot", "?", "?", 0, 0, 0, "pgmesh is not installed; run `pgmesh init`")
    return SourceStatus(node, "down", row[1], row[0] or "0/0", 0, 0, 0, "router not running")


async def fetch_status(config: Config) -> StatusReport:
    reply = await _admin(config, "GET", "/status")
    if reply is not None and reply[0] == 200:
        return msgspec.json.decode(reply[1], type=StatusReport)
    return await offline_status(config)


def render_status(report: StatusReport) -> str:
    lines = [f"cluster {report.cluster}: router {'running' if report.running else 'NOT running'}"]
    lines.append(
        f"{'link':<14} {'state':<12} {'applied':>12} {'committed at source':<23} {'lag bytes':>10}"
        f" {'lag s':>7} {'queued':>7}  last error"
    )
    for link in sorted(report.links, key=lambda lk: (lk.source, lk.target)):
        name = f"{link.source} -> {link.target}"
        committed = (link.last_commit_time or "-").replace("T", " ")[:23]
        lines.append(
            f"{name:<14} {link.state:<12} {link.applied_lsn:>12} {committed:<23} {link.lag_bytes:>10} "
            f"{link.lag_seconds:>7.2f} {link.queued:>7}  {link.last_error or ''}"
        )
    for source in report.sources:
        lines.append(
            f"source {source.node}: {source.state}, received {source.received_lsn}, confirmed "
            f"{source.confirmed_lsn}, reconnects {source.reconnects}"
            + (f", last error: {source.last_error}" if source.last_error else "")
        )
    return "\n".join(lines)


async def cmd_status(config: Config, *, as_json: bool, out: TextIO = sys.stdout) -> int:
    report = await fetch_status(config)
    if as_json:
        print(msgspec.json.encode(report).decode(), file=out)
    else:
        print(render_status(report), file=out)
    return 0


async def _set_paused(config: Config, target: str | None, paused: bool) -> list[str]:
    """Without a router: record the links' state on their targets."""
    done = []
    for node in config.nodes:
        if target not in (None, node.name):
            continue
        conn = await psycopg.AsyncConnection.connect(node.dsn, autocommit=True, connect_timeout=5)
        async with conn:
            for source in config.node_names:
                if source == node.name:
                    continue
                await conn.execute(
                    "INSERT INTO pgmesh.links (source, paused, updated) VALUES (%s, %s, now())"
                    " ON CONFLICT (source) DO UPDATE SET paused = excluded.paused, reason = NULL,"
                    " updated = now()",
                    [source, paused],
                )
                done.append(f"{source} -> {node.name}")
    return done


async def _pause_resume(config: Config, target: str | None, paused: bool, out: TextIO) -> int:
    if target is not None:
        config.node(target)  # a clear error for an unknown node
    verb = "pause" if paused else "resume"
    query = f"/{verb}" + (f"?target={target}" if target else "")
    reply = await _admin(config, "POST", query)
    if reply is not None and reply[0] == 200:
        links = msgspec.json.decode(reply[1])
        print(f"{verb}d: {', '.join(links) if links else 'nothing'}", file=out)
        return 0
    if reply is not None:
        print(f"the router refused: HTTP {reply[0]} {reply[1].decode(errors='replace')}", file=out)
        return 1
    links = await _set_paused(config, target, paused)
    print(f"{verb}d (router not running; it will start that way): {', '.join(links)}", file=out)
    return 0


async def cmd_pause(config: Config, target: str | None, out: TextIO = sys.stdout) -> int:
    return await _pause_resume(config, target, True, out)


async def cmd_resume(config: Config, target: str | None, out: TextIO = sys.stdout) -> int:
    return await _pause_resume(config, target, False, out)

