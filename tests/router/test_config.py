"""`router.config`: decoding, defaults, derived names, the replicated-set globs, and one-line errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from router.config import Config, load_config, parse_config
from router.errors import ConfigError

MINIMAL = """\
[cluster]
name = "demo"

[[nodes]]
name = "a"
dsn = "host=10.0.0.1 dbname=app"

[[nodes]]
name = "b"
dsn = "host=10.0.0.2 dbname=app"
"""


def with_replication(tables: list[str], exclude: list[str] | None = None) -> Config:
    text = MINIMAL + f"\n[replication]\ntables = {tables!r}\n".replace("'", '"')
    if exclude is not None:
        text += f"exclude = {exclude!r}\n".replace("'", '"')
    return parse_config(text)


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_minimal_file_decodes_with_defaults() -> None:
    config = parse_config(MINIMAL)
    assert config.cluster.name == "demo"
    assert config.node_names == ["a", "b"]
    assert config.node("b").dsn == "host=10.0.0.2 dbname=app"
    assert config.replication.tables == ["*.*"]
    assert config.replication.exclude == []
    assert config.replication.apply_delay_ms == 0
    assert config.replication.queue_max_transactions == 10_000
    assert config.replication.status_interval_ms == 1_000
    assert config.admin.listen == "127.0.0.1:8787"
    assert config.admin_host_port == ("127.0.0.1", 8787)


def test_load_config_reads_a_file_and_names_it(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(MINIMAL)
    assert load_config(path).cluster.name == "demo"
    path.write_text(MINIMAL.replace('name = "b"', 'name = "a"'))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:9: nodes\[1\]\.name"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")


def test_derived_names() -> None:
    config = parse_config(MINIMAL)
    assert config.slot_name == "pgmesh_demo"
    assert config.publication_name == "pgmesh_demo"
    assert config.origin_name("a") == "pgmesh_demo_a"
    assert config.origin_name("b") != config.origin_name("a")


def test_unknown_node_is_a_config_error_listing_the_nodes() -> None:
    with pytest.raises(ConfigError, match=r"no node named 'z'.*a, b"):
        parse_config(MINIMAL).node("z")


def test_default_replicates_every_user_table() -> None:
    config = parse_config(MINIMAL)
    assert config.replicates("public", "orders")
    assert config.replicates("sales", "items")


@pytest.mark.parametrize("schema", ["pg_catalog", "information_schema", "pg_toast", "pgmesh", "pg_temp_3"])
def test_system_and_pgmesh_schemas_never_replicate(schema: str) -> None:
    assert not parse_config(MINIMAL).replicates(schema, "anything")
    assert not with_replication([f"{schema}.*", "*"]).replicates(schema, "anything")


def test_schema_glob() -> None:
    config = with_replication(["public.*"])
    assert config.replicates("public", "orders")
    assert not config.replicates("sales", "orders")


def test_bare_name_means_any_schema() -> None:
    config = with_replication(["orders", "item*"])
    assert config.replicates("public", "orders")
    assert config.replicates("sales", "orders")
    assert config.replicates("sales", "items")
    assert not config.replicates("public", "customers")
    assert not config.replicates("public", "orders_archive")


def test_exclude_wins() -> None:
    config = with_replication(["public.*", "sales.orders"], exclude=["*_log", "public.tmp*", "sales.orders"])
    assert config.replicates("public", "orders")
    assert not config.replicates("public", "audit_log")
    assert not config.replicates("public", "tmp_import")
    assert not config.replicates("sales", "orders")


def test_globs_are_case_sensitive_like_quoted_identifiers() -> None:
    config = with_replication(["public.orders"])
    assert not config.replicates("public", "Orders")


# Each case: how to change MINIMAL (or the text appended to it), the key the message must name, its line.
BAD = [
    ("unknown top-level key", "extra = 1\n" + MINIMAL, "unknown key 'extra'", 1),
    ("unknown key in [cluster]", MINIMAL.replace('"demo"\n', '"demo"\ncolour = "red"\n'), "'colour'", 3),
    ("unknown key in a node", MINIMAL.replace('app"\n\n', 'app"\nport = 5\n\n', 1), "'port'", 7),
    ("unknown key in the 2nd node", MINIMAL + "port = 5\n", "'port' in [nodes[1]]", 11),
    ("unknown [section]", MINIMAL + "\n[replica]\ntables = []\n", "unknown key 'replica'", 12),
    ("unknown key in [admin]", MINIMAL + '\n[admin]\nlisten = "h:1"\nname = "x"\n', "'name' in [admin]", 14),
    ("wrong type", MINIMAL + '\n[replication]\napply_delay_ms = "10"\n', "replication.apply_delay_ms", 13),
    ("wrong type in a list", MINIMAL + "\n[replication]\ntables = [1]\n", "replication.tables", 13),
    ("wrong type of node name", MINIMAL.replace('name = "b"', "name = 2"), "nodes[1].name", 9),
    ("missing dsn", MINIMAL.replace('dsn = "host=10.0.0.2 dbname=app"\n', ""), "`dsn`", 8),
    ("negative delay", MINIMAL + "\n[replication]\napply_delay_ms = -1\n", "replication.apply_delay_ms", 13),
    ("zero queue", MINIMAL + "\n[replication]\nqueue_max_transactions = 0\n", "queue_max_transactions", 13),
    ("tiny status", MINIMAL + "\n[replication]\nstatus_interval_ms = 1\n", "status_interval_ms", 13),
    ("no tables", MINIMAL + "\n[replication]\ntables = []\n", "replication.tables", 13),
    ("bad listen", MINIMAL + '\n[admin]\nlisten = "8787"\n', "admin.listen", 13),
    (
        "duplicate node",
        MINIMAL.replace('name = "b"', 'name = "a"'),
        "nodes[1].name: node name 'a' appears twice",
        9,
    ),
    ("bad node name", MINIMAL.replace('name = "b"', 'name = "Node-B"'), "nodes[1].name", 9),
    ("bad cluster name", MINIMAL.replace('"demo"', '"my cluster"'), "cluster.name", 2),
    ("empty dsn", MINIMAL.replace('"host=10.0.0.2 dbname=app"', '" "'), "nodes[1].dsn", 10),
    ("one node", MINIMAL.split('[[nodes]]\nname = "b"')[0], "at least two", 4),
]


@pytest.mark.parametrize(("text", "names", "line"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_config_is_one_line_naming_key_and_line(text: str, names: str, line: int) -> None:
    message = error_of(text)
    assert names in message
    assert message.startswith(f"config.toml:{line}: "), message


def test_missing_cluster_section_names_it() -> None:
    message = error_of(MINIMAL.replace('[cluster]\nname = "demo"\n', ""))
    assert message.startswith("config.toml")
    assert "cluster" in message


def test_invalid_toml_gives_its_line() -> None:
    message = error_of(MINIMAL + "\nbroken = \n")
    assert message.startswith("config.toml: not valid TOML")
    assert "line 12" in message


def test_errors_name_the_source_file() -> None:
    with pytest.raises(ConfigError, match=r"^/etc/pgmesh\.toml:2: cluster\.name"):
        parse_config(MINIMAL.replace('"demo"', '"Demo"'), source="/etc/pgmesh.toml")


def test_errors_never_echo_a_dsn() -> None:
    text = MINIMAL.replace('dsn = "host=10.0.0.2 dbname=app"', 'dsn = "host=x password=s3cret"\nport = 1')
    assert "s3cret" not in error_of(text)
