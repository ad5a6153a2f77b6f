"""Node join and part: a new node gets one snapshot of a donor plus exactly what the donor lacked.

`pgmesh join NODE [--from DONOR]` (the node already listed in config.toml, its database empty):

1. Every node must answer. The router (if it runs) holds only while the join takes its snapshot: every
   member's slot is then pinned at its confirmed position (router.cluster.joining: the router confirms
   none further until the new node is a member), and the donor must have applied every other node X up
   to X's pin. With no applier running, what the donor has applied from X stays fixed at its origin's
   progress P_X, and X's slot (pinned, at or below P_X) still has everything after P_X. The router is
   released as soon as the snapshot and P_X are taken: the existing links stream during the copy.
2. A temporary slot on the donor exports a snapshot S with its consistent point L: S holds exactly
   the donor's own transactions that committed before L, and every X's transaction up to P_X. A
   holder transaction keeps S importable; a lock holder (router.cluster.copy.locks) takes ACCESS
   SHARE locks on the copied tables and plans the copy in the same session, so TRUNCATE or ALTER
   TABLE on the donor waits for the copy, and the copy never queues behind them. Every join session
   waits at most JOIN_LOCK_WAIT_S for a lock; an application session that waits that long for one of
   the join's makes the round stop, and the copy starts again under the same snapshot, leaving out the
   tables truncated since (router.cluster.copy.rounds); a table rewritten by ALTER TABLE since makes
   the join start again from a new snapshot (`retry_join`).
3. The schema at S (`pg_dump --schema-only --snapshot`) is restored in two parts: pre-data before the
   copy; indexes, constraints and triggers (post-data) after it; column defaults once pgmesh is
   installed (step 5: one may call `pgmesh.snowflake_nextval`). pgmesh's own schema, its event and
   tombstone triggers and publications are left out: `pgmesh init` installs them fresh.
4. The rows are copied by the PySpark batch of `router.cluster.copy.initial`: tasks that each import S and
   stream one ctid range of one table from `COPY ... TO STDOUT (FORMAT binary)` into `COPY ... FROM
   STDIN (FORMAT binary)` on the new node.
5. The router holds again; `pgmesh init` with the new config installs pgmesh on the new node (its slot is
   created now, after the copy, so the copied rows are never sent anywhere) and its origin on the others.
   The new node's origin for the donor is then advanced to L, and its origin for every other X to P_X;
   the pins go, and the router is released: it starts each source from the lowest position any link
   needs, and the new node gets the donor's transactions after L and X's after P_X: each exactly once
   (docs/join.md).

A join that stops midway leaves a marker (schema `pgmesh_join` on the new node): the next join
cleans the new node first, without `--force`. One that fails before the install removes its pins
(router.cluster.joining) from every member: they would keep WAL there.

A node parted earlier (router.ops.part) is a member again once joined: its part record is cleared
in the last hold; other parted nodes the config still lists are left out of the join's `pgmesh init`.

Must not: take the snapshot or make the new node a member while the router streams; put a DSN or
password on a command line or in a message (the PostgreSQL tools get them through PG* environment
variables).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Final, NamedTuple

import msgspec
import psycopg
import psycopg.conninfo
from psycopg import sql

from protocol.lsn import format_lsn, parse_lsn
from router import failpoints
from router.cluster.checks import InitReport, check_cluster, replicated_tables
from router.cluster.install import install, uninstall
from router.cluster.joining import copy_auto_identity, pin_sources, unpin
from router.cluster.members import read_parted, unmark_parted, without_parted
from router.cluster.partial import is_partial, reaches
from router.cluster.synchronous import standby_names
from router.config.model import PGMESH_SCHEMA, Config, NodeConfig
from router.errors import (
    JOIN_LOCK_WAIT_S,
    JOIN_SLOT_WAIT_S,
    ConfigError,
    PgmeshError,
    retry_join,
)
from router.nodes.connect import Conn, connect
from router.nodes.connect import one as _one
from router.progress.applied import position_sql
from router.service.admin import ask_router
from router.stream.items import SourceOptions
from router.stream.slots import SlotCreated
from router.stream.source import ReplicationSource

__all__ = ["JoinReport", "cmd_join", "join_node"]

logger = logging.getLogger(__name__)

MARKER_SCHEMA: Final = "pgmesh_join"
QUIET_ROUNDS: Final = 3  # holds to find the donor caught up with the pinned slots
QUIET_WAIT_S: Final = 120.0  # between two: how long the donor may take to catch up
_SKIP_SCHEMAS: Final = ("pg_catalog", "information_schema", "pg_toast", PGMESH_SCHEMA, MARKER_SCHEMA)


class JoinReport(msgspec.Struct, frozen=True):
    node: str
    donor: str
    snapshot_lsn: str
    positions: dict[str, str]  # source -> where the new node starts reading it
    tables: int
    rows: int
    bytes: int
    copy_seconds: float
    seconds: float
    attempts: int = 1  # more when the join started again with a new snapshot (a table rewritten...)
    rounds: int = 1  # copies under the last snapshot: more when the join gave way to the application
    truncated: tuple[str, ...] = ()  # not copied: truncated after the snapshot (the stream replays it)


class _Attempt(NamedTuple):
    """The attempt that copied: positions, snapshot LSN, copy (rounds.Copied), what the restore left."""

    positions: dict[str, str]
    snapshot_lsn: str
    copied: Any
    restore: Any
    attempts: int


# ---------------------------------------------------------------------------------------------------------
# Small pieces


async def _router_streaming(conns: dict[str, Conn], config: Config) -> list[str]:
    busy = []
    for name, conn in conns.items():
        pid = await _one(
            conn, "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", [config.slot_name]
        )
        if pid is not None:
            busy.append(name)
    return busy


async def _hold_router(config: Config, members: dict[str, Conn], busy: list[str]) -> bool:
    """Ask the running router to stop streaming for the join (writes go on); True once it has."""
    answer = await ask_router(config, "POST", "/hold", limit=150.0)
    if answer is None or answer[0] != 200:
        raise PgmeshError(
            f"the router is streaming from {', '.join(busy)} and its admin listener"
            f" ({config.admin.listen}) does not take a hold",
            hint="stop `pgmesh run` first (writes may go on), run the join, then start `pgmesh run`"
            " again with the new node in the config",
        )
    deadline = time.monotonic() + 60
    while await _router_streaming(members, config):
        if time.monotonic() > deadline:
            await ask_router(config, "POST", "/release")
            raise PgmeshError("the router held, but its slots stayed active for 60 s")
        await asyncio.sleep(0.1)
    logger.info("the router holds for the join: replication waits, writes go on")
    return True


async def _user_tables(conn: Conn) -> int:
    return int(await _one(
        conn,
        "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.relkind IN ('r', 'p') AND n.nspname <> ALL(%s) AND n.nspname NOT LIKE 'pg\\_%%'",
        [list(_SKIP_SCHEMAS)],
    ))


async def _clean_new_node(conn: Conn, config: Config, node: str) -> list[str]:
    """Remove what an earlier (failed or forced) join left: user schemas' objects and pgmesh."""
    done = await uninstall(config, node)
    cur = await conn.execute(
        "SELECT nspname FROM pg_namespace WHERE nspname <> ALL(%s) AND nspname NOT LIKE 'pg\\_%%'",
        [[s for s in _SKIP_SCHEMAS if s != MARKER_SCHEMA]],
    )
    for (schema,) in await cur.fetchall():
        await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
        done.append(f"dropped schema {schema}")
    await conn.execute("CREATE SCHEMA IF NOT EXISTS public")
    return done


