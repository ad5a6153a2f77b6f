"""Throw-away local PostgreSQL clusters for `pgmesh demo` and the integration tests.

Owns: one cached `initdb` template per process and binary directory (the binaries are
`router.nodes.pgbin`'s, chosen per node by major version: `create_nodes(..., versions=[15, 18])`),
copying it into per-node data directories, their configuration (postgresql.conf additions, pg_hba.conf), free
loopback ports, and starting / stopping / crashing / destroying those servers with `pg_ctl`.

Must not: touch any cluster it did not create, run the server as root (when euid is 0 every server-side
command runs as the `postgres` OS user through `runuser`), talk the replication protocol, or import
anything outside the standard library but `router.nodes.pgbin` (itself standard library only). It is
synchronous subprocess code, never called on the router's hot path.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from router.nodes import pgbin
from router.testing import ports

logger = logging.getLogger(__name__)

PG_OS_USER = "postgres"
CONF_INCLUDE = "pgmesh.conf"
START_TIMEOUT_S = 60
PORT_ATTEMPTS = 5

DEFAULT_SETTINGS: Mapping[str, str] = {
    "listen_addresses": "127.0.0.1",
    "wal_level": "logical",
    "track_commit_timestamp": "on",
    "max_replication_slots": "64",  # on 15-17 also the replication origins' states (2N-1 a node, N <= 19)
    "max_wal_senders": "32",
    "max_worker_processes": "16",
    "max_connections": "200",
    "fsync": "off",
    "full_page_writes": "off",
    "synchronous_commit": "on",
    "shared_buffers": "128MB",
    "max_locks_per_transaction": "256",
    "logical_decoding_work_mem": "64MB",
    "wal_sender_timeout": "60s",
    "log_min_messages": "warning",
    "log_line_prefix": "%m [%p] %q%a ",
}

_PORT_TAKEN = re.compile(r"could not bind|Address already in use|could not create any TCP/IP sockets")


class LocalNodeError(RuntimeError):
    """A local cluster could not be found, created, started, stopped or queried."""


# ---------------------------------------------------------------------------------------------------------
# Binaries and OS user


def find_pg_bindir(major: int | None = None) -> Path:
    """The binary directory of PostgreSQL `major` (None: the default one, >= 15;
    `router.nodes.pgbin.find_pg_bindir`); when there is none, a LocalNodeError saying where it looked."""
    try:
        return pgbin.find_pg_bindir(major)
    except pgbin.PgBinError as exc:
        raise LocalNodeError(str(exc)) from None


def _bindirs(versions: Sequence[int | Path | None]) -> list[Path]:
    """One binary directory per requested major version (None: the default), each looked up once; a
    `Path` is a binary directory asked for by itself (a minor release beside the installed one, e.g. a
    15.20 unpacked from Debian's package), used when it holds a server."""
    found: dict[int | Path | None, Path] = {}
    for major in versions:
        if isinstance(major, Path):
            if pgbin.major_version(major) is None:
                raise LocalNodeError(f"no PostgreSQL server (postgres, initdb, pg_ctl) in {major}")
            found[major] = major
        elif major not in found:
            found[major] = find_pg_bindir(major)
    return [found[major] for major in versions]


def _psql_path(bindir: Path) -> str:
    for candidate in (bindir / "psql", Path("/usr/bin/psql")):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("psql")
    if found is None:
        raise LocalNodeError(f"psql not found in {bindir}, /usr/bin or PATH")
    return found


def _is_root() -> bool:
    return os.geteuid() == 0


def _as_server_user(argv: Sequence[str]) -> list[str]:
    """`argv` run as the postgres OS user when we are root (the server refuses root), else unchanged."""
    if not _is_root():
        return list(argv)
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"
    return [runuser, "-u", PG_OS_USER, "--", *argv]


def _give_to_server_user(path: Path) -> None:
    if _is_root():
        shutil.chown(path, user=PG_OS_USER, group=PG_OS_USER)


def _run(argv: Sequence[str], *, what: str, cwd: Path, timeout: float = 120) -> str:
    """Run a command to completion; raise LocalNodeError with its output on failure."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, cwd=cwd, timeout=timeout, env=_clean_env()
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise LocalNodeError(f"{what}: {exc}") from exc
    if done.returncode != 0:
        raise LocalNodeError(
            f"{what}: exit {done.returncode}: {(done.stderr or done.stdout).strip()[-2000:]}"
        )
    return done.stdout


def _clean_env() -> dict[str, str]:
    """Our environment without libpq/server variables that could redirect a command elsewhere."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.setdefault("LC_ALL", "C")
    return env


# ---------------------------------------------------------------------------------------------------------
# The initdb templates: one per process and binary directory


_template_lock = threading.Lock()
_templates: dict[tuple[int, Path], Path] = {}


def _template_datadir(bindir: Path) -> Path:
    """A data directory made by initdb once per (process, bindir); copied for every node."""
    key = (os.getpid(), bindir)
    with _template_lock:
        cached = _templates.get(key)
        if cached is not None and cached.is_dir():
            return cached
        root = Path(tempfile.mkdtemp(prefix="pgmesh-template-"))
        root.chmod(0o755)
        _give_to_server_user(root)
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        datadir = root / "data"
        argv = [
            str(bindir / "initdb"),
            "-D",
            str(datadir),
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale=C",
        ]
        logger.info("initdb template cluster in %s", datadir)
        _run(_as_server_user(argv), what=f"initdb template in {datadir}", cwd=root)
        _templates[key] = datadir
        return datadir


# ---------------------------------------------------------------------------------------------------------
# Configuration files


def _conf_quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _libpq_quote(value: str) -> str:
    if value and not re.search(r"[\s'\\]", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _sql_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _hba_text(password: str | None) -> str:
    method = "scram-sha-256" if password is not None else "trust"
    return (
        "# written by pgmesh router.testing.localnodes\n"
        "local   all          all                 trust\n"
        f"host    all          all   127.0.0.1/32  {method}\n"
        f"host    replication  all   127.0.0.1/32  {method}\n"
    )


# ---------------------------------------------------------------------------------------------------------
# One node


@dataclass(slots=True)
class LocalNode:
    """One throw-away cluster: a base dir holding its data dir, server log and unix socket."""

    name: str
    port: int
    base_dir: Path
    bindir: Path
    dbname: str = "app"
    host: str = "127.0.0.1"
    password: str | None = None
    settings: dict[str, str] = field(default_factory=dict)
    # extra environment of the server (e.g. libfaketime's LD_PRELOAD and FAKETIME), from its next start
    env: dict[str, str] = field(default_factory=dict)

    @property
    def datadir(self) -> Path:
        return self.base_dir / "data"

    @property
    def logfile(self) -> Path:
        return self.base_dir / "server.log"

    def dsn(self, dbname: str | None = None, user: str = "postgres", password: str | None = None) -> str:
        """libpq keyword DSN over TCP; the node's own password is used when none is given."""
        parts = {
            "host": self.host,
            "port": str(self.port),
            "dbname": dbname or self.dbname,
            "user": user,
        }
        pw = password if password is not None else self.password
        if pw is not None:
            parts["password"] = pw
        return " ".join(f"{k}={_libpq_quote(v)}" for k, v in parts.items())

    def __repr__(self) -> str:
        return f"LocalNode(name={self.name!r}, port={self.port}, base_dir={str(self.base_dir)!r})"

    # -- configuration ----------------------------------------------------------------------------------

    def write_config(self) -> None:
        """(Re)write the pgmesh include file with the current port and settings, and pg_hba.conf."""
        conf = dict(DEFAULT_SETTINGS)
        if (pgbin.tool_major(self.bindir, ("postgres",)) or 0) >= 18:
            conf["max_active_replication_origins"] = "64"  # 18+: origins' states apart from the slots
        conf["port"] = str(self.port)
        conf["unix_socket_directories"] = str(self.base_dir)
        if self.password is not None:
            conf["password_encryption"] = "scram-sha-256"
        conf.update(self.settings)
        lines = [f"{key} = {_conf_quote(value)}" for key, value in conf.items()]
        include = self.datadir / CONF_INCLUDE
        include.write_text("# written by pgmesh router.testing.localnodes\n" + "\n".join(lines) + "\n")
        _give_to_server_user(include)
        (self.datadir / "pg_hba.conf").write_text(_hba_text(self.password))
        main_conf = self.datadir / "postgresql.conf"
        text = main_conf.read_text()
        directive = f"include = '{CONF_INCLUDE}'"
        if directive not in text:
            main_conf.write_text(text.rstrip("\n") + f"\n{directive}\n")

    # -- server lifecycle -------------------------------------------------------------------------------

    def _pg_ctl(self, *args: str) -> list[str]:
        return _as_server_user([str(self.bindir / "pg_ctl"), "-D", str(self.datadir), *args])

    def start_argv(self) -> list[str]:
        """The `pg_ctl start` command line (used to start several nodes concurrently)."""
        return self._pg_ctl("-w", "-t", str(START_TIMEOUT_S), "-l", str(self.logfile), "start")

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        logger.info("starting node %s on port %d", self.name, self.port)
        done = subprocess.run(
            self.start_argv(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=self.base_dir,
            env={**_clean_env(), **self.env},
            timeout=START_TIMEOUT_S + 30,
        )
        self.check_started(done.returncode, done.stdout)

    def check_started(self, returncode: int, output: str) -> None:
        """Raise a LocalNodeError with the server log when `pg_ctl start` exited non-zero."""
        if returncode != 0:
            raise self.error(f"pg_ctl start failed (exit {returncode}): {output.strip()[-1000:]}")

    def start_failed_on_port(self) -> bool:
        """True when the last start attempt's log says the port was taken."""
        return bool(_PORT_TAKEN.search(self.log_tail(20)))

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`fast`, `smart` or `immediate`); nothing to do when it is not running."""
        if not self.is_running():
            return
        logger.info("stopping node %s (mode %s)", self.name, mode)
        try:
            _run(
                self._pg_ctl("-m", mode, "-w", "-t", str(START_TIMEOUT_S), "stop"),
                what=f"pg_ctl stop -m {mode}",
                cwd=self.base_dir,
            )
        except LocalNodeError as exc:
            raise self.error(str(exc)) from exc

    def restart(self, mode: str = "immediate") -> None:
        """Stop with `mode` (immediate = a crash: no shutdown checkpoint) and start again."""
        self.stop(mode)
        self.start()

    def is_running(self) -> bool:
        done = subprocess.run(
            self._pg_ctl("status"),
            capture_output=True,
            text=True,
            cwd=self.base_dir,
            env=_clean_env(),
            timeout=30,
        )
        return done.returncode == 0

    def destroy(self) -> None:
        """Crash-stop the server if running and delete everything under the base dir."""
        if self.datadir.exists():
            try:
                self.stop("immediate")
            except LocalNodeError:
                logger.warning("node %s did not stop cleanly before removal", self.name, exc_info=True)
        shutil.rmtree(self.base_dir, ignore_errors=True)
        ports.release(self.port)
        logger.info("destroyed node %s (%s)", self.name, self.base_dir)

    # -- inspection -------------------------------------------------------------------------------------

    def sql(self, query: str, *, dbname: str | None = None) -> str:
        """Run `query` with psql over the node's unix socket (trust); stdout stripped, rows as a|b."""
        argv = [
            _psql_path(self.bindir),
            "-X",
            "-A",
            "-t",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            str(self.base_dir),
            "-p",
            str(self.port),
            "-U",
            "postgres",
            "-d",
            dbname or self.dbname,
            "-c",
            query,
        ]
        done = subprocess.run(argv, capture_output=True, text=True, env=_clean_env(), timeout=300)
        if done.returncode != 0:
            raise LocalNodeError(
                f"node {self.name} (port {self.port}): psql failed (exit {done.returncode}): "
                f"{done.stderr.strip()}\nquery: {query[:500]}"
            )
        return done.stdout.strip()

    def log_tail(self, n: int = 50) -> str:
        """The last `n` lines of the server log ('' when there is none yet)."""
        try:
            lines = self.logfile.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def error(self, message: str) -> LocalNodeError:
        """A LocalNodeError naming this node and carrying the tail of its server log."""
        return LocalNodeError(
            f"node {self.name} (port {self.port}, {self.datadir}): {message}\n"
            f"--- last lines of {self.logfile} ---\n{self.log_tail(30)}"
        )


# ---------------------------------------------------------------------------------------------------------
# Creating several nodes


def _new_node(
    name: str,
    port: int,
    bindir: Path,
    template: Path,
    settings: Mapping[str, str],
    password: str | None,
    parent: Path | None,
) -> LocalNode:
    base = Path(tempfile.mkdtemp(prefix="pgmesh-node-", dir=parent))
    base.chmod(0o755)
    _give_to_server_user(base)
    node = LocalNode(
        name=name, port=port, base_dir=base, bindir=bindir, password=password, settings=dict(settings)
    )
    try:
        _run(
            _as_server_user(["cp", "-a", str(template), str(node.datadir)]),
            what=f"node {name}: copy template {template}",
            cwd=base,
        )
        node.write_config()
    except Exception:
        shutil.rmtree(base, ignore_errors=True)
        raise
    return node


def _start_all(nodes: Sequence[LocalNode]) -> None:
    """Start every node concurrently; move a node to a new port when its port turned out taken."""
    pending = list(nodes)
    for attempt in range(PORT_ATTEMPTS):
        for node in pending:
            logger.info("starting node %s on port %d", node.name, node.port)
        procs = [
            subprocess.Popen(
                node.start_argv(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=node.base_dir,
                env={**_clean_env(), **node.env},
            )
            for node in pending
        ]
        outputs = [proc.communicate(timeout=START_TIMEOUT_S + 30)[0] for proc in procs]
        retry: list[LocalNode] = []
        for node, proc, output in zip(pending, procs, outputs, strict=True):
            if proc.returncode == 0:
                continue
            if attempt + 1 < PORT_ATTEMPTS and node.start_failed_on_port():
                retry.append(node)
                continue
            node.check_started(proc.returncode, output)
        if not retry:
            return
        taken = {n.port for n in nodes}
        for node, port in zip(retry, ports.reserve(len(retry), taken), strict=True):
            logger.info("node %s: port %d was taken, retrying on %d", node.name, node.port, port)
            ports.release(node.port)
            node.port = port
            node.write_config()
        pending = retry


def _prepare_databases(nodes: Sequence[LocalNode]) -> None:
    for node in nodes:
        if node.password is not None:
            node.sql(f'ALTER ROLE "postgres" PASSWORD {_sql_literal(node.password)}', dbname="postgres")
        if node.dbname != "postgres":
            quoted = '"' + node.dbname.replace('"', '""') + '"'
            node.sql(f"CREATE DATABASE {quoted}", dbname="postgres")


def create_nodes(
    names: Sequence[str],
    *,
    versions: Sequence[int | Path | None] | None = None,
    base_dir: Path | None = None,
    settings: Mapping[str, str] | None = None,
    password: str | None = None,
) -> list[LocalNode]:
    """Create, configure and start one cluster per name, each with database `app`.

    `versions` gives each node's PostgreSQL major version, in the order of `names` (None, or no list:
    the default binaries of `find_pg_bindir()`; a `Path`: that binary directory). `base_dir` is the
    parent of the per-node directories (default: the system temp dir). `settings` override the
    postgresql.conf defaults; `password` switches TCP auth to scram-sha-256 for `postgres`. On failure
    every node created so far is destroyed and a LocalNodeError is raised (also when a requested
    version is not installed).
    """
    if len(set(names)) != len(names):
        raise LocalNodeError(f"node names must be distinct: {list(names)}")
    wanted: list[int | Path | None] = [None] * len(names) if versions is None else list(versions)
    if len(wanted) != len(names):
        raise LocalNodeError(f"one version per node: {list(names)} but versions {wanted}")
    bindirs = _bindirs(wanted)
    templates = {bindir: _template_datadir(bindir) for bindir in bindirs}
    if base_dir is not None:
        base_dir.mkdir(parents=True, exist_ok=True)
    nodes: list[LocalNode] = []
    try:
        for name, port, bindir in zip(names, ports.reserve(len(names), set()), bindirs, strict=True):
            nodes.append(
                _new_node(name, port, bindir, templates[bindir], settings or {}, password, base_dir)
            )
        _start_all(nodes)
        _prepare_databases(nodes)
    except BaseException:
        for node in nodes:
            node.destroy()
        raise
    logger.info("created nodes %s", ", ".join(f"{n.name}:{n.port} ({n.bindir})" for n in nodes))
    return nodes


class LocalNodeSet:
    """A context manager owning the nodes of one `create_nodes` call; destroys them all on exit."""

    __slots__ = ("nodes",)

    def __init__(
        self,
        names: Sequence[str],
        *,
        versions: Sequence[int | None] | None = None,
        base_dir: Path | None = None,
        settings: Mapping[str, str] | None = None,
        password: str | None = None,
    ) -> None:
        self.nodes = create_nodes(
            names, versions=versions, base_dir=base_dir, settings=settings, password=password
        )

    def __enter__(self) -> list[LocalNode]:
        return self.nodes

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.destroy()

    def destroy(self) -> None:
        for node in self.nodes:
            node.destroy()
