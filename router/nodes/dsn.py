"""A node's DSN with libpq's meaning, for the clients that are not libpq: asyncpg's arguments, and a
password kept in a file named by the config.

Owns `asyncpg_args`: a libpq keyword or URI DSN -> `asyncpg.connect` keyword arguments that connect where,
as whom and how libpq would. The DSN is layered over a service file's entry (`service=`, PGSERVICE) and
libpq's own defaults and PG* environment (`PQconndefaults`, read at each call), in libpq's order; TLS
follows libpq's `sslmode`: `disable`, `allow` and `prefer` (asyncpg's fallback, which is libpq's; the client
certificate goes with it), `require` (encrypted; the chain verified when a root certificate is there, as
libpq does), `verify-ca` and `verify-full` (an `ssl.SSLContext` built here from `sslrootcert`, `system` for
the system's store, `sslcrl`, `sslcert`/`sslkey`/`sslpassword`, `ssl_min/max_protocol_version`). asyncpg left
to itself would ignore a DSN's `sslrootcert`/`sslcert` when given keywords, read some PG* variables and not
others, and pass unknown keywords to the server as settings. Also `password_file_dsn`: a node's
`password_file` (the password alone, as a secret mounted by Kubernetes or Docker) as a private `.pgpass`
copy that the DSN names with `passfile`, so libpq, asyncpg and a Spark copy's workers all read it and the
password itself is never in a DSN, an argument or a message.

Must not: connect anywhere, log, or put a password or a whole DSN into an error (errors name the
keyword and the file, never a value that could hold a secret). Knows nothing of nodes or the config.
"""

from __future__ import annotations

import atexit
import configparser
import hashlib
import os
import shlex
import shutil
import ssl
import tempfile
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import psycopg.conninfo
import psycopg.pq

from router.errors import ConfigError

__all__ = ["asyncpg_args", "libpq_params", "password_file_dsn", "ssl_for"]

_PLAIN: Final = ("disable",)
_OPPORTUNISTIC: Final = ("allow", "prefer")
_VERIFYING: Final = ("verify-ca", "verify-full")
SSLMODES: Final = (*_PLAIN, *_OPPORTUNISTIC, "require", *_VERIFYING)
# asyncpg's keyword for a libpq keyword that is passed on as is
_AS_IS: Final = {
    "user": "user", "password": "password", "dbname": "database", "passfile": "passfile",
    "target_session_attrs": "target_session_attrs", "krbsrvname": "krbsrvname", "gsslib": "gsslib",
}
# libpq's defaults that are asyncpg's too (left out)
_SAME: Final = {"krbsrvname": "postgres", "target_session_attrs": "any"}
# what asyncpg's `prefer`/`allow` context reads from a DSN query (it has no keyword for them)
_CERT_KEYS: Final = (
    "sslcert", "sslkey", "sslpassword", "ssl_min_protocol_version", "ssl_max_protocol_version",
)


def _home_file(name: str) -> Path:
    """libpq's default for a file in ~/.postgresql."""
    return Path(os.path.expanduser("~")) / ".postgresql" / name


def _service(name: str) -> dict[str, str]:
    """The entry `name` of the service file libpq would read (PGSERVICEFILE or ~/.pg_service.conf, then
    PGSYSCONFDIR/pg_service.conf)."""
    files = [Path(os.environ.get("PGSERVICEFILE", os.path.expanduser("~/.pg_service.conf")))]
    if os.environ.get("PGSYSCONFDIR"):
        files.append(Path(os.environ["PGSYSCONFDIR"]) / "pg_service.conf")
    for file in files:
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(file, encoding="utf-8")
        except configparser.Error:
            raise ConfigError(f"service file {file} does not parse") from None
        if parser.has_section(name):
            return dict(parser.items(name))
    raise ConfigError(f"definition of service {name!r} not found", hint="check PGSERVICEFILE or the dsn")


def libpq_params(dsn: str) -> dict[str, str]:
    """Every connection keyword with a value, as libpq would resolve it: the DSN, over its service's
    entry, over the PG* environment and the compiled-in defaults."""
    try:
        given = {k: str(v) for k, v in psycopg.conninfo.conninfo_to_dict(dsn).items() if v is not None}
    except psycopg.ProgrammingError:
        raise ConfigError("the dsn is not a valid libpq connection string", hint="fix the dsn") from None
    params = {
        option.keyword.decode(): option.val.decode()
        for option in psycopg.pq.Conninfo.get_defaults()
        if option.val is not None
    }
    service = given.get("service") or params.get("service")
    if service:
        params.update(_service(service))
    params.update(given)
    return params