async def _mark(target: Conn, donor: str) -> None:
    """The marker of a join under way: a join that stops midway leaves it, and the next one cleans up."""
    await target.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(MARKER_SCHEMA)))
    await target.execute(sql.SQL(
        "CREATE TABLE IF NOT EXISTS {}.state (donor text, started timestamptz DEFAULT now())"
    ).format(sql.Identifier(MARKER_SCHEMA)))
    await target.execute(
        sql.SQL("INSERT INTO {}.state (donor) VALUES (%s)").format(sql.Identifier(MARKER_SCHEMA)), [donor]
    )


# ---------------------------------------------------------------------------------------------------------
# Join


async def join_node(
    config: Config,
    name: str,
    *,
    donor: str | None = None,
    force: bool = False,
    progress: Callable[[Any], None] | None = None,
    fail_copy: bool = False,
    lock_wait_s: float = JOIN_LOCK_WAIT_S,
    slot_wait_s: float = JOIN_SLOT_WAIT_S,
) -> JoinReport:
    """Copy `donor` (default: the first other node) to the new node `name` and set its positions.

    No session of the join waits more than `lock_wait_s` for a lock, and an application session that
    waits that long for one of the join's locks makes the join give way and start again. Creating the
    join's slot waits at most `slot_wait_s` for the transactions running on the donor to end.
    `fail_copy` (tests only) makes the copy fail after the schema is in place, as a killed job would.
    """
    started = time.monotonic()
    config = without_parted(config, await read_parted(config) - {name})  # (router.ops.part)
    new = config.node(name)
    others = [n for n in config.nodes if n.name != name]
    source_node = config.node(donor) if donor else next((n for n in others if not is_partial(n)), others[0])
    if source_node.name == name:
        raise ConfigError("a node cannot be its own donor")
    if is_partial(source_node):  # (router.cluster.partial)
        raise ConfigError(f"node {source_node.name} holds part of the data: it cannot be a donor")
    conns: dict[str, Conn] = {}
    members: dict[str, Conn] = {}
    unreachable: list[str] = []
    held = pinned = False
    for node in config.nodes:
        try:
            # a session that never queues behind the application for a lock longer than JOIN_LOCK_WAIT_S
            conns[node.name] = await connect(
                node, purpose="pgmesh join", lock_wait_s=JOIN_LOCK_WAIT_S, admin=True
            )
        except PgmeshError as exc:
            unreachable.append(f"{node.name} ({exc.message})")
    try:
        if unreachable:
            raise PgmeshError(
                f"every node must be reachable during a join; cannot reach {', '.join(unreachable)}",
                hint="start the node (or fix its dsn), then run join again",
            )
        members = {n.name: conns[n.name] for n in others}
        for node in others:
            if await _one(conns[node.name], "SELECT to_regclass('pgmesh.links')") is None:
                raise PgmeshError(
                    "pgmesh is not installed here", node=node.name, hint="run `pgmesh init` first"
                )
        target = conns[name]
        await target.execute("SET pgmesh.ddl_local = on")  # what join does on the new node stays there
        marker = await _one(target, "SELECT to_regclass(%s)", [f"{MARKER_SCHEMA}.state"])
        if await _user_tables(target) and marker is None and not force:
            raise PgmeshError(
                "the new node's database holds user tables", node=name,
                hint="join into an empty database, or pass --force to drop its schemas first",
            )
        if marker is not None or force:
            for line in await _clean_new_node(target, config, name):
                logger.info("node %s: %s", name, line)
        else:
            await uninstall(config, name)  # pgmesh objects of an earlier membership, if any
        await _mark(target, source_node.name)
        pinned = True  # from here on, a join that fails removes its pins (they keep WAL on every member)
        report = await _join_attempts(
            config, new, source_node, others, conns, progress, fail_copy, (lock_wait_s, slot_wait_s)
        )
        checked = await _checked(config)  # (the router streams meanwhile)
        busy = await _router_streaming(members, config)
        if busy:  # the router takes the new node in when it starts again
            held = await _hold_router(config, members, busy)
        await _check_pins(members, config, name)
        await unmark_parted(config, name)
        pinned = False  # installed: the pins keep the node out of the members until its positions are set
        for line in await install(config, checked):
            logger.info("%s", line)
        from router.cluster.copy.schema import restore_defaults

        restored = await restore_defaults(new, report.restore)  # they may call pgmesh's functions
        logger.info("node %s: %d column defaults restored", name, restored)
        await copy_auto_identity(conns[source_node.name], target)
        for source, lsn in report.positions.items():
            await target.execute(
                "SELECT pg_replication_origin_advance(%s, %s::pg_lsn)", [config.origin_name(source), lsn]
            )
            await target.execute(  # the applied mark starts from there (router.progress.applied)
                "UPDATE pgmesh.links SET applied = NULL WHERE source = %s", [source]
            )
        await unpin(members, name)  # a member now: its own positions hold the sources' slots
        await target.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(MARKER_SCHEMA)))
    except BaseException:
        if pinned:  # nothing of the new node is installed: its pins only keep WAL
            with contextlib.suppress(PgmeshError):
                await asyncio.shield(unpin(members, name))
                logger.info("join of %s failed: its pins on %s removed", name, ", ".join(members))
        raise
    finally:
        for conn in conns.values():
            await conn.close()
        if held:  # the router re-reads the config and streams to and from the new node
            await ask_router(config, "POST", "/release")
    for line in await standby_names(config, waiting=True, only=[name]):  # last, as init (docs/synchronous.md)
        logger.info("%s", line)
    copied = report.copied.report
    return JoinReport(
        node=name, donor=source_node.name, snapshot_lsn=report.snapshot_lsn, positions=report.positions,
        tables=len(copied.tables), rows=copied.rows, bytes=copied.bytes, copy_seconds=copied.seconds,
        seconds=time.monotonic() - started, attempts=report.attempts, rounds=report.copied.rounds,
        truncated=report.copied.truncated,
    )


