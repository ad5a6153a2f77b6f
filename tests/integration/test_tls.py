"""TLS to every node for every connection (issue 23): nodes that accept only `hostssl` with a client
certificate and a scram-sha-256 password; the router (replication via psycopg, apply via asyncpg, admin
sessions) and a Spark copy (`pgmesh push`) over `sslmode=verify-full`; the password given only through a
`password_file` (node a) or a `.pgpass` named by `passfile` (node b), never in a log, the status, /metrics
or an error; a wrong CA refused with one clear error naming the node."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import psycopg
import pytest

from router.apply.sessions import open_session
from router.cluster.checks import check_cluster
from router.cluster.copy.push import push
from router.cluster.install import init_cluster
from router.config.model import Config, parse_config
from router.errors import PgmeshError
from router.service.admin import admin_request
from router.testing.localnodes import PG_OS_USER, LocalNode
from router.testing.mesh import execute, fetch, free_port, log_directory, running_router, wait_converged
from tests.fix_certs import Certs, make_certs
from tests.fix_cluster import NodeFactory
from tests.integration.test_compare import unreplicated

PASSWORD = "Tls:Secret-9f3k"
SCHEMA = "CREATE TABLE items (id int PRIMARY KEY, v text);"
HBA = (
    "local      all          all                 trust\n"
    "hostssl    all          all   127.0.0.1/32  scram-sha-256 clientcert=verify-full\n"
    "hostssl    replication  all   127.0.0.1/32  scram-sha-256 clientcert=verify-full\n"
)


def _serve_tls(node: LocalNode, certs: Certs) -> None:
    """Certificates into the data directory, ssl = on, pg_hba: hostssl with a client certificate only."""
    files = ((certs.server_crt, "server.crt"), (certs.server_key, "server.key"), (certs.ca, "ca.crt"))
    for source, name in files:
        target = node.datadir / name
        shutil.copy(source, target)
        target.chmod(0o600)
        if os.geteuid() == 0:  # the server runs as postgres when the tests run as root
            shutil.chown(target, PG_OS_USER, PG_OS_USER)
    settings = (("ssl_cert_file", "server.crt"), ("ssl_key_file", "server.key"), ("ssl_ca_file", "ca.crt"),
                ("ssl", "on"))
    for key, value in settings:
        node.sql(f"ALTER SYSTEM SET {key} = '{value}'")
    (node.datadir / "pg_hba.conf").write_text(HBA)
    node.sql("SELECT pg_reload_conf()")


def _dsn(node: LocalNode, certs: Certs, root: Path, extra: str = "") -> str:
    return (f"host=127.0.0.1 port={node.port} dbname=app user=postgres sslmode=verify-full sslrootcert={root}"
            f" sslcert={certs.client_crt} sslkey={certs.client_key}{extra}")


def _config(nodes: list[LocalNode], certs: Certs, tmp: Path, root: Path, admin_port: int) -> Config:
    secret = tmp / "a.password"
    secret.write_text(PASSWORD + "\n")
    pgpass = tmp / "b.pgpass"
    pgpass.write_text(f"127.0.0.1:{nodes[1].port}:*:postgres:{PASSWORD.replace(':', chr(92) + ':')}\n")
    pgpass.chmod(0o600)
    a, b = nodes
    return parse_config(
        f'[cluster]\nname = "tls"\n'
        f'[[nodes]]\nname = "a"\ndsn = "{_dsn(a, certs, root)}"\npassword_file = "{secret}"\n'
        f'[[nodes]]\nname = "b"\ndsn = "{_dsn(b, certs, root, f" passfile={pgpass}")}"\n'
        f'[replication]\nstatus_interval_ms = 100\napply_transport = "pipeline"\n'
        f'[admin]\nlisten = "127.0.0.1:{admin_port}"\n'
        f'[log]\ndirectory = "{log_directory()}"\n'
    )


@pytest.fixture
def tls_nodes(pg_nodes: NodeFactory, tmp_path: Path) -> tuple[list[LocalNode], Certs]:
    nodes: list[LocalNode] = pg_nodes(names=["a", "b"], password=PASSWORD)
    if not isinstance(nodes[0], LocalNode):
        pytest.skip("TLS set-up needs the local backend (data directory and pg_hba.conf)")
    if not nodes[0].sql("SHOW ssl_library").strip():  # the PostgreSQL 18 wheel is built without SSL
        version = nodes[0].sql("SHOW server_version").strip()
        pytest.skip(f"this PostgreSQL build has no SSL support ({version})")
    certs = make_certs(tmp_path / "certs")
    for node in nodes:
        node.sql(SCHEMA)
        _serve_tls(node, certs)
    return nodes, certs


async def test_router_and_spark_copy_over_verify_full_with_passwords_from_files(
    tls_nodes: tuple[list[LocalNode], Certs], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    nodes, certs = tls_nodes
    port = free_port()
    config = _config(nodes, certs, tmp_path, certs.ca, port)
    assert PASSWORD not in repr(config) and all(PASSWORD not in n.dsn for n in config.nodes)
    report, _ = await init_cluster(config)
    assert report.ok, report.render()
    dsn_a, dsn_b = config.node("a").dsn, config.node("b").dsn
    async with await psycopg.AsyncConnection.connect(dsn_a) as conn:  # plain TCP is refused by pg_hba
        mine = await conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        assert await mine.fetchone() == (True,)
    session = await open_session(dsn_b)  # asyncpg, as the appliers connect
    try:
        assert await session.fetchval("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()") is True
    finally:
        await session.close()

    async with running_router(config) as router:
        await execute(dsn_a, "INSERT INTO items VALUES (1, 'a'), (2, 'a')")
        await execute(dsn_b, "INSERT INTO items VALUES (3, 'b')", "UPDATE items SET v = 'b1' WHERE id = 1")
        await wait_converged_tls(config)
        walsenders = await fetch(dsn_a, "SELECT count(*) FROM pg_stat_replication r JOIN pg_stat_ssl s"
                                        " USING (pid) WHERE s.ssl")
        assert walsenders == [(1,)]
        applying = await fetch(dsn_a, "SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)"
                                      " WHERE a.backend_type = 'client backend' AND a.usename = 'postgres'"
                                      " AND a.pid <> pg_backend_pid() AND NOT s.ssl")
        assert applying == [(0,)]  # every session of the router is encrypted
        pipe = router.appliers[("b", "a")].link.pipe  # the pipe over TLS: libpq's pipeline mode
        assert pipe is not None and not pipe.raw and router.appliers[("b", "a")].encoder.encodes > 0
        status = msgspec.json.encode(router.status()).decode()
        _, metrics = await admin_request("127.0.0.1", port, "GET", "/metrics")
        # a Spark copy (pgmesh push) over the same DSNs: its workers read the certificates and passfiles
        await unreplicated(_Node(dsn_b), "DELETE FROM items WHERE id = 2")  # b lost a row
        done = await asyncio.to_thread(push, config, "items", "a", "b")
        assert done.rows == 1
        assert await fetch(dsn_b, "SELECT v FROM items WHERE id = 2") == [("a",)]
    for text in (status, metrics.decode(), caplog.text, *(n.log_tail(400) for n in nodes)):
        assert PASSWORD not in text


class _Node:
    """A node as the mesh helpers take it: its DSN (here with TLS and its passfile)."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn

    def dsn(self) -> str:
        return self._dsn


