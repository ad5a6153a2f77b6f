"""`router.nodes.dsn`: a DSN with libpq's meaning turned into asyncpg's arguments, and a node's password_file
(no server; the same against TLS servers: tests/integration/test_tls.py)."""

from __future__ import annotations

import ssl
from pathlib import Path

import psycopg.conninfo
import pytest

from router.config.model import parse_config
from router.errors import ConfigError
from router.nodes.dsn import asyncpg_args, libpq_params, password_file_dsn
from tests.fix_certs import Certs, make_certs

_PG_VARS = ("PGHOST", "PGPORT", "PGUSER", "PGDATABASE", "PGPASSWORD", "PGPASSFILE", "PGSSLMODE",
            "PGSSLROOTCERT", "PGSSLCERT", "PGSSLKEY", "PGAPPNAME", "PGCONNECT_TIMEOUT", "PGOPTIONS",
            "PGSERVICE", "PGSERVICEFILE")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in _PG_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.postgresql/root.crt or postgresql.crt


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_keywords_uris_and_several_hosts() -> None:
    args = asyncpg_args(
        "host=db1 port=6432 dbname=app user=pgmesh password='s e c' sslmode=disable connect_timeout=7"
        " application_name=pgmesh-b passfile=/etc/pgpass target_session_attrs=read-write"
        " options='-c search_path=app -csynchronous_commit=off --work-mem=8MB'"
    )
    assert args == {
        "host": "db1", "port": 6432, "database": "app", "user": "pgmesh", "password": "s e c", "ssl": False,
        "timeout": 7.0, "passfile": "/etc/pgpass", "target_session_attrs": "read-write",
        "server_settings": {"application_name": "pgmesh-b", "search_path": "app", "synchronous_commit": "off",
                            "work_mem": "8MB"},
    }
    several = asyncpg_args("postgresql://u@db1:5432,db2:5433/app?target_session_attrs=primary")
    assert several["host"] == ["db1", "db2"] and several["port"] == [5432, 5433]
    assert several["target_session_attrs"] == "primary" and several["database"] == "app"
    one_port = asyncpg_args("host=db1,db2 port=5432")
    assert one_port["host"] == ["db1", "db2"] and one_port["port"] == 5432
    assert asyncpg_args("host=db1 connect_timeout=1")["timeout"] == 2.0  # libpq's least
    assert "timeout" not in asyncpg_args("host=db1 connect_timeout=0")  # libpq: wait for ever


def test_the_environment_as_libpq_reads_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PGHOST", "envhost")
    monkeypatch.setenv("PGPORT", "5499")
    monkeypatch.setenv("PGUSER", "envuser")
    monkeypatch.setenv("PGAPPNAME", "envapp")
    monkeypatch.setenv("PGSSLMODE", "allow")
    monkeypatch.setenv("PGPASSWORD", "from-env")
    args = asyncpg_args("dbname=app")
    assert (args["host"], args["port"], args["user"], args["database"]) == ("envhost", 5499, "envuser", "app")
    assert args["ssl"] == "allow" and args["password"] == "from-env"
    assert args["server_settings"] == {"application_name": "envapp"}
    assert asyncpg_args("host=h port=1 user=u sslmode=disable")["port"] == 1  # the DSN wins
    service = tmp_path / "services.conf"
    service.write_text("[main]\nhost=svchost\nport=6000\ndbname=svcdb\n")
    monkeypatch.setenv("PGSERVICEFILE", str(service))
    args = asyncpg_args("service=main port=6001")
    assert (args["host"], args["port"], args["database"]) == ("svchost", 6001, "svcdb")
    with pytest.raises(ConfigError, match="service 'nope'"):
        asyncpg_args("service=nope")