async def _checked(config: Config) -> InitReport:
    """`pgmesh init`'s checks for the grown cluster. Columns and keys may differ between nodes while DDL
    issued during the join is still on its way (the router applies it in order once it runs): that is
    reported, not refused. Any other problem is."""
    report = await check_cluster(config)
    drift = [c for c in report.problems
             if (c.check == "table" and c.detail.startswith("column ")) or c.check == "keys"]
    if len(drift) < len(report.problems):
        raise ConfigError("the joined cluster is not ready\n" + report.render())
    for check in drift:
        logger.warning("node %s, table %s: %s (DDL in flight; the router applies it in order)",
                       check.node, check.relation, check.detail)
    checks = [msgspec.structs.replace(c, ok=True) if c in drift else c for c in report.checks]
    return msgspec.structs.replace(report, checks=checks)


@contextlib.asynccontextmanager
async def _quiet(config: Config, members: dict[str, Conn], donor: str, new: str) -> AsyncIterator[bool]:
    """While the join takes its snapshot: the router holds (if it runs), every member's slot is pinned
    at its confirmed position (router.cluster.joining), and the donor has everything of every other
    source up to its pin (the router says so: its link into the donor is synced that far, not counting
    what the router's log holds for it). The donor's origins are then fixed and no slot lacks what the
    new node will read from them. The router is released at the end: it streams while the join copies,
    and keeps the pins."""
    for round_ in range(1, QUIET_ROUNDS + 1):
        busy = await _router_streaming(members, config)
        held = await _hold_router(config, members, busy) if busy else False
        try:
            pins = await pin_sources(members, config, new)
            short = await _donor_short(config, pins, donor) if held else {}
            if not short:
                yield held
                return
        finally:
            if held:
                await ask_router(config, "POST", "/release")
        if round_ == QUIET_ROUNDS:
            what = ", ".join(f"{x} (synced to {format_lsn(p)}, its slot at {format_lsn(pins[x])})"
                             for x, p in short.items())
            raise PgmeshError(
                f"the donor has not applied what the router's log holds for it from {what}", node=donor,
                hint="let the router catch the donor up (pgmesh status), or join from another donor",
            )
        logger.info("join: the donor is behind %s; waiting for it to catch up", ", ".join(short))
        deadline = time.monotonic() + QUIET_WAIT_S  # the router streams, pinned: the donor catches up
        while time.monotonic() < deadline:
            if not await _donor_short(config, pins, donor):
                break
            await asyncio.sleep(0.5)