async def wait_converged_tls(config: Config) -> None:
    await wait_converged([_Node(n.dsn) for n in config.nodes], ["items"], 60)


async def test_a_wrong_ca_is_one_clear_error_naming_the_node(
    tls_nodes: tuple[list[LocalNode], Certs], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nodes, certs = tls_nodes
    good = _config(nodes, certs, tmp_path, certs.ca, free_port())
    report, _ = await init_cluster(good)
    assert report.ok, report.render()
    bad = _config(nodes, certs, tmp_path, certs.other_ca, free_port())
    report = await check_cluster(bad)
    failed = [c for c in report.checks if not c.ok]
    assert [(c.node, c.check) for c in failed] == [("a", "connect"), ("b", "connect")]
    assert all("certificate verify failed" in c.detail for c in failed), report.render()
    caplog.set_level(logging.WARNING, "router.service.supervisor")
    with pytest.raises(PgmeshError):  # the router does not start (its own message: no node reachable)
        async with running_router(bad):
            pass
    refused = [r.getMessage() for r in caplog.records if "certificate verify failed" in r.getMessage()]
    assert sorted(m.split()[1] for m in refused) == ["a", "b"], refused  # one line per node, naming it
    assert not any(PASSWORD in m or "sslkey" in m for m in refused)
    # the CLI: one line naming the node, exit status 1, nothing secret
    argv = [sys.executable, "-m", "router", "init", "--check", "--config", str(_write(bad, tmp_path))]
    status = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=120,
                                     check=False)
    output = status.stdout + status.stderr
    assert status.returncode == 1 and "certificate verify failed" in status.stdout, output
    assert PASSWORD not in output


def _write(config: Config, tmp: Path) -> Path:
    """A config file of `config`'s nodes (their DSNs as resolved, passfile included)."""
    lines = [f'[cluster]\nname = "{config.cluster.name}"']
    for node in config.nodes:
        lines.append(f'[[nodes]]\nname = "{node.name}"\ndsn = "{node.dsn}"')
    path = tmp / "bad.toml"
    path.write_text("\n".join(lines) + "\n")
    return path
