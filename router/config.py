"""`config.toml`: the cluster's configuration, decoded and validated with msgspec.

Owns the file format, its defaults, and the names pgmesh derives from it (slot, publication and origin
names). A wrong key, type or value is one `ConfigError` line naming the key and its line in the file.
The config is passed to whoever needs it; nothing here is global, and nothing here connects anywhere.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path
from typing import Final

import msgspec

from router.errors import ConfigError

__all__ = [
    "AdminSection",
    "ClusterSection",
    "Config",
    "NodeConfig",
    "ReplicationSection",
    "load_config",
    "parse_config",
]

NAME_RE: Final = re.compile(r"^[a-z][a-z0-9_]{0,29}$")
PGMESH_SCHEMA: Final = "pgmesh"
SYSTEM_SCHEMAS: Final = frozenset({"pg_catalog", "information_schema", "pg_toast", PGMESH_SCHEMA})


class ClusterSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str


class NodeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    dsn: str


class ReplicationSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which tables replicate, and how the appliers behave."""

    tables: list[str] = msgspec.field(default_factory=lambda: ["*.*"])
    exclude: list[str] = msgspec.field(default_factory=list)
    apply_delay_ms: int = 0
    queue_max_transactions: int = 10_000
    status_interval_ms: int = 1_000


class AdminSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    listen: str = "127.0.0.1:8787"


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    cluster: ClusterSection
    nodes: list[NodeConfig]
    replication: ReplicationSection = msgspec.field(default_factory=ReplicationSection)
    admin: AdminSection = msgspec.field(default_factory=AdminSection)

    # Names pgmesh installs on the nodes, derived from the cluster name.
    @property
    def slot_name(self) -> str:
        return f"pgmesh_{self.cluster.name}"

    @property
    def publication_name(self) -> str:
        return f"pgmesh_{self.cluster.name}"

    def origin_name(self, source: str) -> str:
        """The replication origin, on a target, for changes coming from `source`."""
        return f"pgmesh_{self.cluster.name}_{source}"

    def node(self, name: str) -> NodeConfig:
        for node in self.nodes:
            if node.name == name:
                return node
        known = ", ".join(n.name for n in self.nodes)
        raise ConfigError(f"no node named {name!r} in the config (nodes: {known})")

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def replicates(self, schema: str, table: str) -> bool:
        """Whether `schema.table` is in the replicated set."""
        if schema in SYSTEM_SCHEMAS or schema.startswith("pg_"):
            return False
        qualified = f"{schema}.{table}"
        rep = self.replication
        if not any(_match(p, qualified) for p in rep.tables):
            return False
        return not any(_match(p, qualified) for p in rep.exclude)

    @property
    def admin_host_port(self) -> tuple[str, int]:
        host, _, port = self.admin.listen.rpartition(":")
        return host or "127.0.0.1", int(port)


def _match(pattern: str, qualified: str) -> bool:
    if "." not in pattern:
        pattern = f"*.{pattern}"
    return fnmatch.fnmatchcase(qualified, pattern)


def _line_of(text: str, path: str) -> int | None:
    """Best effort: the line that sets the key a msgspec path names (`$.nodes[1].name`, `$.admin.listen`)."""
    segments = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)(?:\[(\d+)\])?", path)
    if not segments:
        return None
    lines = text.splitlines()
    start = 0
    for key, index in segments[:-1]:
        if index:  # the (index+1)-th [[key]] table
            header = re.compile(rf"^\s*\[\[\s*{re.escape(key)}\s*\]\]")
            headers = [i for i, line in enumerate(lines) if header.match(line)]
            if int(index) < len(headers):
                start = headers[int(index)]
        else:
            for i in range(start, len(lines)):
                if re.match(rf"^\s*\[\s*{re.escape(key)}\s*\]", lines[i]):
                    start = i
                    break
    last, last_index = segments[-1]
    if last_index:  # the path names a whole [[key]] table: its header line
        header = re.compile(rf"^\s*\[\[\s*{re.escape(last)}\s*\]\]")
        headers = [i for i, line in enumerate(lines) if header.match(line)]
        if int(last_index) < len(headers):
            return headers[int(last_index)] + 1
    wanted = re.compile(rf"^\s*(\[\[?\s*)?{re.escape(last)}\b")
    for i in range(start, len(lines)):
        if wanted.match(lines[i]):
            return i + 1
    return None


def _validate(config: Config) -> None:
    def bad(message: str, key: str) -> ConfigError:
        return ConfigError(f"{key}: {message}")

    if not NAME_RE.match(config.cluster.name):
        raise bad("use lower-case letters, digits and _ (start with a letter, at most 30)", "cluster.name")
    if len(config.nodes) < 2:
        raise bad("a cluster needs at least two [[nodes]]", "nodes")
    seen: set[str] = set()
    for i, node in enumerate(config.nodes):
        if not NAME_RE.match(node.name):
            raise bad(f"node name {node.name!r}: use lower-case letters, digits and _", f"nodes[{i}].name")
        if node.name in seen:
            raise bad(f"node name {node.name!r} appears twice", f"nodes[{i}].name")
        seen.add(node.name)
        if not node.dsn.strip():
            raise bad("empty dsn", f"nodes[{i}].dsn")
    rep = config.replication
    if rep.apply_delay_ms < 0:
        raise bad("must be >= 0", "replication.apply_delay_ms")
    if rep.queue_max_transactions < 1:
        raise bad("must be >= 1", "replication.queue_max_transactions")
    if rep.status_interval_ms < 10:
        raise bad("must be >= 10", "replication.status_interval_ms")
    if not rep.tables:
        raise bad("must list at least one pattern", "replication.tables")
    _host, sep, port = config.admin.listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise bad(f"{config.admin.listen!r} is not HOST:PORT", "admin.listen")


def parse_config(text: str, *, source: str = "config.toml") -> Config:
    """Decode and validate the text of a config file."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    try:
        config = msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        message = str(exc)
        path = message.rpartition(" - at `")[2].rstrip("`") if " - at `" in message else ""
        key = path.removeprefix("$.") or "?"
        line = _line_of(text, path)
        where = f"{source}:{line}" if line else source
        detail = message.partition(" - at `")[0]
        if detail.startswith("Object contains unknown field"):
            unknown = detail.split("`")[1] if "`" in detail else "?"
            line = _line_of(text, f"{path}.{unknown}" if path else unknown)
            where = f"{source}:{line}" if line else source
            scope = f" in [{key}]" if key != "?" else ""
            raise ConfigError(f"{where}: unknown key {unknown!r}{scope}") from None
        raise ConfigError(f"{where}: {key}: {detail}") from None
    try:
        _validate(config)
    except ConfigError as exc:
        key = exc.message.partition(":")[0]
        line = _line_of(text, "$." + key)
        where = f"{source}:{line}" if line else source
        raise ConfigError(f"{where}: {exc.message}") from None
    return config


def load_config(path: str | Path) -> Config:
    """Read, decode and validate `config.toml`."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {file}: {exc.strerror}") from None
    return parse_config(text, source=str(file))