async def _donor_short(config: Config, pins: dict[str, int], donor: str) -> dict[str, int]:
    """The sources whose link into the donor the running router has not synced up to their pin: source ->
    its synced position. A link is synced to a position when its target has flushed everything it needs
    up to there; what the router's log holds for it does not count."""
    answer = await ask_router(config, "GET", "/status", limit=30.0)
    if answer is None or answer[0] != 200:
        raise PgmeshError("the router did not say how far the donor is (GET /status)", node=donor)
    links = msgspec.json.decode(answer[1]).get("links", [])
    synced = {str(link["source"]): parse_lsn(str(link["synced_lsn"]))
              for link in links if link.get("target") == donor}
    return {source: synced.get(source, 0) for source, pin in pins.items()
            if source != donor and synced.get(source, 0) < pin}


async def _check_pins(members: dict[str, Conn], config: Config, name: str) -> None:
    """Before the new node becomes a member: no slot went past the join's pin (every router that streamed
    meanwhile read the pins: one of a pgmesh without them would not)."""
    for node, conn in members.items():
        row = await _one(conn, "SELECT format('%%s %%s', s.confirmed_flush_lsn, j.pin)"
                         " FROM pg_replication_slots s, pgmesh.joining j"
                         " WHERE s.slot_name = %s AND j.node = %s AND s.confirmed_flush_lsn > j.pin",
                         [config.slot_name, name])
        if row is not None:
            confirmed, pin = str(row).split()
            raise PgmeshError(
                f"the slot was confirmed to {confirmed}, past the join's pin {pin}: what the new node"
                " reads from there may be missing", node=node,
                hint="run the join again (every router of this cluster must be this version)",
            )


