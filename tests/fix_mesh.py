"""The `mesh` pytest fixture: real nodes set up as one pgmesh cluster, the set-up integration tests share.

Owns: turning the fixture's arguments (how many nodes or their names, their PostgreSQL versions, the
schema, node settings, config options, spare nodes, whether to run init) into started nodes and a
`router.testing.mesh.Mesh`.
Must not: run a router (tests do, with `running_router`), or destroy nodes itself (`pg_nodes` does, at
teardown, whatever the test's outcome).
"""

from __future__ import annotations

import logging
import string
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence

import psycopg
import pytest

from router.testing.mesh import NODE_SETTINGS, Mesh, prepare_mesh
from tests.fix_cluster import NodeFactory

logger = logging.getLogger(__name__)

MeshFactory = Callable[..., Awaitable[Mesh]]


def node_names(nodes: int | Sequence[str]) -> list[str]:
    """Names a, b, c, ... for a count; the names themselves otherwise."""
    if isinstance(nodes, int):
        return list(string.ascii_lowercase[:nodes])
    return list(nodes)


def spare_versions(
    versions: Sequence[int | None] | None, members: int, spares: int
) -> list[int | None] | None:
    """Members' versions, then the spares' (given, or None each: the default)."""
    if versions is None:
        return None
    if len(versions) == members:
        return [*versions, *[None] * spares]
    if len(versions) != members + spares:
        pytest.fail(f"mesh: {len(versions)} versions for {members} nodes and {spares} spares")
    return list(versions)


# On PostgreSQL 16+, once nothing is applying: a link whose applied mark (router.progress.applied) is not
# where its
# origin is. Every set-up there sets both, so a difference means a path that set the origin up without the
# mark (a restart would then re-apply what lies between) or a rollback that moved the origin.
_MARKS_APART = """
SELECT l.source, l.applied::text, p.lsn::text
FROM pgmesh.links l JOIN pg_catalog.pg_replication_origin o ON o.roname = %s || l.source,
  LATERAL (SELECT coalesce(pg_catalog.pg_replication_origin_progress(o.roname, false), '0/0')) p(lsn)
WHERE pg_catalog.current_setting('server_version_num')::int >= 160000 AND l.applied IS NOT NULL
  AND l.applied <> p.lsn
"""


def marks_apart(meshes: Sequence[Mesh]) -> list[str]:
    """Each link of `meshes` whose applied mark is not its origin's progress (nodes down or without pgmesh
    are left out)."""
    out = []
    for made in meshes:
        prefix = made.config.origin_name("")
        for node in made.nodes:
            try:
                with psycopg.connect(node.dsn(), autocommit=True, connect_timeout=5) as conn:
                    rows = conn.execute(_MARKS_APART, [prefix]).fetchall()
            except psycopg.Error:
                continue
            out += [f"node {node.name}, source {s}: mark {m}, origin {o}" for s, m, o in rows]
    return out


@pytest.fixture
def mesh(pg_nodes: NodeFactory) -> Iterator[MeshFactory]:
    """Factory: `await mesh(nodes=2, schema="", ...)` -> a `Mesh` whose nodes hold `schema` and pgmesh.

    - `nodes`: how many (named a, b, c, ...) or their names, in config order;
    - `versions`: the PostgreSQL major version of each member (then of each spare, when given), e.g.
      `mesh(nodes=3, versions=[15, 18, 18])`; None for a node: $PGMESH_TEST_PG, else the default binaries.
      A version that is not installed skips the test with the reason;
    - `schema`: SQL run on every member before init;
    - `settings`: server settings for every node (default `NODE_SETTINGS`; `{}` for the defaults only),
      `password`: scram-sha-256 for `postgres`;
    - `spares`: names of nodes started with the same settings but left empty, outside the config;
    - `cluster`, `replication`, `extra`, `admin_port`: the config (`router.testing.mesh.config_text`);
    - `init`: false to stop before `pgmesh init` (the test runs it, and asserts on what it says).
    """

    async def make(
        nodes: int | Sequence[str] = 2,
        schema: str = "",
        *,
        versions: Sequence[int | None] | None = None,
        settings: Mapping[str, str] = NODE_SETTINGS,
        password: str | None = None,
        spares: Sequence[str] = (),
        cluster: str = "t",
        replication: str = "",
        extra: str = "",
        admin_port: int = 0,
        init: bool = True,
    ) -> Mesh:
        names = node_names(nodes)
        every = spare_versions(versions, len(names), len(spares))
        started = pg_nodes(names=[*names, *spares], settings=settings, password=password, versions=every)
        members, spare = started[: len(names)], started[len(names) :]
        logger.info("mesh %s over %s (spares: %s)", cluster, ", ".join(names), ", ".join(spares) or "none")
        made = await prepare_mesh(
            members, schema, spares=spare, cluster=cluster, replication=replication, admin_port=admin_port,
            extra=extra, init=init,
        )
        meshes.append(made)
        return made

    meshes: list[Mesh] = []
    yield make
    apart = marks_apart(meshes)
    if apart:
        pytest.fail("applied marks apart from their origins: " + "; ".join(apart))