def test_sslmodes_follow_libpq(certs: Certs, tmp_path: Path) -> None:
    assert asyncpg_args("host=h sslmode=disable")["ssl"] is False
    assert asyncpg_args("host=h")["ssl"] == "prefer"  # libpq's default
    assert asyncpg_args(f"host=/tmp sslmode=verify-full sslrootcert={certs.ca}")["ssl"] is False  # a socket
    plain = asyncpg_args("host=h sslmode=require")["ssl"]
    assert isinstance(plain, ssl.SSLContext) and plain.verify_mode == ssl.CERT_NONE
    with_root = asyncpg_args(f"host=h sslmode=require sslrootcert={certs.ca}")["ssl"]
    assert with_root.verify_mode == ssl.CERT_REQUIRED and not with_root.check_hostname  # as verify-ca
    ca = asyncpg_args(f"host=h sslmode=verify-ca sslrootcert={certs.ca}")["ssl"]
    assert ca.verify_mode == ssl.CERT_REQUIRED and not ca.check_hostname
    full = asyncpg_args(f"host=h sslmode=verify-full sslrootcert={certs.ca} sslcert={certs.client_crt}"
                        f" sslkey={certs.client_key}")["ssl"]
    assert full.verify_mode == ssl.CERT_REQUIRED and full.check_hostname
    assert full.minimum_version == ssl.TLSVersion.TLSv1_2
    system = asyncpg_args("host=h sslmode=require sslrootcert=system")["ssl"]
    assert system.check_hostname  # libpq 16+: the system's store means verify-full
    with pytest.raises(ConfigError, match=r"root certificate file .*missing\.crt does not exist"):
        asyncpg_args(f"host=h sslmode=verify-full sslrootcert={tmp_path / 'missing.crt'}")
    with pytest.raises(ConfigError, match=r"root\.crt does not exist"):  # libpq's default place
        asyncpg_args("host=h sslmode=verify-ca")
    with pytest.raises(ConfigError, match="sslmode='sometimes'"):
        asyncpg_args("host=h sslmode=sometimes")


def test_prefer_keeps_the_client_certificate(certs: Certs) -> None:
    args = asyncpg_args(f"host=h sslmode=prefer sslcert={certs.client_crt} sslkey={certs.client_key}")
    assert args["ssl"] == "prefer" and args["host"] == "h"
    assert args["dsn"].startswith("postgresql://?sslcert=") and "sslkey=" in args["dsn"]


def test_home_root_certificate_makes_require_verify(certs: Certs, tmp_path: Path) -> None:
    home = tmp_path / "home" / ".postgresql"
    home.mkdir(parents=True)
    (home / "root.crt").write_bytes(certs.ca.read_bytes())
    assert asyncpg_args("host=h sslmode=require")["ssl"].verify_mode == ssl.CERT_REQUIRED
    assert libpq_params("host=h")["sslmode"] == "prefer"


def test_password_file_becomes_a_private_pgpass(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("p:a\\ss word\n")
    dsn = password_file_dsn("host=h user=u", str(secret), "a")
    passfile = Path(psycopg.conninfo.conninfo_to_dict(dsn)["passfile"])
    assert "p:a" not in dsn and passfile.stat().st_mode & 0o077 == 0
    assert passfile.read_text() == "*:*:*:*:p\\:a\\\\ss word\n"  # .pgpass escapes
    assert password_file_dsn("host=h user=u", str(secret), "a") == dsn  # the same copy again
    assert asyncpg_args(dsn)["passfile"] == str(passfile)
    assert asyncpg_args(dsn)["password"] == "p:a\\ss word"  # unescaped as libpq does (asyncpg does not)
    pgpass = tmp_path / "pgpass"
    pgpass.write_text("# comment\nother:5432:*:u:no\nh:6000:app:u:wrong-db\nh:6000:*:u:se\\:cret\n")
    pgpass.chmod(0o600)
    assert asyncpg_args(f"host=h port=6000 user=u passfile={pgpass}")["password"] == "se:cret"
    assert asyncpg_args(f"host=h port=6000 user=u dbname=app passfile={pgpass}")["password"] == "wrong-db"
    pgpass.chmod(0o644)  # libpq ignores a file others may read
    assert "password" not in asyncpg_args(f"host=h port=6000 user=u passfile={pgpass}")
    with pytest.raises(ConfigError, match=r"node b: password_file .*nope cannot be read"):
        password_file_dsn("host=h", str(tmp_path / "nope"), "b")
    config = parse_config(
        '[cluster]\nname = "t"\n[[nodes]]\nname = "a"\ndsn = "host=h"\n'
        f'password_file = "{secret}"\n[[nodes]]\nname = "b"\ndsn = "host=g"\n'
    )
    assert "passfile=" in config.node("a").dsn and "passfile" not in config.node("b").dsn
    assert "p:a" not in repr(config)
