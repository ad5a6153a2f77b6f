"""The schema part of a join's initial sync: the donor's schema at the exported snapshot (`pg_dump
--schema-only --snapshot`), restored on the new node in two parts, pre-data before the row copy and
post-data (indexes, constraints, triggers) after it; and running the PostgreSQL client programs.

Owns: finding pg_dump / pg_restore, their environment (the connection as PG* variables, so no password
shows on a command line), the TOC entries left out (pgmesh's event and tombstone triggers: `pgmesh init`
installs them fresh), and turning a failed run into a `PgmeshError` (SQL state 55P03 when its
lock_timeout ran out: the join starts again).

Must not: put a DSN or a password on a command line or in a message, or wait for a lock on the donor
without the lock_timeout it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Final

import psycopg.conninfo

from router.cluster import pgbin
from router.config import PGMESH_SCHEMA, NodeConfig
from router.errors import PgmeshError

__all__ = ["dump_and_restore_pre_data", "restore_post_data", "run_tool"]

_ENV_KEYS: Final = {
    "host": "PGHOST", "hostaddr": "PGHOSTADDR", "port": "PGPORT", "user": "PGUSER", "password": "PGPASSWORD",
    "dbname": "PGDATABASE", "sslmode": "PGSSLMODE", "sslrootcert": "PGSSLROOTCERT", "sslcert": "PGSSLCERT",
    "sslkey": "PGSSLKEY", "passfile": "PGPASSFILE", "connect_timeout": "PGCONNECT_TIMEOUT",
}
# TOC entries of the donor's dump that pgmesh installs itself on the new node.
_SKIP_TOC: Final = re.compile(r" (EVENT TRIGGER|TRIGGER \S+ \S+ pgmesh_tombstone) ")


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


async def dump_and_restore_pre_data(
    new: NodeConfig, donor: NodeConfig, snapshot: str, tmp: Path, tag: str, lock_wait_s: float
) -> list[str]:
    """Dump the schema at the snapshot (its locks wait at most `lock_wait_s`), restore its pre-data part
    on the new node; the pg_restore command for the post-data part (`restore_post_data`)."""
    dump, listing = str(tmp / "schema.dump"), str(tmp / "schema.list")
    await run_tool(
        [_tool("pg_dump"), "--format=custom", "--schema-only", "--no-publications",
         "--no-subscriptions", f"--exclude-schema={PGMESH_SCHEMA}", f"--snapshot={snapshot}",
         f"--file={dump}"],
        donor.dsn, "pg_dump of the schema", donor.name,
        extra_env={"PGAPPNAME": f"{tag}-dump", "PGOPTIONS": f"-c lock_timeout={round(lock_wait_s * 1000)}"},
    )
    toc = await run_tool([_tool("pg_restore"), "--list", dump], donor.dsn, "pg_restore --list", donor.name)
    kept = "\n".join(line for line in toc.splitlines() if not _SKIP_TOC.search(line))
    await asyncio.to_thread(Path(listing).write_text, kept)
    restore = [
        _tool("pg_restore"), "--exit-on-error", "--single-transaction", f"--use-list={listing}",
        f"--dbname={_dbname(new.dsn)}",  # the rest of the connection comes through PG* variables
    ]
    await run_tool([*restore, "--section=pre-data", dump], new.dsn, "restoring the schema", new.name)
    return restore


async def restore_post_data(new: NodeConfig, restore: list[str], tmp: Path) -> None:
    """Indexes, constraints and triggers on the new node, once its rows are in."""
    await run_tool([*restore, "--section=post-data", str(tmp / "schema.dump")], new.dsn, "restoring indexes",
                   new.name)
