"""pytest fixtures that hand integration tests real PostgreSQL nodes (15 by default; any major per node).

Owns: choosing the backend (local throw-away clusters from `router.testing.localnodes`, or Docker containers
via testcontainers), the PostgreSQL major version of each node (asked per node, `pg_nodes(versions=[15,
18])`, else $PGMESH_TEST_PG, else the default binaries), the `pg_backend` and `pg_nodes` fixtures, and
destroying every node a test created, even when the test failed.

Must not: skip silently when no backend exists or $PGMESH_TEST_PG names a version that is not installed
(it fails with what to install; only a test that asks for a version itself is skipped, with the reason),
leave servers or containers running after a test, or know anything about pgmesh beyond a node's DSN.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import psycopg
import pytest

from router.nodes import pgbin
from router.testing.localnodes import LocalNodeError, create_nodes, find_pg_bindir

logger = logging.getLogger(__name__)

BACKEND_ENV = "PGMESH_TEST_BACKEND"
VERSION_ENV = "PGMESH_TEST_PG"
DOCKER_MAJOR = 15  # the image of a node asking for no version
DOCKER_SETTINGS: Mapping[str, str] = {
    "wal_level": "logical",
    "track_commit_timestamp": "on",
    "max_replication_slots": "64",  # as router.testing.localnodes (origins' states on 15-17)
    "max_wal_senders": "32",
}


class NodeLike(Protocol):
    """What tests may rely on, whichever backend made the node."""

    name: str
    port: int

    def dsn(self, dbname: str | None = None, user: str = "postgres", password: str | None = None) -> str: ...

    def sql(self, query: str) -> str: ...

    def destroy(self) -> None: ...


# ---------------------------------------------------------------------------------------------------------
# Docker backend (used only when asked for, or when no local PostgreSQL exists)


def _rows_as_text(rows: Sequence[Sequence[Any]]) -> str:
    """Format rows like `psql -A -t`: columns joined by |, NULL as empty."""
    return "\n".join("|".join("" if v is None else str(v) for v in row) for row in rows).strip()


class DockerNode:
    """A postgres:<major> container (15 by default) with the same test-facing surface as LocalNode."""

    __slots__ = ("container", "dbname", "host", "name", "password", "port")

    def __init__(
        self, name: str, settings: Mapping[str, str], password: str | None, major: int | None = None
    ) -> None:
        try:
            from testcontainers.community.postgres import PostgresContainer
        except ImportError:  # testcontainers < 4.14
            from testcontainers.postgres import PostgresContainer  # type: ignore[no-redef,unused-ignore]

        conf = {**DOCKER_SETTINGS, **settings}
        command = " ".join(f"-c {key}={value}" for key, value in conf.items())
        self.name = name
        self.dbname = "app"
        self.password = password or "postgres"
        self.container = PostgresContainer(
            f"postgres:{major or DOCKER_MAJOR}", username="postgres", password=self.password,
            dbname=self.dbname, driver=None,
        ).with_command(command)
        self.container.start()
        self.host = self.container.get_container_host_ip()
        self.port = int(self.container.get_exposed_port(5432))
        logger.info("docker node %s on %s:%d", name, self.host, self.port)

    def dsn(self, dbname: str | None = None, user: str = "postgres", password: str | None = None) -> str:
        pw = password if password is not None else self.password
        quoted = "'" + pw.replace("\\", "\\\\").replace("'", "\\'") + "'"
        db = dbname or self.dbname
        return f"host={self.host} port={self.port} dbname={db} user={user} password={quoted}"

    def sql(self, query: str, *, dbname: str | None = None) -> str:
        with psycopg.connect(self.dsn(dbname), autocommit=True) as conn:
            cur = psycopg.ClientCursor(conn)
            cur.execute(query)
            rows: list[Sequence[Any]] = []
            while True:
                if cur.description is not None:
                    rows.extend(cur.fetchall())
                if not cur.nextset():
                    break
            return _rows_as_text(rows)

    def stop(self, mode: str = "fast") -> None:
        pytest.skip("stop() is not supported on the docker backend")

    def start(self) -> None:
        pytest.skip("start() is not supported on the docker backend")

    def restart(self, mode: str = "immediate") -> None:
        pytest.skip("restart() is not supported on the docker backend")

    def destroy(self) -> None:
        self.container.stop()


def _docker_reachable() -> bool:
    try:
        import docker  # type: ignore[import-untyped]

        docker.from_env().ping()
    except Exception:
        return False
    return True


def default_version() -> int | None:
    """The major version of every node that asks for none: $PGMESH_TEST_PG (e.g. 18), or None."""
    raw = os.environ.get(VERSION_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        pytest.fail(f"{VERSION_ENV}={raw!r}: expected a PostgreSQL major version such as 15 or 18")
    return int(raw)


def node_versions(count: int, versions: Sequence[int | None] | None) -> list[int | None]:
    """One major version per node: the test's, else $PGMESH_TEST_PG, else None (the default binaries)."""
    if versions is not None and len(versions) != count:
        pytest.fail(f"one version per node: {count} nodes but versions {list(versions)}")
    default = default_version()
    return [default if v is None else v for v in (versions or [None] * count)]