async def _join_attempts(
    config: Config,
    new: NodeConfig,
    donor: NodeConfig,
    others: list[NodeConfig],
    conns: dict[str, Conn],
    progress: Callable[[Any], None] | None,
    fail_copy: bool,
    waits: tuple[float, float],
) -> _Attempt:
    """`_copy_from_donor` until it succeeds, or fails in a way `retry_join` does not retry: an attempt
    that met a lock wait (it gave way to the application) is rolled back on the new node and started
    again with a new snapshot. Spark (its JVM) is kept between attempts."""
    from router.cluster.copy.rounds import end_copy_sessions
    from router.cluster.copy.spark import reuse_spark

    reuse = reuse_spark()
    reuse.__enter__()
    try:
        attempt = 0
        while True:
            attempt += 1
            try:
                found = await _copy_from_donor(
                    config, new, donor, others, conns, progress, fail_copy, waits
                )
            except PgmeshError as exc:
                if not retry_join(exc, attempt):
                    raise
                logger.warning("join %s, attempt %d: %s; starting again with a new snapshot",
                               new.name, attempt, exc)
                await end_copy_sessions(conns[new.name], _join_tag(config))
                for line in await _clean_new_node(conns[new.name], config, new.name):
                    logger.info("node %s: %s", new.name, line)
                await _mark(conns[new.name], donor.name)
                await asyncio.sleep(min(attempt, 5) * 0.5)  # the application's statement runs meanwhile
                continue
            return _Attempt(*found, attempts=attempt)
    finally:
        await asyncio.to_thread(reuse.__exit__, None, None, None)  # stops Spark (seconds): off the loop


