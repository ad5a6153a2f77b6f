"""What a user does, for the real-use tests: psql with the statement string as typed, pgbench, the `pgmesh`
command line as a process, a router as a process, and the final check that every table (keyless ones as
multisets) and every schema is the same on every node.

Owns: running those programs against test nodes and comparing whole nodes.
Must not: start or destroy servers (the `mesh` fixture does), or sleep for a fixed time.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

from router.testing.compare import fingerprints
from router.testing.mesh import Mesh, wait_for
from router.testing.routers import Routers

__all__ = [
    "RouterProcess",
    "node_summary",
    "pgbench",
    "pgmesh",
    "psql",
    "user_tables",
    "wait_identical",
]

# Every table of the user's schemas (not pgmesh's, not the catalogs), as schema.table.
_TABLES = """
SELECT n.nspname || '.' || c.relname FROM pg_catalog.pg_class c
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind = 'r' AND n.nspname NOT IN ('pgmesh', 'pg_catalog', 'information_schema')
  AND n.nspname NOT LIKE 'pg\\_%' ORDER BY 1
"""

# What makes answers differ besides rows: columns (type, default, identity, generated expression,
# not null), enum labels in sort order, domains and their checks, constraints, indexes.
_SCHEMA = """
SELECT 'column', n.nspname || '.' || c.relname || '.' || a.attname,
       pg_catalog.format_type(a.atttypid, a.atttypmod) || ' ' || a.attnotnull::text || ' '
       || a.attidentity::text || ' ' || a.attgenerated::text || ' '
       || coalesce(pg_catalog.pg_get_expr(d.adbin, d.adrelid), '')
FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_class c ON c.oid = a.attrelid
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE c.relkind IN ('r', 'p') AND a.attnum > 0 AND NOT a.attisdropped
  AND n.nspname NOT IN ('pgmesh', 'pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg\\_%'
UNION ALL
SELECT 'enum', n.nspname || '.' || t.typname,
       pg_catalog.string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder)
FROM pg_catalog.pg_enum e JOIN pg_catalog.pg_type t ON t.oid = e.enumtypid
JOIN pg_catalog.pg_namespace n ON n.oid = t.typnamespace GROUP BY 1, 2
UNION ALL
SELECT 'domain', n.nspname || '.' || t.typname,
       pg_catalog.format_type(t.typbasetype, t.typtypmod) || ' ' || coalesce(
         (SELECT pg_catalog.string_agg(pg_catalog.pg_get_constraintdef(k.oid), ',' ORDER BY k.conname)
            FROM pg_catalog.pg_constraint k WHERE k.contypid = t.oid), '')
