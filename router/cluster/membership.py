"""Node join and part: a new node gets one snapshot of a donor plus exactly what the donor lacked.

`pgmesh join NODE [--from DONOR]` (the node already listed in config.toml, its database empty):

1. Every node must answer, and the router must be stopped: writes go on everywhere, only replication
   waits. With no applier running, what the donor has applied from each other node X stays fixed at
   its origin's progress P_X, and X's slot is confirmed no further than P_X (the router confirms a
   slot only to what every target flushed), so X still has everything after P_X.
2. A temporary slot on the donor exports a snapshot S with its consistent point L: S holds exactly
   the donor's own transactions that committed before L, and every X's transaction up to P_X. A
   holder transaction keeps S importable and takes ACCESS SHARE locks on the copied tables, so DDL
   on the donor that would rewrite them waits until the copy is done.
3. The schema at S (`pg_dump --schema-only --snapshot`) is restored in two parts: pre-data before the
   copy; indexes, constraints and triggers (post-data) after it. pgmesh's own schema, its event and
   tombstone triggers and publications are left out: `pgmesh init` installs them fresh.
4. The rows are copied by the PySpark batch of `router.cluster.sync.copy`: tasks that each import S and
   stream one ctid range of one table from `COPY ... TO STDOUT (FORMAT binary)` into `COPY ... FROM
   STDIN (FORMAT binary)` on the new node.
5. `pgmesh init` with the new config installs pgmesh on the new node (its slot is created now, after
   the copy, so the copied rows are never sent anywhere) and its origin on the others. The new node's
   origin for the donor is then advanced to L, and its origin for every other X to P_X: when the
   router starts, each source is read from the lowest position any link needs, and the new node gets
   the donor's transactions after L and X's after P_X: each exactly once (docs/join.md).

A join that stops midway leaves a marker (schema `pgmesh_join` on the new node): the next join
cleans the new node first, without `--force`.

`pgmesh part NODE [--clean]` drops what the others keep for the node (its replication origin and link
row), and the node's own slot so that it holds no WAL; `--clean` removes all of pgmesh from it. Its
node id is free once it leaves the config.

Must not: run while the router streams; put a DSN or password on a command line or in a message
(the PostgreSQL tools get them through PG* environment variables).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
import psycopg
import psycopg.conninfo
from psycopg import sql

from protocol.lsn import format_lsn
from router.cluster import pgbin
from router.cluster.checks import check_cluster, replicated_tables
from router.cluster.install import install, uninstall
from router.config import PGMESH_SCHEMA, Config, NodeConfig
from router.errors import ConfigError, PgmeshError, describe
from router.service.admin import ask_router
from router.stream.items import SourceOptions
from router.stream.source import ReplicationSource

__all__ = ["JoinReport", "cmd_join", "cmd_part", "join_node", "part_node"]

logger = logging.getLogger(__name__)

Conn = psycopg.AsyncConnection[Any]

MARKER_SCHEMA: Final = "pgmesh_join"
_SKIP_SCHEMAS: Final = ("pg_catalog", "information_schema", "pg_toast", PGMESH_SCHEMA, MARKER_SCHEMA)
_ENV_KEYS: Final = {
    "host": "PGHOST", "hostaddr": "PGHOSTADDR", "port": "PGPORT", "user": "PGUSER", "password": "PGPASSWORD",
    "dbname": "PGDATABASE", "sslmode": "PGSSLMODE", "sslrootcert": "PGSSLROOTCERT", "sslcert": "PGSSLCERT",
    "sslkey": "PGSSLKEY", "passfile": "PGPASSFILE", "connect_timeout": "PGCONNECT_TIMEOUT",
}
# TOC entries of the donor's dump that pgmesh installs itself on the new node.
_SKIP_TOC: Final = re.compile(r" (EVENT TRIGGER|TRIGGER \S+ \S+ pgmesh_tombstone) ")


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


# ---------------------------------------------------------------------------------------------------------
# Small pieces


async def _connect(node: NodeConfig, purpose: str = "pgmesh join") -> Conn:
    try:
        return await psycopg.AsyncConnection.connect(
            node.dsn, autocommit=True, connect_timeout=10, application_name=purpose
        )
    except psycopg.Error as exc:
        raise PgmeshError(f"cannot connect: {describe(exc)}", node=node.name, sqlstate=exc.sqlstate) from None


async def _one(conn: Conn, query: str | sql.Composable, params: Sequence[Any] | None = None) -> Any:
    cur = await conn.execute(query, params)  # type: ignore[arg-type]
    row = await cur.fetchone()
    return None if row is None else row[0]


def _tool(name: str) -> str:
    """A PostgreSQL client program: PGMESH_PG_BIN, the server's bindir, then PATH."""
    candidates = [os.environ.get("PGMESH_PG_BIN", "")]
    with contextlib.suppress(Exception):
        candidates.append(str(pgbin.find_pg_bindir()))
    for directory in candidates:
        if directory and os.access(Path(directory) / name, os.X_OK):
            return str(Path(directory) / name)
    found = shutil.which(name)
    if found is None:
        raise PgmeshError(f"{name} not found", hint="install postgresql-client-15 or set PGMESH_PG_BIN")
    return found