async def _copy_from_donor(
    config: Config,
    new: NodeConfig,
    donor: NodeConfig,
    others: list[NodeConfig],
    conns: dict[str, Conn],
    progress: Callable[[Any], None] | None,
    fail_copy: bool,
    waits: tuple[float, float],
) -> tuple[dict[str, str], str, Any, Any]:
    """One attempt: snapshot, positions, then (router.cluster.copy.rounds) locks and plan, schema, rows
    (docs/join.md, "Locks")."""
    from router.cluster.copy.rounds import Rounds, copy_in_rounds
    from router.cluster.copy.schema import restore_post_data

    tag = _join_tag(config)
    lock_wait_s, slot_wait_s = waits
    members = {n.name: conns[n.name] for n in others}
    async with _quiet(config, members, donor.name, new.name):
        created, slot = await _join_slot(donor, tag, slot_wait_s, conns[donor.name])
        positions = await _positions(config, donor, others, conns[donor.name], created.consistent_point)
    if failpoints.ARMED:  # a test's: snapshot and positions taken, the copy not started (router.failpoints)
        await failpoints.hit("join.after_snapshot")
    snapshot = created.snapshot
    assert snapshot is not None
    with tempfile.TemporaryDirectory(prefix="pgmesh-join-") as tmp:
        try:
            await slot.close()  # the temporary slot goes; the holder keeps the snapshot
            tables = await replicated_tables(conns[donor.name], config)  # those in the snapshot are copied
            tables = [t for t in tables if reaches(new, f"{t[0]}.{t[1]}")]  # (a partial node's: its own)
            job = Rounds(config, donor, new, conns[new.name], snapshot.name, tables, tag, lock_wait_s,
                         Path(tmp))
            done = await copy_in_rounds(job, progress, fail_copy)
        finally:
            await snapshot.close()
            await slot.close()
        await restore_post_data(new, done.restore, Path(tmp))
    await _copy_sequences(conns[donor.name], conns[new.name])
    return positions, format_lsn(created.consistent_point), done, done.restore


async def _join_slot(
    donor: NodeConfig, tag: str, slot_wait_s: float, donor_conn: Conn
) -> tuple[SlotCreated, ReplicationSource]:
    """The temporary slot with its exported snapshot (held). Its creation waits for the transactions
    running on the donor to end, at most `slot_wait_s` (lock_timeout: the wait is on their xids)."""
    params = psycopg.conninfo.conninfo_to_dict(donor.dsn)
    options = f"{params.get('options') or ''} -c lock_timeout={round(slot_wait_s * 1000)}".strip()
    dsn = psycopg.conninfo.make_conninfo(donor.dsn, options=options)
    slot = ReplicationSource(donor.name, dsn, tag, [], options=SourceOptions(application_name=tag))
    try:
        return await slot.create_slot(export_snapshot=True, temporary=True), slot
    except PgmeshError as exc:  # SlotError, ConnectionLost (the replication connection's errors)
        await slot.close()
        if exc.sqlstate != "55P03":
            raise
        oldest = await _one(
            donor_conn,
            "SELECT format('session %%s (%%s), in a transaction for %%s s', pid, application_name,"
            " round(extract(epoch FROM now() - xact_start))) FROM pg_stat_activity"
            " WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid() ORDER BY xact_start LIMIT 1",
        )
        raise PgmeshError(
            f"the join's snapshot waited {slot_wait_s:g} s for transactions running on the donor to end"
            f" (the oldest: {oldest or 'gone'})", node=donor.name, sqlstate=exc.sqlstate,
            hint="a snapshot needs the transactions running when it is taken to end: commit or end the"
            " long transaction, then run join again",
        ) from None


def _join_tag(config: Config) -> str:
    """The prefix of every application_name the join's sessions on the donor carry (and its slot's name)."""
    return f"pgmesh_{config.cluster.name}_join"