FROM pg_catalog.pg_type t JOIN pg_catalog.pg_namespace n ON n.oid = t.typnamespace
WHERE t.typtype = 'd' AND n.nspname NOT IN ('pgmesh', 'pg_catalog', 'information_schema')
UNION ALL
SELECT 'constraint', n.nspname || '.' || c.relname || '.' || k.conname, pg_catalog.pg_get_constraintdef(k.oid)
FROM pg_catalog.pg_constraint k JOIN pg_catalog.pg_class c ON c.oid = k.conrelid
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname NOT IN ('pgmesh', 'pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg\\_%'
  AND k.contype <> 'n'  -- 18 lists NOT NULL here too; the column facts compare it on every version
UNION ALL
SELECT 'index', i.schemaname || '.' || i.indexname, i.indexdef FROM pg_catalog.pg_indexes i
WHERE i.schemaname NOT IN ('pgmesh', 'pg_catalog', 'information_schema') AND i.schemaname NOT LIKE 'pg\\_%'
ORDER BY 1, 2
"""


def _psql_bin(node: Any) -> str:
    bindir = getattr(node, "bindir", None)
    if bindir is not None and (Path(bindir) / "psql").exists():
        return str(Path(bindir) / "psql")
    return "psql"


def _tool(node: Any, name: str) -> str:
    bindir = getattr(node, "bindir", None)
    for candidate in ([Path(bindir) / name] if bindir is not None else []) + [
        Path("/usr/lib/postgresql/15/bin") / name
    ]:
        if candidate.exists():
            return str(candidate)
    return name


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["PGCONNECT_TIMEOUT"] = "10"
    return env


def psql(
    node: Any, text: str, *more: str, check: bool = True, user: str = "postgres"
) -> subprocess.CompletedProcess[str]:
    """`psql -c TEXT` as a user types it: the whole string is one query string (one implicit
    transaction), the way psql, most drivers and migration tools send it; each of `more` is one more
    `-c`, sent on its own in the same session. `check`: fail the test with psql's output when it exits
    non-zero."""
    commands = [arg for one in (text, *more) for arg in ("-c", one)]
    argv = [_psql_bin(node), "-X", "-v", "ON_ERROR_STOP=1", "-d", node.dsn(user=user), *commands]
    done = subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=300)
    if check and done.returncode != 0:
        raise AssertionError(f"psql on {node.name} failed ({done.returncode}): {done.stderr.strip()}\n{text}")
    return done


def pgbench(node: Any, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """pgbench against a node (its own version's, else Debian's)."""
    argv = [_tool(node, "pgbench"), *args, node.dsn()]
    done = subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=900)
    if check and done.returncode != 0:
        raise AssertionError(f"pgbench on {node.name} failed ({done.returncode}): {done.stderr.strip()}")
    return done


async def pgbench_async(node: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(pgbench, node, *args)


def pgmesh(
    config: Path, *args: str, check: bool = False, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """The `pgmesh` command line as a process: `pgmesh ARGS --config CONFIG` (the subcommand first)."""
    argv = [sys.executable, "-m", "router", *args[:1], "--config", str(config), *args[1:]]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(
            f"pgmesh {' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done


class RouterProcess:
    """`pgmesh run` as a process over a mesh's nodes, with its admin port; `stop` ends it (SIGTERM)."""

    def __init__(self, tmp: Path, made: Mesh) -> None:
        self.routers = Routers(tmp, ha="")
        self.routers.cluster = made.config.cluster.name
        self.made = made

    def start(self, nodes: Sequence[Any] | None = None) -> None:
        self.routers.start("r", list(nodes or self.made.nodes))

    @property
    def port(self) -> int:
        return self.routers.ports["r"]

    async def stop(self) -> None:
        await self.routers.stop()

    def output(self) -> str:
        return self.routers.output()


async def user_tables(dsn: str) -> list[str]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        return [str(r[0]) for r in await (await conn.execute(_TABLES)).fetchall()]


async def node_summary(dsn: str) -> tuple[dict[str, tuple[int, str]], list[tuple[Any, ...]]]:
    """Every user table's fingerprint (count and hash of its sorted whole rows: keyless tables as
    multisets) and the schema facts that make answers differ."""
    tables = await user_tables(dsn)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        schema = await (await conn.execute(_SCHEMA)).fetchall()
    return await fingerprints(dsn, tables), schema


async def differences(nodes: Sequence[Any]) -> list[str]:
    """What differs between the first node and each other one: tables (by name), schema facts."""
    summaries = [await node_summary(n.dsn()) for n in nodes]
    out = []
    first_rows, first_schema = summaries[0]
    for node, (rows, schema) in zip(nodes[1:], summaries[1:], strict=True):
        for table in sorted(set(first_rows) | set(rows)):
            if first_rows.get(table) != rows.get(table):
                mine, theirs = first_rows.get(table), rows.get(table)
                out.append(f"{table}: {nodes[0].name} {mine} vs {node.name} {theirs}")
        apart = set(first_schema) ^ set(schema)
        out += [f"schema {nodes[0].name} vs {node.name}: {fact}" for fact in sorted(apart, key=str)[:20]]
    return out


async def wait_identical(nodes: Sequence[Any], limit: float = 120.0) -> None:
    """Wait until every node holds the same tables, rows and schema; on timeout, say what differs."""
    try:
        await wait_for(lambda: _none(nodes), "every table and schema identical on every node", limit)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n" + "\n".join(await differences(nodes))) from None


async def _none(nodes: Sequence[Any]) -> bool:
    return not await differences(nodes)


