"""`pgmesh init`'s part in synchronous replication (docs/synchronous.md): each node's
`synchronous_standby_names`.

A node with `synchronous` = k > 0 names the router's replication connection (its application_name,
`Config.standby_name`) as its synchronous standby: a commit there then waits for the router's feedback,
which the router gives once k targets applied it (router.service.synchronous). `standby_names` sets it
with ALTER SYSTEM and reloads the configuration; a node back at k = 0 whose setting is exactly pgmesh's
gets it RESET (asynchronous again). A setting the DBA manages (anything else) is never overwritten: the
line says whether it names the router and what to add.

Must not: install anything else, or wait for a commit on a node (its connection commits locally).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Final

import psycopg
from psycopg import sql

from router.cluster.checks import connect
from router.config.model import Config, NodeConfig
from router.errors import PgmeshError, describe

__all__ = ["names_router", "standby_names"]

_SHOW: Final = "SELECT pg_catalog.current_setting('synchronous_standby_names')"
_RELOAD: Final = "SELECT pg_catalog.pg_reload_conf()"


def names_router(setting: str, name: str) -> bool:
    """Whether a synchronous_standby_names value names `name` (or `*`): a best-effort reading of
    `[FIRST | ANY] n (a, b)` and `a, b` lists, quoted names included."""
    inner = setting.partition("(")[2].rpartition(")")[0] if "(" in setting else setting
    names = {part.strip().strip('"') for part in inner.split(",")}
    return name in names or "*" in names


async def _one(config: Config, node: NodeConfig) -> str:
    k, name = config.synchronous(node.name), config.standby_name
    conn: psycopg.AsyncConnection[Any] = await connect(node)
    async with conn:
        current = str((await (await conn.execute(_SHOW)).fetchone() or ("",))[0]).strip()
        if k == 0:
            if current != name:
                return ""
            await conn.execute("ALTER SYSTEM RESET synchronous_standby_names")
            await conn.execute(_RELOAD)
            return f"node {node.name}: synchronous = 0: synchronous_standby_names reset (asynchronous)"
        if current == name:
            return f"node {node.name}: synchronous = {k}: synchronous_standby_names is {name}"
        if current:
            if names_router(current, name):
                return (f"node {node.name}: synchronous = {k}: synchronous_standby_names ({current}) is yours"
                        f" and names {name}; left as it is")
            raise PgmeshError(
                f"synchronous = {k}, but synchronous_standby_names is {current!r} (set by you) and does not"
                f" name the router ({name}): commits would not wait for it", node=node.name,
                hint=f"name {name} in it (e.g. FIRST 2 ({name}, your_standby)), or empty it and run"
                " `pgmesh init` again; docs/synchronous.md",
            )
        alter = sql.SQL("ALTER SYSTEM SET synchronous_standby_names = {}").format(sql.Literal(name))
        await conn.execute(alter)
        await conn.execute(_RELOAD)
        return (f"node {node.name}: synchronous = {k}: synchronous_standby_names set to {name} (a commit"
                f" there returns once {k} other node(s) applied it)")


async def standby_names(config: Config, *, waiting: bool, only: Sequence[str] | None = None) -> list[str]:
    """Set (`waiting`: the nodes with k > 0) or reset (else: those with k = 0) each node's (or only those
    named) synchronous_standby_names; one line per change. `pgmesh init` resets before it installs (its
    writes must not wait for a router that may not run) and sets last; `pgmesh join` sets the new node's
    last. A failure names the node and what to run by hand."""
    nodes = [n for n in config.nodes if bool(config.synchronous(n.name)) is waiting
             and (only is None or n.name in only)]
    results = await asyncio.gather(*(_one(config, n) for n in nodes), return_exceptions=True)
    lines: list[str] = []
    for node, result in zip(nodes, results, strict=True):
        if isinstance(result, PgmeshError):
            raise result
        if isinstance(result, psycopg.Error | OSError):
            k = config.synchronous(node.name)
            what = (f"ALTER SYSTEM SET synchronous_standby_names = '{config.standby_name}'" if k
                    else "ALTER SYSTEM RESET synchronous_standby_names")
            raise PgmeshError(f"cannot set synchronous_standby_names: {describe(result)}", node=node.name,
                              hint=f"as a superuser there: {what}; SELECT pg_reload_conf()") from result
        if isinstance(result, BaseException):
            raise result
        if result:
            lines.append(result)
    return lines
