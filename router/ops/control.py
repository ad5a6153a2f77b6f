"""The operator's commands: init, run, status, pause, resume, conflicts, sequences.

Each talks to a running router through its admin listener when there is one, and to the nodes when
there is not: `status` then reads the origins' progress and the slots (state "down: router not
running"), and `pause` / `resume` record the link's state in `pgmesh.links` on the target, which the
router reads when it starts. `conflicts` always reads `pgmesh.conflict_history` from the nodes.
`sequences` shows (`router.sequences.ids`) or converts (`router.sequences.convert`) sequence-backed columns.
Rendering for the terminal lives here too; the CLI only parses arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import re
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final, TextIO
from urllib.parse import urlencode

import msgspec
import psycopg

from protocol.lsn import parse_lsn
from router import failpoints
from router.cluster.clocks import NodeClock, connection_query, measure, node_clock
from router.cluster.install import init_cluster
from router.cluster.members import members_of, read_parted
from router.config.model import Config
from router.config.parts import describe_part
from router.errors import ConfigError, PgmeshError, describe
from router.progress.applied import position_sql
from router.sequences import ids as sequences
from router.sequences.convert import convert_sequences
from router.service.admin import ask_router
from router.service.monitor import RETAINED_COLUMNS
from router.service.status import LogStatus, RetainedWal
from router.service.supervisor import LinkStatus, Router, SourceStatus, StatusReport

__all__ = [
    "ConflictRow",
    "cmd_conflicts",
    "cmd_init",
    "cmd_pause",
    "cmd_resume",
    "cmd_run",
    "cmd_sequences",
    "cmd_status",
    "offline_lag",
    "parse_since",
    "read_conflicts",
    "render_conflicts",
    "render_status",
    "render_totals",
]

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


async def cmd_run(config: Config, reload: Callable[[], Config] | None = None) -> int:
    """The router until SIGTERM / SIGINT; `reload` re-reads the config after a hold (`pgmesh join`)."""
    if (refusal := failpoints.environment_refusal()) is not None:
        raise ConfigError(refusal)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    router = Router(config, reload=reload)
    await router.run(stop)
    return 0


async def offline_status(config: Config) -> StatusReport:
    """What the nodes say when no router is running: applied positions and slot positions (parted nodes
    left out, as the router leaves them out)."""
    config = await members_of(config)
    links: list[LinkStatus] = []
    sources: list[SourceStatus] = []
    clocks: list[NodeClock] = []
    for node in config.nodes:
        try:
            conn = await psycopg.AsyncConnection.connect(node.dsn, autocommit=True, connect_timeout=5)
            async with conn:
                links += await _offline_links(conn, config, node.name)
                sources.append(await _offline_source(conn, config, node.name))
                clocks.append(node_clock(node.name, await measure(connection_query(conn)), config.clocks))
        except psycopg.Error as exc:
            sources.append(SourceStatus(node.name, "down", "?", "?", 0, 0, 0, 0, describe(exc)))
    divergence = config.divergent_resolvers()
    links = offline_lag(links, sources)
    return StatusReport(config.cluster.name, False, links, sources, divergence, clocks=clocks,
                        receive_only=[n.name for n in config.nodes if n.receive_only],
                        partial={n.name: describe_part(n) for n in config.nodes if describe_part(n)})


async def _offline_links(
    conn: psycopg.AsyncConnection[Any], config: Config, target: str
) -> list[LinkStatus]:
    out = []
    senders = [n.name for n in config.nodes if not n.receive_only]  # (router.cluster.receive)
    for source in senders:
        if source == target:
            continue
        cur = await conn.execute(
            f"SELECT {position_sql('%s', '%s', True)}::text,"
            " (SELECT paused FROM pgmesh.links WHERE source = %s)",
            [config.origin_name(source), source, source],
        )
        row = await cur.fetchone()
        flushed = row[0] if row and row[0] else "0/0"
        state = "paused" if row and row[1] else "down"
        out.append(LinkStatus(source, target, state, flushed, flushed, None, None, None, 0, 0, 0, 0,
                              "router not running"))
    return out


def offline_lag(links: list[LinkStatus], sources: list[SourceStatus]) -> list[LinkStatus]:
    """Without a router, each link's lag in bytes from the nodes themselves: the source's WAL written
    since what the target applied (or since the source's slot, when the target never applied any), an
    upper bound of what waits for it (its WAL holds other nodes' changes too); unknown ('-') when the
    source or target did not answer. Nothing is applied while no router runs, so this grows with every
    write."""
    by_node = {s.node: s for s in sources if s.state == "down" and s.received_lsn != "?"}
    out = []
    for link in links:
        source = by_node.get(link.source)
        if source is None or link.applied_lsn == "?":
            out.append(link)
            continue
        start = max(parse_lsn(link.applied_lsn), parse_lsn(source.confirmed_lsn))
        lag = max(0, parse_lsn(source.received_lsn) - start) if start else None
        out.append(msgspec.structs.replace(link, lag_bytes=lag))
    return out


async def _offline_source(conn: psycopg.AsyncConnection[Any], config: Config, node: str) -> SourceStatus:
    cur = await conn.execute(
        f"SELECT confirmed_flush_lsn::text, pg_catalog.pg_current_wal_lsn()::text, {RETAINED_COLUMNS}"
        " FROM pg_catalog.pg_replication_slots WHERE slot_name = %s",
        [config.slot_name],
    )
    row = await cur.fetchone()
    if row is None:
        return SourceStatus(
            node, "no slot", "?", "?", 0, 0, 0, 0, "pgmesh is not installed; run `pgmesh init`"
        )
    retained = RetainedWal(int(row[2] or 0), row[3], row[4])  # what the slot keeps while nothing reads it
    return SourceStatus(node, "down", row[1], row[0] or "0/0", 0, 0, 0, 0, "router not running", retained)


async def fetch_status(config: Config) -> StatusReport:
    reply = await ask_router(config, "GET", "/status")
    if reply is not None and reply[0] == 200:
        return msgspec.json.decode(reply[1], type=StatusReport)
    return await offline_status(config)


def render_status(report: StatusReport) -> str:
    lines = [f"cluster {report.cluster}: router {'running' if report.running else 'NOT running'}"]
    if report.lease is not None:  # [ha] (docs/ha.md)
        lease = report.lease
        rows = "; ".join(f"{node} {row.holder or '-'} term {row.term}, expires in {row.expires_in_s:.1f} s"
                         for node, row in lease.nodes.items())
        lines.append(f"lease: this router ({lease.holder}) is {lease.role}, term {lease.term}, valid"
                     f" {lease.valid_for_s:.1f} s: {lease.why}" + (f"; rows: {rows}" if rows else ""))
    if report.receive_only:  # (docs/topology.md)
        lines.append(f"topology: {', '.join(report.receive_only)} only receive(s); every other node sends"
                     " to every node" + "".join(f"; {n} holds {part}" for n, part in report.partial.items()))
    lines.append(
        f"{'link':<14} {'state':<12} {'applied':>12} {'committed at source':<23} {'lag bytes':>10}"
        f" {'lag s':>7} {'queued':>7}  last error"
    )
    for link in sorted(report.links, key=lambda lk: (lk.source, lk.target)):
        name = f"{link.source} -> {link.target}"
        committed = (link.last_commit_time or "-").replace("T", " ")[:23]
        lag_bytes = "-" if link.lag_bytes is None else str(link.lag_bytes)
        lag_s = "-" if link.lag_seconds is None else f"{link.lag_seconds:.2f}"
        lines.append(
            f"{name:<14} {link.state:<12} {link.applied_lsn:>12} {committed:<23} {lag_bytes:>10} "
            f"{lag_s:>7} {link.queued:>7}  {link.last_error or ''}"
        )
    for source in report.sources:
        lines.append(
            f"source {source.node}: {source.state}, received {source.received_lsn}, confirmed "
            f"{source.confirmed_lsn}, reconnects {source.reconnects}" + _retained_text(source.retained)
            + _log_text(source.log) + (f", last error: {source.last_error}" if source.last_error else "")
        )
    for source in report.sources:  # docs/synchronous.md
        sync = source.synchronous
        if sync is not None:
            lines.append(
                f"synchronous {source.node}: k = {sync.k}, applying: {', '.join(sync.applying) or 'none'},"
                f" flushed {sync.flushed_lsn}" + ("" if sync.satisfied else
                "; NOT SATISFIED: commits on it wait until k targets apply again (to stop waiting:"
                " docs/synchronous.md, Stepping down)")
            )
    for rec in report.recorders:  # router.apply.recorder: the node's own deletes as tombstones
        lines.append(
            f"tombstones {rec.node}: recorded to {rec.recorded_lsn}, {rec.tombstones} written,"
            f" {rec.late_decisions} late decisions" + (f", ERROR: {rec.last_error}" if rec.last_error else "")
        )
    for clock in report.clocks:  # router.cluster.clocks: each node's offset from the router's clock
        lines.append(f"clock {clock.node}: {clock.describe()}")
    for node, tables in sorted(report.lost_inserts.items()):  # router.apply.link: key collisions
        lost = ", ".join(f"{table} {count}" for table, count in sorted(tables.items()))
        lines.append(f"LOST INSERTS on {node} (key collisions since the router started: two nodes made the"
                     f" same key, one row is only in pgmesh.conflict_history): {lost}; make the keys"
                     " cluster-unique with `pgmesh sequences convert` (docs/sequences.md)")
    for node, tables in sorted(report.quarantined.items()):  # router.apply.quarantine: set aside, pending
        held = ", ".join(f"{table} {count}" for table, count in sorted(tables.items()))
        lines.append(f"QUARANTINE on {node}: {sum(tables.values())} changes it refused (and later changes of"
                     f" their keys) pending: {held}; `pgmesh quarantine list`, fix the cause, then"
                     " `pgmesh quarantine replay` (docs/conflicts.md, Quarantine)")
    for drift in report.schema_drift:  # router.ddl.drift: the links into and out of those nodes hold
        lines.append(f"SCHEMA DRIFT: {drift} (fix it by hand; docs/ddl.md, Schema drift)")
    if report.verify is not None:  # [verify]: continuous verification (router.service.verify)
        lines.append(report.verify.describe())
    if report.divergence:  # [conflicts] allow_divergence = true: never let it be forgotten
        lines.append(
            "DIVERGENCE ALLOWED ([conflicts] allow_divergence = true): nodes may keep different rows under "
            + "; ".join(report.divergence)
        )
    return "\n".join(lines)


async def cmd_status(
    config: Config, *, as_json: bool, out: TextIO = sys.stdout, watch: float | None = None,
    count: int | None = None,
) -> int:
    """`pgmesh status`; with `watch`, again every `watch` seconds (`count` times, or until interrupted),
    in place on a terminal (the screen cleared first), one report after another otherwise."""
    shown = 0
    while True:
        report = await fetch_status(config)
        text = msgspec.json.encode(report).decode() if as_json else render_status(report)
        if watch is not None and not as_json and out.isatty():
            text = "\x1b[H\x1b[2J" + f"every {watch:g} s (Ctrl-C stops)\n" + text
        print(text, file=out, flush=True)
        shown += 1
        if watch is None or (count is not None and shown >= count):
            return 0
        await asyncio.sleep(max(0.2, watch))


async def _set_paused(config: Config, target: str | None, paused: bool, source: str | None) -> list[str]:
    """Without a router: record the links' state on their targets. Every target is connected first, so
    a node that is down changes nothing; the error names it (and what was done, if a write fails)."""
    verb = "paused" if paused else "resumed"
    conns: list[tuple[str, psycopg.AsyncConnection[Any]]] = []
    try:
        for node in config.nodes:
            if target not in (None, node.name):
                continue
            try:
                conn = await psycopg.AsyncConnection.connect(node.dsn, autocommit=True, connect_timeout=5)
            except psycopg.Error as exc:
                raise PgmeshError(
                    f"cannot connect ({describe(exc)}); nothing {verb}", node=node.name,
                    hint="bring the node up, or start `pgmesh run`, and run this again",
                ) from None
            conns.append((node.name, conn))
        done: list[str] = []
        for name, conn in conns:
            try:
                await _record_paused(conn, config, name, paused, done, source)
            except psycopg.Error as exc:
                raise PgmeshError(f"cannot record the links' state ({describe(exc)}); {verb} so far: "
                                  f"{', '.join(done) or 'nothing'}", node=name) from None
        return done
    finally:
        for _, conn in conns:
            await conn.close()


async def _record_paused(
    conn: psycopg.AsyncConnection[Any], config: Config, target: str, paused: bool, done: list[str],
    only_from: str | None,
) -> None:
    for source in config.node_names:
        if source == target or only_from not in (None, source):
            continue
        await conn.execute(
            "INSERT INTO pgmesh.links (source, paused, updated) VALUES (%s, %s, now())"
            " ON CONFLICT (source) DO UPDATE SET paused = excluded.paused, reason = NULL,"
            " updated = now()",
            [source, paused],
        )
        done.append(f"{source} -> {target}")


async def _pause_resume(
    config: Config, target: str | None, paused: bool, out: TextIO, source: str | None
) -> int:
    for name in (target, source):
        if name is not None:
            config.node(name)  # a clear error for an unknown node
    verb = "pause" if paused else "resume"
    asked = {k: v for k, v in (("target", target), ("source", source)) if v}
    query = f"/{verb}" + (f"?{urlencode(asked)}" if asked else "")
    reply = await ask_router(config, "POST", query)
    if reply is not None and reply[0] == 200:
        links = msgspec.json.decode(reply[1])
        print(f"{verb}d: {', '.join(links) if links else 'nothing'}", file=out)
        return 0
    if reply is not None:
        print(f"the router refused: HTTP {reply[0]} {reply[1].decode(errors='replace')}", file=out)
        return 1
    links = await _set_paused(config, target, paused, source)
    print(f"{verb}d (router not running; it will start that way): {', '.join(links)}", file=out)
    return 0


async def cmd_pause(
    config: Config, target: str | None, out: TextIO = sys.stdout, *, source: str | None = None
) -> int:
    """Pause the links into `target` from `source` (None: every node)."""
    return await _pause_resume(config, target, True, out, source)


async def cmd_resume(
    config: Config, target: str | None, out: TextIO = sys.stdout, *, source: str | None = None
) -> int:
    return await _pause_resume(config, target, False, out, source)


# ---------------------------------------------------------------------------------------------------------
# conflicts: what every node recorded in pgmesh.conflict_history

_AGE_RE: Final = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$")
_AGE_UNITS: Final = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
_HISTORY_SQL: Final = """
SELECT id, at, source, table_name, key, conflict_type, resolution, resolver, reason, local_origin,
       local_commit_time, remote_origin, remote_commit_time, remote_lsn::text, local_row, remote_row
FROM pgmesh.conflict_history
WHERE at >= coalesce(%(since)s::timestamptz, '-infinity')
ORDER BY at DESC, id DESC
LIMIT %(limit)s
"""
_TOTALS_SQL: Final = """
SELECT table_name, conflict_type, count(*), min(at), max(at)
FROM pgmesh.conflict_history
WHERE at >= coalesce(%(since)s::timestamptz, '-infinity')
GROUP BY 1, 2
"""
Totals = dict[tuple[str, str], int]  # (table, conflict type) -> how many recorded
# one node's: (table, conflict type) -> (how many, the oldest's and the newest's time)
NodeTotals = dict[tuple[str, str], tuple[int, dt.datetime, dt.datetime]]


class ConflictRow(msgspec.Struct, frozen=True):
    """One row of `pgmesh.conflict_history`, with the node that decided it (and recorded it)."""

    node: str
    id: int
    at: dt.datetime
    source: str
    table_name: str
    key: str
    conflict_type: str
    resolution: str
    resolver: str
    reason: str | None
    local_origin: str | None
    local_commit_time: dt.datetime | None
    remote_origin: str
    remote_commit_time: dt.datetime
    remote_lsn: str | None
    local_row: Any
    remote_row: Any


def parse_since(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """`--since`: an ISO timestamp (without a zone: local time) or an age such as 30s, 10m, 2h, 1d, 1w."""
    now = now or dt.datetime.now(dt.UTC)
    match = _AGE_RE.match(text)
    if match:
        return now - dt.timedelta(**{_AGE_UNITS[match.group(2)]: int(match.group(1))})
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise PgmeshError(
            f"--since {text!r} is neither an ISO timestamp nor an age",
            hint="use e.g. 2024-05-01T10:00:00+00:00, or 10m, 2h, 1d",
        ) from None
    return when if when.tzinfo is not None else when.astimezone()


async def _node_conflicts(
    node: str, dsn: str, since: dt.datetime | None, limit: int, parted: bool
) -> tuple[list[ConflictRow], NodeTotals] | str:
    """The node's newest `limit` conflicts since `since` and how many of each table and type it holds,
    or why they could not be read (`parted`: the node was parted from the cluster)."""
    try:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, connect_timeout=5)
    except psycopg.Error as exc:
        return f"down ({describe(exc)})"
    try:
        async with conn:
            cur = await conn.execute(_HISTORY_SQL, {"since": since, "limit": limit})
            rows = [ConflictRow(node, *row) for row in await cur.fetchall()]
            cur = await conn.execute(_TOTALS_SQL, {"since": since})
            totals = await cur.fetchall()
            return rows, {(str(t), str(k)): (int(n), first, last) for t, k, n, first, last in totals}
    except psycopg.errors.UndefinedTable:
        if parted:
            return "parted from the cluster (`pgmesh part --clean` removed its conflict history)"
        return "has no pgmesh.conflict_history (run `pgmesh init`)"
    except psycopg.Error as exc:
        return f"could not be read ({describe(exc)})"


async def read_conflicts(
    config: Config, *, since: dt.datetime | None = None, limit: int = 100
) -> tuple[list[ConflictRow], list[str], Totals, dict[str, NodeTotals]]:
    """The newest `limit` conflicts over all nodes, oldest first; one line per node not read; how many
    conflicts of each table and type all nodes recorded (since `since`); and each node's, with the time
    span they cover. A parted node is read when it still has its history, and left out with a note when it
    does not (not a problem then)."""
    parted = await read_parted(config)
    results = await asyncio.gather(
        *(_node_conflicts(node.name, node.dsn, since, limit, node.name in parted) for node in config.nodes)
    )
    rows: list[ConflictRow] = []
    problems: list[str] = []
    totals: Totals = {}
    per_node: dict[str, NodeTotals] = {}
    for node, result in zip(config.nodes, results, strict=True):
        if isinstance(result, str):
            problems.append(f"node {node.name}: {result}")
            continue
        rows.extend(result[0])
        per_node[node.name] = result[1]
        for key, (count, _, _) in result[1].items():
            totals[key] = totals.get(key, 0) + count
    rows.sort(key=lambda r: (r.at, r.node, r.id))
    return rows[-limit:], problems, totals, per_node


def render_totals(totals: Totals, shown: int, limit: int) -> str:
    """How many conflicts were recorded in all, by table and type, and how to see the rest."""
    total = sum(totals.values())
    more = total - shown
    head = f"{total} conflict(s) recorded" + (
        f"; {shown} shown, {more} more: --limit {total} shows them all, --since narrows" if more > 0 else "")
    if not totals:
        return head
    width = max(len(table) for table, _ in totals)
    lines = [f"  {table:<{width}}  {kind:<22} {count:>10}"
             for (table, kind), count in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))]
    return "\n".join([head + ", by table and type:", *lines])


def render_node_totals(per_node: dict[str, NodeTotals], keep: str, keep_rows: int) -> str:
    """Each node's conflicts by table and type, with the time span (UTC) its rows cover, and how long the
    history is kept ([conflicts] keep, keep_rows: router.conflicts.history)."""
    cap = f", at most {keep_rows:,} rows a node" if keep_rows else ""
    head = f"by node (history kept {keep}{cap}: [conflicts] keep{', keep_rows' if keep_rows else ''}):"
    cells = [("node", "table", "type", "count", "from (UTC)", "to (UTC)")]
    for node, totals in per_node.items():
        if not totals:
            cells.append((node, "-", "-", "0", "-", "-"))
        for (table, kind), (count, first, last) in sorted(totals.items(), key=lambda kv: (-kv[1][0], kv[0])):
            cells.append((node, table, kind, str(count), _utc(first), _utc(last)))
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = ["  " + "  ".join(c.rjust(w) if i == 3 else c.ljust(w)
                              for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
             for row in cells]
    return "\n".join([head, *lines])


def _utc(when: dt.datetime) -> str:
    return when.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def render_conflicts(rows: Sequence[ConflictRow]) -> str:
    """A table, newest last: time (UTC), the node that decided, source, table, key, type, resolution."""
    if not rows:
        return "no conflicts recorded"
    header = ("time (UTC)", "node", "source", "table", "key", "type", "resolution")
    cells = [header] + [
        (_utc(r.at), r.node, r.source, r.table_name, r.key, r.conflict_type, r.resolution) for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


async def cmd_conflicts(
    config: Config,
    *,
    since: str | None = None,
    as_json: bool = False,
    limit: int = 100,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> int:
    """Print the conflicts every node recorded (JSON lines with --json); 1 when a node could not be read."""
    if limit < 1:
        raise PgmeshError(f"--limit {limit}: must be at least 1")
    rows, problems, totals, per_node = await read_conflicts(
        config, since=parse_since(since) if since else None, limit=limit)
    parted = [line for line in problems if "parted from the cluster" in line]
    problems = [line for line in problems if line not in parted]
    for line in problems:
        print(line, file=err if as_json else out)
    # the totals and notes on stderr, before the rows: stdout stays the rows alone (JSON lines with
    # --json), for a pipe
    for line in parted:
        print(line, file=err)
    if rows or totals:
        print(render_totals(totals, len(rows), limit), file=err)
        print(render_node_totals(per_node, config.conflicts.keep, config.conflicts.keep_rows), file=err)
    err.flush()
    if as_json:
        for row in rows:
            print(msgspec.json.encode(row).decode(), file=out)
    else:
        print(render_conflicts(rows), file=out)
    return 1 if problems else 0


# ---------------------------------------------------------------------------------------------------------
# sequences: status and convert of the replicated tables' sequence-backed columns


async def cmd_sequences(
    config: Config,
    action: str,
    *,
    mode: str | None = None,
    tables: Sequence[str] = (),
    as_json: bool = False,
    out: TextIO | None = None,
) -> int:
    """`pgmesh sequences status|convert`; status returns 1 when a node was not read or modes differ."""
    out = out or sys.stdout
    config = await members_of(config)  # (a parted node's ids are its own business now)
    if action == "status":
        nodes = await sequences.read_status(config)
        if as_json:
            print(msgspec.json.encode(sequences.status_json(nodes)).decode(), file=out)
        else:
            print(sequences.render_status(nodes), file=out)
        return 1 if any(n.error for n in nodes) or sequences.disagreements(nodes) else 0
    for line in await convert_sequences(config, mode, tables):
        print(line, file=out)
    return 0


def _retained_text(retained: RetainedWal | None) -> str:
    """', slot keeps 12.3 MB of WAL (reserved, 1.0 GB to the limit)' for a source's status line."""
    if retained is None:
        return ""
    limit = "no limit" if retained.safe_wal_size is None else f"{_mb(retained.safe_wal_size)} to the limit"
    return f", slot keeps {_mb(retained.bytes)} of WAL ({retained.wal_status or '?'}, {limit})"


def _log_text(log: LogStatus | None) -> str:
    """', router log 40.2 MB of 10.7 GB (appending, read by c)' for a source's status line."""
    if log is None:
        return ""
    readers = f", read by {', '.join(log.readers)}" if log.readers else ""
    return f", router log {_mb(log.bytes)} of {_mb(log.cap_bytes)} ({log.state}{readers})"


def _mb(size: int) -> str:
    return f"{size / 1e9:.1f} GB" if abs(size) >= 1e9 else f"{size / 1e6:.1f} MB"