async def _positions(
    config: Config, donor: NodeConfig, others: list[NodeConfig], donor_conn: Conn, consistent_point: int
) -> dict[str, str]:
    """Where the new node reads each source from: the donor from the snapshot's consistent point, every
    other node from the donor's origin progress for it (fixed: the router holds)."""
    positions = {donor.name: format_lsn(consistent_point)}
    for node in others:
        if node.name == donor.name:
            continue
        origin = config.origin_name(node.name)
        lsn = await _one(donor_conn, f"SELECT {position_sql('%s', '%s', False)}::text", [origin, node.name])
        positions[node.name] = str(lsn or "0/0")
    logger.info("join from %s: snapshot at %s; positions %s", donor.name, format_lsn(consistent_point),
                positions)
    return positions


async def _copy_sequences(donor: Conn, new: Conn) -> None:
    """Sequences are not rows: carry their positions over (pgmesh sequences convert re-spaces them)."""
    cur = await donor.execute(
        "SELECT format('%%I.%%I', schemaname, sequencename), last_value FROM pg_sequences"
        " WHERE schemaname <> ALL(%s) AND last_value IS NOT NULL",
        [list(_SKIP_SCHEMAS)],
    )
    for name, value in await cur.fetchall():
        with contextlib.suppress(psycopg.Error):
            await new.execute("SELECT setval(%s::regclass, %s, true)", [name, value])


def _progress_printer() -> Callable[[Any], None] | None:
    with contextlib.suppress(ImportError, AttributeError):
        from router.cluster.copy.progress import ProgressBar

        bar: Callable[[Any], None] = ProgressBar()
        return bar
    return None


async def cmd_join(config: Config, node: str, *, donor: str | None = None, force: bool = False) -> int:
    report = await join_node(config, node, donor=donor, force=force, progress=_progress_printer())
    mb = report.bytes / 1e6
    rate = mb / report.copy_seconds if report.copy_seconds else 0.0
    print(f"\nnode {report.node} joined from {report.donor} (snapshot at {report.snapshot_lsn}):"
          f" {report.tables} tables, {report.rows:,} rows, {mb:,.1f} MB copied in {report.copy_seconds:.1f} s"
          f" ({rate:,.1f} MB/s); {report.seconds:.1f} s in all")
    if report.attempts > 1:
        print(f"  {report.attempts} attempts: the join started again with a new snapshot (see the log)")
    if report.rounds > 1:
        print(f"  {report.rounds} rounds: the join gave way to the application's locks and copied again")
    if report.truncated:
        print(f"  not copied, truncated after the snapshot (the new node replays the TRUNCATE and what"
              f" follows): {', '.join(report.truncated)}")
    for source, lsn in sorted(report.positions.items()):
        print(f"  reads {source} from {lsn}")
    print(await _next_step(config, report.node))
    return 0


async def _next_step(config: Config, node: str, wait_s: float = 30.0) -> str:
    """What to do after the join: nothing when a router answers on the admin listener (released by the
    join, it starts again with the new node: its links are waited for, at most `wait_s`), else start
    one."""
    deadline = time.monotonic() + wait_s
    answered = False
    while True:
        answer = await ask_router(config, "GET", "/status", limit=10.0)
        if answer is None and not answered:
            break  # no router runs
        if answer is not None and answer[0] == 200:
            answered = True
            links = msgspec.json.decode(answer[1]).get("links", [])
            if any(node in (link.get("source"), link.get("target")) for link in links):
                return (f"the running router has taken node {node} in: its links catch up, then stream"
                        " (`pgmesh status`)")
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    if answered:
        return f"a router runs but shows no link of node {node} after {wait_s:g} s: see its log, status"
    return "start `pgmesh run` with this config: the new node's links show catching up, then streaming"


# ---------------------------------------------------------------------------------------------------------
# Part
