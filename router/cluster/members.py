"""The cluster's members: which nodes of the config are parted (`pgmesh.parted`, written by `pgmesh part`,
cleared by `pgmesh join`), and the config without them, as the router, the operator commands and `pgmesh
init` see it.

Must not: drop or change anything on a node but the part record (that is `router.ops.part`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any, Final

import msgspec
import psycopg
from psycopg import sql

from router.config.model import PGMESH_SCHEMA, Config, NodeConfig
from router.errors import PgmeshError
from router.nodes.connect import connect, one

__all__ = ["PARTED_DDL", "members_of", "members_only", "read_parted", "unmark_parted", "without_parted"]

logger = logging.getLogger(__name__)

PARTED_DDL: Final = sql.SQL(
    "CREATE TABLE IF NOT EXISTS {}.parted (node text PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())"
).format(sql.Identifier(PGMESH_SCHEMA))
_PARTED_SQL: Final = (
    "SELECT node FROM pgmesh.parted WHERE pg_catalog.to_regclass('pgmesh.parted') IS NOT NULL"
)


async def read_parted(config: Config, wait_s: int = 5) -> set[str]:
    """The nodes of `config` recorded as parted on any node that answers within `wait_s` (a node down
    says nothing)."""
    async def ask(node: NodeConfig) -> set[str]:
        try:
            async with asyncio.timeout(wait_s):
                conn = await connect(node, purpose="pgmesh part", wait_s=wait_s, admin=True)
                async with conn:
                    cur = await conn.execute(_PARTED_SQL)
                    return {str(r[0]) for r in await cur.fetchall()}
        except (PgmeshError, psycopg.Error, TimeoutError, OSError):
            return set()

    parted: set[str] = set().union(*await asyncio.gather(*(ask(n) for n in config.nodes)))
    return parted & set(config.node_names)


async def members_of(config: Config) -> Config:
    """`config` without the nodes recorded as parted (what compare, repair, ddl, sequences and the offline
    status work on: a parted node the config still lists is no longer compared, waited for or changed)."""
    parted = await read_parted(config)
    return without_parted(config, parted) if parted else config


def without_parted(config: Config, parted: Iterable[str]) -> Config:
    """`config` without the nodes in `parted`."""
    gone = set(parted)
    return msgspec.structs.replace(config, nodes=[n for n in config.nodes if n.name not in gone])


async def members_only(config: Config, targets: dict[str, Any], joining: Iterable[str] = ()) -> Config:
    """The router's config without the parted nodes (at its start, and after a hold: a part just ran) and
    the `joining` ones (router.cluster.joining); their entries in `targets` (name -> something with
    `async close()`) are closed and removed."""
    parted = await read_parted(config)
    if parted:
        logger.info("nodes parted, left out: %s (`pgmesh join` brings one back)", ", ".join(sorted(parted)))
    parted |= set(joining) & set(config.node_names)
    if not parted:
        return config
    for name in parted:
        target = targets.pop(name, None)
        if target is not None:
            await target.close()
    return without_parted(config, parted)


async def unmark_parted(config: Config, name: str) -> None:
    """`pgmesh join NAME`: NAME is a member again on every node that answers."""
    for node in config.nodes:
        try:
            async with await connect(node, purpose="pgmesh part", admin=True) as conn:
                if await one(conn, "SELECT pg_catalog.to_regclass('pgmesh.parted')") is not None:
                    await conn.execute("DELETE FROM pgmesh.parted WHERE node = %s", [name])
        except (PgmeshError, psycopg.Error):
            continue