def _load_root(context: ssl.SSLContext, params: Mapping[str, str], mode: str) -> bool:
    """Load the root certificate(s) libpq would; whether there were any (`require` then verifies)."""
    root = params.get("sslrootcert")
    if root == "system":
        context.load_default_certs()
        return True
    path = Path(root) if root else _home_file("root.crt")
    if not path.is_file():
        if mode in _VERIFYING:
            raise ConfigError(
                f"root certificate file {path} does not exist or cannot be read (sslmode={mode})",
                hint="set sslrootcert in the dsn to the CA certificate that signed the server's",
            )
        return False
    try:
        context.load_verify_locations(cafile=str(path))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"root certificate file {path} cannot be loaded: {exc}") from None
    return True


def _load_client_cert(context: ssl.SSLContext, params: Mapping[str, str]) -> None:
    cert = params.get("sslcert")
    cert_path = Path(cert) if cert else _home_file("postgresql.crt")
    if not cert_path.is_file():
        if cert:
            raise ConfigError(f"client certificate file {cert_path} does not exist or cannot be read")
        return
    key = params.get("sslkey")
    key_path = Path(key) if key else _home_file("postgresql.key")
    password = params.get("sslpassword", "")
    try:
        context.load_cert_chain(str(cert_path), str(key_path) if key_path.is_file() else None,
                                password=lambda: password)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"client certificate {cert_path} or its key {key_path} cannot be loaded: "
                          f"{type(exc).__name__}", hint="check sslcert, sslkey and sslpassword") from None


def _tls_version(value: str, key: str) -> ssl.TLSVersion:
    try:
        return ssl.TLSVersion[value.replace(".", "_")]
    except KeyError:
        raise ConfigError(f"{key}={value!r}: expected TLSv1, TLSv1.1, TLSv1.2 or TLSv1.3") from None


def ssl_for(params: Mapping[str, str]) -> ssl.SSLContext | str | bool:
    """asyncpg's `ssl` for resolved libpq parameters: False, the mode for `allow`/`prefer` (asyncpg then
    falls back to an unencrypted connection as libpq does), or a context for `require` and up."""
    mode = params.get("sslmode", "prefer")
    if params.get("sslrootcert") == "system" and mode not in _PLAIN:
        mode = "verify-full"  # libpq 16+: the system's store is only ever used to verify the host name
    if mode not in SSLMODES:
        raise ConfigError(f"sslmode={mode!r}: expected one of {', '.join(SSLMODES)}")
    if mode in _PLAIN:
        return False
    if mode in _OPPORTUNISTIC:
        return mode
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if _load_root(context, params, mode):
        context.verify_mode = ssl.CERT_REQUIRED  # `require` with a root certificate is `verify-ca`
        context.check_hostname = mode == "verify-full"
        crl = params.get("sslcrl")
        if crl:
            try:
                context.load_verify_locations(cafile=crl)
            except (OSError, ssl.SSLError):
                raise ConfigError(f"certificate revocation list {crl} cannot be loaded") from None
            context.verify_flags |= ssl.VERIFY_CRL_CHECK_CHAIN
    _load_client_cert(context, params)
    context.minimum_version = _tls_version(params.get("ssl_min_protocol_version") or "TLSv1.2",
                                           "ssl_min_protocol_version")
    if params.get("ssl_max_protocol_version"):
        context.maximum_version = _tls_version(params["ssl_max_protocol_version"], "ssl_max_protocol_version")
    return context


def _server_settings(params: Mapping[str, str]) -> dict[str, str]:
    """application_name (or the fallback) and `options`' `-c name=value` / `--name=value` settings."""
    settings: dict[str, str] = {}
    name = params.get("application_name") or params.get("fallback_application_name")
    if name:
        settings["application_name"] = name
    words = iter(shlex.split(params.get("options", "")))
    for word in words:
        if word == "-c":
            word = "-c" + next(words, "")
        setting = word[2:] if word.startswith(("-c", "--")) else ""
        if "=" in setting:
            key, _, value = setting.partition("=")
            settings[key.replace("-", "_")] = value
    return settings


def _pgpass_fields(line: str) -> list[str]:
    """One line of a .pgpass file split at unescaped colons, `\\:` and `\\\\` unescaped (as libpq reads it;
    asyncpg keeps the backslashes)."""
    fields: list[str] = []
    current: list[str] = []
    chars = iter(line)
    for char in chars:
        if char == "\\":
            current.append(next(chars, ""))
        elif char == ":" and len(fields) < 4:
            fields.append("".join(current))
            current = []
        else:
            current.append(char)
    return [*fields, "".join(current)]