def require_versions(asked: Sequence[int | Path | None]) -> None:
    """Skip the test, saying why, when a version it asked for itself is not installed here (a binary
    directory it asked for by path, e.g. a minor release unpacked beside the installed one: not there)."""
    for major in dict.fromkeys(v for v in asked if v is not None):
        if isinstance(major, Path):
            if pgbin.major_version(major) is None:
                pytest.skip(f"no PostgreSQL server in {major} (the test asks for those binaries)")
            continue
        try:
            find_pg_bindir(major)
        except LocalNodeError as exc:
            pytest.skip(f"PostgreSQL {major} is not installed: {exc}")


def choose_backend() -> str:
    """'local' or 'docker' from $PGMESH_TEST_BACKEND (local | docker | auto); fail when neither works
    (or when $PGMESH_TEST_PG names a version that neither has)."""
    wanted = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if wanted == "docker":
        if not _docker_reachable():
            pytest.fail(f"{BACKEND_ENV}=docker but no Docker engine is reachable (docker.from_env().ping())")
        return "docker"
    if wanted not in ("local", "auto"):
        pytest.fail(f"{BACKEND_ENV}={wanted!r}: expected local, docker or auto")
    try:
        find_pg_bindir(default_version())
        return "local"
    except LocalNodeError as exc:
        if wanted == "local":
            pytest.fail(f"{BACKEND_ENV}=local but {exc}")
        if _docker_reachable():
            return "docker"
        pytest.fail(
            f"no PostgreSQL test backend: {exc}; and no Docker engine is reachable. "
            f"Install PostgreSQL 15+ (or set PGMESH_PG_BINDIR; {VERSION_ENV} asks for one major version) "
            f"or start Docker."
        )


@pytest.fixture(scope="session")
def pg_backend() -> Iterator[str]:
    """The node backend for this test session: 'local' or 'docker'.

    With $PGMESH_TEST_PG on the local backend, $PGMESH_PG_BINDIR points at that version's binaries for
    the session, so what tests and pgmesh itself run beside a server (pg_dump for a join, psql) is of
    that version too, not the machine's default (pg_dump refuses a newer server).
    """
    backend = choose_backend()
    major = default_version()
    logger.info("integration backend: %s, PostgreSQL %s", backend, major or "default")
    with pytest.MonkeyPatch.context() as patch:
        if backend == "local" and major is not None:
            patch.setenv("PGMESH_PG_BINDIR", str(find_pg_bindir(major)))
        yield backend


NodeFactory = Callable[..., list[NodeLike]]


@pytest.fixture
def pg_nodes(pg_backend: str) -> Iterator[NodeFactory]:
    """Factory: `pg_nodes(n=1, names=None, settings=None, password=None, versions=None)` -> started nodes.

    `versions`: one PostgreSQL major version per node (None for a node: $PGMESH_TEST_PG, else the
    default binaries); a test asking for a version that is not installed is skipped with the reason.
    Every node created through it is destroyed at teardown, whatever the test's outcome.
    """
    created: list[Any] = []

    def make(
        n: int = 1,
        names: Sequence[str] | None = None,
        settings: Mapping[str, str] | None = None,
        password: str | None = None,
        versions: Sequence[int | None] | None = None,
    ) -> list[Any]:
        if names is None:
            names = [f"n{len(created) + i + 1}" for i in range(n)]
        majors = node_versions(len(names), versions)
        if pg_backend == "local":
            require_versions(versions or ())
            nodes: list[Any] = create_nodes(names, versions=majors, settings=settings, password=password)
            created.extend(nodes)
            return nodes
        nodes = []
        for name, major in zip(names, majors, strict=True):
            nodes.append(DockerNode(name, settings or {}, password, major))
            created.append(nodes[-1])
        return nodes

    yield make
    errors: list[str] = []
    for node in reversed(created):
        try:
            node.destroy()
        except Exception as exc:
            errors.append(f"{node.name}: {exc}")
    if errors:
        logger.warning("teardown could not destroy some nodes: %s", "; ".join(errors))