def _env(dsn: str) -> dict[str, str]:
    """The connection as PG* environment variables, so that no password shows on a command line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    for key, value in psycopg.conninfo.conninfo_to_dict(dsn).items():
        if key in _ENV_KEYS and value is not None:
            env[_ENV_KEYS[key]] = str(value)
    return env


def _dbname(dsn: str) -> str:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    return str(params.get("dbname") or params.get("user") or "postgres")


async def _run_tool(args: list[str], dsn: str, what: str, node: str) -> str:
    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, env=_env(dsn), capture_output=True, text=True, check=False)

    done = await asyncio.to_thread(run)
    if done.returncode != 0:
        detail = " ".join(done.stderr.strip().splitlines()[-3:])
        raise PgmeshError(f"{what} failed: {detail}", node=node)
    return done.stdout


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
) -> JoinReport:
    """Copy `donor` (default: the first other node) to the new node `name` and set its positions.

    `fail_copy` (tests only) makes the copy fail after the schema is in place, as a killed job would.
    """
    started = time.monotonic()
    new = config.node(name)
    others = [n for n in config.nodes if n.name != name]
    source_node = config.node(donor) if donor else others[0]
    if source_node.name == name:
        raise ConfigError("a node cannot be its own donor")
    conns: dict[str, Conn] = {}
    unreachable: list[str] = []
    held = False
    for node in config.nodes:
        try:
            conns[node.name] = await _connect(node)
        except PgmeshError as exc:
            unreachable.append(f"{node.name} ({exc.message})")
    try:
        if unreachable:
            raise PgmeshError(
                f"every node must be reachable during a join; cannot reach {', '.join(unreachable)}",
                hint="start the node (or fix its dsn), then run join again",
            )
        members = {n.name: conns[n.name] for n in others}
        busy = await _router_streaming(members, config)
        if busy:
            held = await _hold_router(config, members, busy)
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
        await target.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(MARKER_SCHEMA)))
        await target.execute(sql.SQL(
            "CREATE TABLE IF NOT EXISTS {}.state (donor text, started timestamptz DEFAULT now())"
        ).format(sql.Identifier(MARKER_SCHEMA)))
        await target.execute(
            sql.SQL("INSERT INTO {}.state (donor) VALUES (%s)").format(sql.Identifier(MARKER_SCHEMA)),
            [source_node.name],
        )
        report = await _copy_from_donor(config, new, source_node, others, conns, progress, fail_copy)
        lines = await _install_with_drift(config)
        for line in lines:
            logger.info("%s", line)
        for source, lsn in report[0].items():
            await target.execute(
                "SELECT pg_replication_origin_advance(%s, %s::pg_lsn)", [config.origin_name(source), lsn]
            )
        await target.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(MARKER_SCHEMA)))
    finally:
        for conn in conns.values():
            await conn.close()
        if held:  # the router re-reads the config and streams to and from the new node
            await ask_router(config, "POST", "/release")
    positions, snapshot_lsn, copied = report
    return JoinReport(
        node=name, donor=source_node.name, snapshot_lsn=snapshot_lsn, positions=positions,
        tables=len(copied.tables), rows=copied.rows, bytes=copied.bytes, copy_seconds=copied.seconds,
        seconds=time.monotonic() - started,
    )


async def _install_with_drift(config: Config) -> list[str]:
    """`pgmesh init` for the grown cluster. Columns may differ between nodes while DDL issued during
    the join is still on its way (the router applies it in order once it runs): that is reported,
    not refused. Any other problem is."""
    report = await check_cluster(config)
    drift = [c for c in report.problems if c.check == "table" and c.detail.startswith("column ")]
    if len(drift) < len(report.problems):
        raise ConfigError("the joined cluster is not ready\n" + report.render())
    for check in drift:
        logger.warning("node %s, table %s: %s (DDL in flight; the router applies it in order)",
                       check.node, check.relation, check.detail)
    checks = [msgspec.structs.replace(c, ok=True) if c in drift else c for c in report.checks]
    return await install(config, msgspec.structs.replace(report, checks=checks))


async def _copy_from_donor(
    config: Config,
    new: NodeConfig,
    donor: NodeConfig,
    others: list[NodeConfig],
    conns: dict[str, Conn],
    progress: Callable[[Any], None] | None,
    fail_copy: bool,
) -> tuple[dict[str, str], str, Any]:
    from router.cluster.sync.copy import CopyTable, copy_snapshot

    donor_conn = conns[donor.name]
    tables = await replicated_tables(donor_conn, config)
    copy_tables = []
    for schema, table in tables:
        cur = await donor_conn.execute(
            "SELECT array_agg(attname::text ORDER BY attnum) FROM pg_attribute"
            " WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped AND attgenerated = ''",
            [sql.Identifier(schema, table).as_string(donor_conn)],
        )
        row = await cur.fetchone()
        copy_tables.append(CopyTable(schema=schema, name=table, columns=tuple(row[0] if row else ())))
    options = SourceOptions(application_name=f"pgmesh_{config.cluster.name}_join")
    slot = ReplicationSource(donor.name, donor.dsn, f"pgmesh_{config.cluster.name}_join", [], options=options)
    created = await slot.create_slot(export_snapshot=True, temporary=True)
    snapshot = created.snapshot
    assert snapshot is not None
    try:
        await slot.close()  # the temporary slot goes; the holder keeps the snapshot
        await snapshot.lock(tables)  # DDL on the donor that would rewrite them waits for the copy
        positions = {donor.name: format_lsn(created.consistent_point)}
        for node in others:
            if node.name == donor.name:
                continue
            origin = config.origin_name(node.name)
            lsn = await _one(donor_conn, "SELECT pg_replication_origin_progress(%s, false)::text", [origin])
            positions[node.name] = str(lsn or "0/0")
        logger.info("join %s from %s: snapshot at %s; positions %s", new.name, donor.name,
                    format_lsn(created.consistent_point), positions)
        with tempfile.TemporaryDirectory(prefix="pgmesh-join-") as tmp:
            dump = str(Path(tmp) / "schema.dump")
            listing = str(Path(tmp) / "schema.list")
            await _run_tool(
                [_tool("pg_dump"), "--format=custom", "--schema-only", "--no-publications",
                 "--no-subscriptions", f"--exclude-schema={PGMESH_SCHEMA}", f"--snapshot={snapshot.name}",
                 f"--file={dump}"],
                donor.dsn, "pg_dump of the schema", donor.name,
            )
            toc = await _run_tool(
                [_tool("pg_restore"), "--list", dump], donor.dsn, "pg_restore --list", donor.name
            )
            kept = "\n".join(line for line in toc.splitlines() if not _SKIP_TOC.search(line))
            await asyncio.to_thread(Path(listing).write_text, kept)
            restore = [
                _tool("pg_restore"), "--exit-on-error", "--single-transaction", f"--use-list={listing}",
                f"--dbname={_dbname(new.dsn)}",  # the rest of the connection comes through PG* variables
            ]
            await _run_tool([*restore, "--section=pre-data", dump], new.dsn, "restoring the schema", new.name)
            if fail_copy:
                raise PgmeshError("the copy was stopped (test hook)", node=new.name)
            copied = await asyncio.to_thread(
                copy_snapshot, donor.dsn, new.dsn, snapshot.name, copy_tables,
                spark_master=config.sync.spark_master, partitions_per_table=config.sync.partitions_per_table,
                spark_conf=config.sync.spark_conf, progress=progress,
            )
            await _run_tool([*restore, "--section=post-data", dump], new.dsn, "restoring indexes", new.name)
        await _copy_sequences(donor_conn, conns[new.name])
    finally:
        await snapshot.close()
        await slot.close()
    return positions, format_lsn(created.consistent_point), copied


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
        from router.cluster.sync.progress import ProgressBar

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
    for source, lsn in sorted(report.positions.items()):
        print(f"  reads {source} from {lsn}")
    print("start `pgmesh run` with this config: the new node's links show catching up, then streaming")
    return 0


# ---------------------------------------------------------------------------------------------------------
# Part


async def part_node(config: Config, name: str, *, clean: bool = False) -> list[str]:
    """The cluster forgets `name`: its origin and link row on every other node, its slot (no WAL held)."""
    config.node(name)
    conns: dict[str, Conn] = {}
    lines: list[str] = []
    unreachable: list[str] = []
    for node in config.nodes:
        try:
            conns[node.name] = await _connect(node, "pgmesh part")
        except PgmeshError as exc:
            if node.name != name:
                unreachable.append(f"{node.name} ({exc.message})")
    try:
        if unreachable:
            raise PgmeshError(
                f"every other node must be reachable to part a node; cannot reach {', '.join(unreachable)}",
                hint="start them, then run part again (nothing was changed)",
            )
        busy = await _router_streaming(conns, config)
        if busy:
            raise PgmeshError(
                f"the router is streaming from {', '.join(busy)}",
                hint="stop `pgmesh run` first, part the node, remove it from the config, start `pgmesh run`",
            )
        for other, conn in conns.items():
            if other == name:
                continue
            for origin in (config.origin_name(name), config.early_origin_name(name)):
                found = await _one(conn, "SELECT roident FROM pg_replication_origin WHERE roname = %s",
                                   [origin])
                if found is not None:
                    await conn.execute("SELECT pg_replication_origin_drop(%s)", [origin])
                    lines.append(f"node {other}: dropped replication origin {origin}")
            if await _one(conn, "SELECT to_regclass('pgmesh.links')") is not None:
                await conn.execute("DELETE FROM pgmesh.links WHERE source = %s", [name])
        if name in conns:
            if clean:
                lines += await uninstall(config, name)
            else:
                conn = conns[name]
                if await _one(conn, "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s",
                              [config.slot_name]) is not None:
                    await conn.execute("SELECT pg_drop_replication_slot(%s)", [config.slot_name])
                    lines.append(f"node {name}: dropped slot {config.slot_name} (it holds no WAL any more)")
        else:
            lines.append(f"node {name} is not reachable: its slot stays until you drop it there")
    finally:
        for conn in conns.values():
            await conn.close()
    return lines


async def cmd_part(config: Config, node: str, *, clean: bool = False) -> int:
    for line in await part_node(config, node, clean=clean):
        print(line)
    print(f"remove node {node} from the config, then start `pgmesh run`; its database stays usable on its own"
          + ("" if clean else f" (`pgmesh part {node} --clean` removes pgmesh's objects from it)"))
    return 0