def _pgpass_password(params: Mapping[str, str], hosts: list[str], ports: list[str]) -> str | None:
    """The password libpq would take from the password file for the first host (PGPASSFILE, passfile or
    ~/.pgpass; a file that group or others may read is ignored, as libpq does)."""
    path = Path(params.get("passfile") or os.path.expanduser("~/.pgpass"))
    try:
        if path.stat().st_mode & 0o077 or not path.is_file():
            return None
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    host = hosts[0] if hosts else "localhost"
    host = "localhost" if host.startswith(("/", "@")) else host
    port = ports[0] if ports else "5432"
    user = params.get("user", "")
    wanted = (host, port, params.get("dbname") or user, user)
    for line in lines:
        if not line.strip() or line.startswith("#"):
            continue
        fields = _pgpass_fields(line)
        if len(fields) == 5 and all(f in ("*", w) for f, w in zip(fields, wanted, strict=False)):
            return fields[4]
    return None


def asyncpg_args(dsn: str) -> dict[str, Any]:
    """`asyncpg.connect(**asyncpg_args(dsn))` connects as `psycopg.connect(dsn)` would: same hosts and
    ports (several are tried in turn), user, database, password source, TLS mode and certificates."""
    params = libpq_params(dsn)
    args: dict[str, Any] = {
        target: params[key] for key, target in _AS_IS.items()
        if params.get(key, "") not in ("", _SAME.get(key))
    }
    hostaddr = params.get("hostaddr")
    host = params.get("host") or hostaddr
    if hostaddr and params.get("host") and params.get("sslmode") == "verify-full":
        raise ConfigError("hostaddr with sslmode=verify-full: asyncpg checks the certificate against the"
                          " address it connects to", hint="name the server by host only")
    if hostaddr:
        host = hostaddr
    hosts = host.split(",") if host else []
    if hosts:
        args["host"] = hosts[0] if len(hosts) == 1 else hosts
    if params.get("port"):
        ports = [int(p) for p in params["port"].split(",")]  # one for every host, or one per host
        args["port"] = ports[0] if len(ports) == 1 else ports
    if params.get("connect_timeout") and int(params["connect_timeout"]) > 0:
        args["timeout"] = float(max(2, int(params["connect_timeout"])))  # libpq's least is 2 s
    if not params.get("password"):  # libpq's order: the DSN, PGPASSWORD, then the password file
        password = _pgpass_password(params, hosts, params.get("port", "5432").split(","))
        if password is not None:
            args["password"] = password
    settings = _server_settings(params)
    if settings:
        args["server_settings"] = settings
    sockets = bool(hosts) and all(h.startswith("/") or h.startswith("@") for h in hosts)
    args["ssl"] = False if sockets else ssl_for(params)  # libpq never encrypts a Unix socket
    if args["ssl"] in _OPPORTUNISTIC:
        query = {k: params[k] for k in _CERT_KEYS if params.get(k)}
        if query:  # asyncpg builds its `prefer` context from a DSN only; host and the rest stay keywords
            args["dsn"] = "postgresql://?" + urllib.parse.urlencode(query)
    if params.get("sslnegotiation") == "direct":
        args["direct_tls"] = True
    return args


# ---------------------------------------------------------------------------------------------------------
# A node's password_file


_PASSFILES: dict[str, Path] = {}
_PRIVATE_DIR: list[Path] = []


def _private_dir() -> Path:
    if not _PRIVATE_DIR:
        made = Path(tempfile.mkdtemp(prefix="pgmesh-pass-"))  # mode 0700
        atexit.register(shutil.rmtree, made, True)
        _PRIVATE_DIR.append(made)
    return _PRIVATE_DIR[0]


def _pgpass_escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace(":", "\\:")


def password_file_dsn(dsn: str, password_file: str, node: str) -> str:
    """`dsn` with `passfile` naming a private `.pgpass` copy (mode 0600, removed at exit) of the password
    held in `password_file` (its first line). The same file and content give the same copy."""
    path = Path(password_file).expanduser()
    try:
        password = path.read_text(encoding="utf-8").splitlines()[0] if path.stat().st_size else ""
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"node {node}: password_file {path} cannot be read: {reason}") from None
    if not password:
        raise ConfigError(f"node {node}: password_file {path} is empty")
    digest = hashlib.sha256(f"{path.resolve()}\0{password}".encode()).hexdigest()[:24]
    copy = _PASSFILES.get(digest)
    if copy is None or not copy.exists():
        copy = _private_dir() / f"{digest}.pgpass"
        fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(f"*:*:*:*:{_pgpass_escape(password)}\n")
        _PASSFILES[digest] = copy
    return psycopg.conninfo.make_conninfo(dsn, passfile=str(copy))
