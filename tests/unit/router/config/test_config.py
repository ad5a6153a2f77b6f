"""`router.config.model`: decoding, defaults, derived names, the replicated-set globs, and one-line errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from router.config.model import Config, ConflictSection, TableSection, load_config, parse_config
from router.conflicts.resolve import ConflictType, Policy, Resolver
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
    assert config.replication.node_timeout_ms == 10_000
    assert config.replication.spill_mb == 8 and config.replication.spool_dir == ""
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
    ("tiny node timeout", MINIMAL + "\n[replication]\nnode_timeout_ms = 10\n", "node_timeout_ms", 13),
    (
        "unknown synchronous_commit",
        MINIMAL + '\n[replication]\napply_synchronous_commit = "yes"\n',
        "replication.apply_synchronous_commit: must be one of off, local, remote_write, on, remote_apply",
        13,
    ),
    ("negative spill", MINIMAL + "\n[replication]\nspill_mb = -1\n", "replication.spill_mb", 13),
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


# ---------------------------------------------------------------------------------------------------------
# [conflicts] and [[tables]]

CONFLICTS = (
    MINIMAL
    + """
[conflicts]
resolver = "last_update_wins"
node_priority = ["b", "a"]
window_ms = 0
allow_divergence = true

[conflicts.types]
update_missing = "keep_local"
delete_origin_differs = "first_update_wins"

[[tables]]
name = "public.inventory"
resolver = "node_priority"
delta_columns = ["quantity", "reserved"]

[tables.types]
delete_missing = "error"

[[tables]]
name = "orders"
resolver = "shop.rules:orders_resolver"

[[tables]]
name = "sales.events"

[tables.types]
insert_exists = "apply_remote"
"""
)


def test_conflict_sections_default_to_last_update_wins_everywhere() -> None:
    config = parse_config(MINIMAL)
    assert config.conflicts == ConflictSection()
    assert config.conflicts.resolver == "last_update_wins"
    assert config.conflicts.node_priority == [] and config.conflicts.window_ms == 0
    assert config.conflicts.types == {}
    assert config.tables == []
    for kind in ConflictType:
        assert config.policy("public", "anything", kind) == Policy(Resolver.LAST_UPDATE_WINS)
    assert config.delta_columns("public", "anything") == ()


def test_conflict_sections_decode() -> None:
    config = parse_config(CONFLICTS)
    assert config.conflicts.node_priority == ["b", "a"]
    assert config.conflicts.window_ms == 0 and config.conflicts.allow_divergence
    assert config.conflicts.types == {
        "update_missing": "keep_local",
        "delete_origin_differs": "first_update_wins",
    }
    assert config.tables[0] == TableSection(
        "public.inventory", "node_priority", ["quantity", "reserved"], {"delete_missing": "error"}
    )
    assert config.tables[1] == TableSection("orders", "shop.rules:orders_resolver")
    assert config.tables[2].types == {"insert_exists": "apply_remote"} and config.tables[2].resolver is None
    assert [t.qualified for t in config.tables] == [
        ("public", "inventory"),
        ("public", "orders"),
        ("sales", "events"),
    ]
    assert config.table("public", "orders") is config.tables[1]
    assert config.table("sales", "orders") is None
    assert config.delta_columns("public", "inventory") == ("quantity", "reserved")
    assert config.delta_columns("public", "orders") == ()


def resolver_of(config: Config, table: str, kind: ConflictType) -> str:
    schema, name = table.split(".")
    policy = config.policy(schema, name, kind)
    return policy.custom or policy.resolver.value


@pytest.mark.parametrize(
    ("table", "kind", "expected"),
    [
        # table.types[kind] > table.resolver
        ("public.inventory", ConflictType.DELETE_MISSING, "error"),
        # table.resolver > conflicts.types[kind] > conflicts.resolver
        ("public.inventory", ConflictType.UPDATE_MISSING, "node_priority"),
        ("public.inventory", ConflictType.INSERT_EXISTS, "node_priority"),
        ("public.orders", ConflictType.UPDATE_MISSING, "shop.rules:orders_resolver"),
        # no table resolver: table.types[kind] > conflicts.types[kind] > conflicts.resolver
        ("sales.events", ConflictType.INSERT_EXISTS, "apply_remote"),
        ("sales.events", ConflictType.UPDATE_MISSING, "keep_local"),
        ("sales.events", ConflictType.UPDATE_ORIGIN_DIFFERS, "last_update_wins"),
        # a table without an entry: the cluster's rules
        ("public.other", ConflictType.DELETE_ORIGIN_DIFFERS, "first_update_wins"),
        ("public.other", ConflictType.DELETE_MISSING, "last_update_wins"),
        ("inventory.inventory", ConflictType.DELETE_MISSING, "last_update_wins"),  # another schema
    ],
)
def test_policy_precedence(table: str, kind: ConflictType, expected: str) -> None:
    assert resolver_of(parse_config(CONFLICTS), table, kind) == expected


def test_policy_carries_priority_window_and_custom_function() -> None:
    config = parse_config(CONFLICTS)
    assert config.policy("public", "inventory", "update_origin_differs") == Policy(
        Resolver.NODE_PRIORITY, ("b", "a"), 0
    )
    custom = config.policy("public", "orders", ConflictType.UPDATE_ORIGIN_DIFFERS)
    assert custom == Policy(Resolver.CUSTOM, ("b", "a"), 0, "shop.rules:orders_resolver")
    with pytest.raises(ValueError):
        config.policy("public", "orders", "no_such_conflict")


def test_custom_resolvers_are_not_imported_at_config_time() -> None:
    config = parse_config(MINIMAL + '\n[conflicts]\nresolver = "no_such_package.rules:pick"\n')
    assert config.policy("public", "t", "insert_exists").custom == "no_such_package.rules:pick"


def test_node_priority_only_needed_when_some_resolver_uses_it() -> None:
    diverging = '\n[conflicts]\nallow_divergence = true\n[[tables]]\nname = "t"\nresolver = "keep_local"\n'
    parse_config(MINIMAL + diverging)
    message = error_of(MINIMAL + '\n[[tables]]\nname = "t"\nresolver = "node_priority"\n')
    assert message.startswith("config.toml:14: tables[0].resolver: node_priority needs"), message


def test_resolvers_that_can_diverge_are_refused_naming_the_key() -> None:
    for resolver in ("keep_local", "apply_remote", "first_update_wins"):
        message = error_of(MINIMAL + f'\n[[tables]]\nname = "t"\nresolver = "{resolver}"\n')
        expected = f"config.toml:14: tables[0].resolver: {resolver} (t) can leave nodes"
        assert message.startswith(expected), message
        assert "allow_divergence = true" in message
    message = error_of(conflicts('update_origin_differs = "apply_remote"\n', "conflicts.types"))
    assert message.startswith("config.toml:13: conflicts.types.update_origin_differs: apply_remote"), message
    message = error_of(conflicts('resolver = "keep_local"\n'))
    assert message.startswith("config.toml:13: conflicts.resolver: keep_local (every table)"), message


def test_resolvers_that_decide_like_last_update_wins_for_a_type_are_accepted() -> None:
    """delete_missing: every built-in resolver does nothing; update_missing: all but keep_local insert."""
    body = 'delete_missing = "keep_local"\nupdate_missing = "apply_remote"\n'
    config = parse_config(conflicts(body, "conflicts.types"))
    assert config.divergent_resolvers() == []
    message = error_of(conflicts('update_missing = "keep_local"\n', "conflicts.types"))
    assert message.startswith("config.toml:13: conflicts.types.update_missing: keep_local"), message


def test_allow_divergence_accepts_them_and_lists_them() -> None:
    text = conflicts('allow_divergence = true\n[conflicts.types]\ninsert_exists = "keep_local"\n') + (
        '\n[[tables]]\nname = "t"\nresolver = "apply_remote"\n'
    )
    config = parse_config(text)
    assert config.divergent_resolvers() == [
        "conflicts.types.insert_exists = keep_local (every table)",
        "tables[0].resolver = apply_remote (t)",
    ]
    assert parse_config(MINIMAL).divergent_resolvers() == []
    assert parse_config(CONFLICTS).divergent_resolvers() == [
        "conflicts.types.update_missing = keep_local (every table)",
        "conflicts.types.delete_origin_differs = first_update_wins (every table)",
        "tables[2].types.insert_exists = apply_remote (sales.events)",
    ]


def test_a_node_priority_window_is_refused_until_its_hold_is_built() -> None:
    message = error_of(conflicts('resolver = "node_priority"\nnode_priority = ["a", "b"]\nwindow_ms = 50\n'))
    assert message.startswith("config.toml:15: conflicts.window_ms: node_priority's hold"), message
    assert "use window_ms = 0" in message
    body = 'resolver = "node_priority"\nnode_priority = ["a", "b"]\nwindow_ms = 0\n'
    config = parse_config(conflicts(body))
    assert config.policy("public", "t", "insert_exists").window_us == 0


def test_the_conflict_module_does_not_import_the_config() -> None:
    source = (Path(__file__).parents[4] / "router" / "conflicts" / "resolve.py").read_text()
    assert "router.config" not in source


def conflicts(body: str, section: str = "conflicts") -> str:
    """MINIMAL with a [section] (line 12) whose keys start on line 13."""
    return MINIMAL + f"\n[{section}]\n{body}"


def tables(*entries: str) -> str:
    """MINIMAL with one [[tables]] block per entry (the first header on line 12)."""
    return MINIMAL + "".join(f"\n[[tables]]\n{entry}" for entry in entries)


TYPES = tables('name = "inventory"\n', 'name = "orders"\n[tables.types]\n')  # types keys from line 17
NOT_REPLICATED = MINIMAL + '\n[replication]\nexclude = ["t"]\n\n[[tables]]\nname = "t"\n'
BAD_CONFLICTS = [
    ("unknown resolver", conflicts('resolver = "lww"\n'), "conflicts.resolver: unknown resolver 'lww'", 13),
    ("custom is spelled as a function", conflicts('resolver = "custom"\n'), "conflicts.resolver", 13),
    ("bad custom", conflicts('window_ms = 1\nresolver = "rules:"\n'), "expected 'module:function'", 14),
    ("unknown key", conflicts("window = 5\n"), "unknown key 'window' in [conflicts]", 13),
    ("negative window", conflicts("window_ms = -1\n"), "conflicts.window_ms: must be >= 0", 13),
    ("wrong window type", conflicts('window_ms = "1s"\n'), "conflicts.window_ms", 13),
    ("unknown priority node", conflicts('node_priority = ["a", "z"]\n'), "'z' is not a configured node", 13),
    ("priority node twice", conflicts('node_priority = ["a", "a"]\n'), "'a' is listed twice", 13),
    ("priority needed", conflicts('resolver = "node_priority"\n'), "node_priority needs", 13),
    (
        "unknown conflict type",
        conflicts('update_missing = "error"\nupdate_gone = "error"\n', "conflicts.types"),
        "conflicts.types.update_gone: unknown conflict type",
        14,
    ),
    ("bad type resolver", conflicts('delete_missing = "x"\n', "conflicts.types"), "types.delete_missing", 13),
    ("type resolver not text", conflicts("delete_missing = 1\n", "conflicts.types"), "conflicts.types", 12),
    ("table without name", tables('resolver = "error"\n'), "tables[0]: Object missing required field", 12),
    ("unknown table key", TYPES.replace('"orders"\n', '"orders"\ncolour = 1\n'), "'colour' in [tables[", 17),
    ("table twice", tables('name = "t"\n', 'name = "public.t"\n'), "tables[1].name: table public.t", 16),
    ("bad table name", tables('name = "a.b.c"\n'), "tables[0].name: 'a.b.c' is not schema.table", 13),
    ("table not replicated", NOT_REPLICATED, "tables[0].name: public.t is not replicated", 16),
    ("table resolver", TYPES.replace('"orders"\n', '"orders"\nresolver = "new"\n'), "tables[1].resolver", 17),
    ("table type", TYPES + 'delete_missing = "error"\nupsert = "x"\n', "tables[1].types.upsert: unknown", 19),
    ("table type resolver", TYPES + 'delete_missing = "nope"\n', "tables[1].types.delete_missing: un", 18),
    ("table type priority", TYPES + 'delete_missing = "node_priority"\n', "node_priority needs", 18),
    ("delta column twice", tables('name = "t"\ndelta_columns = ["q", "q"]\n'), "tables[0].delta_columns", 14),
    ("delta columns not a list", tables('name = "t"\ndelta_columns = "q"\n'), "[0].delta_columns", 14),
]


@pytest.mark.parametrize(
    ("text", "names", "line"), [c[1:] for c in BAD_CONFLICTS], ids=[c[0] for c in BAD_CONFLICTS]
)
def test_bad_conflict_config_is_one_line_naming_key_and_line(text: str, names: str, line: int) -> None:
    message = error_of(text)
    assert names in message, message
    assert message.startswith(f"config.toml:{line}: "), message


def test_status_keeps_saying_that_divergence_is_allowed() -> None:
    from router.ops.control import render_status
    from router.service.supervisor import StatusReport

    config = parse_config(conflicts('allow_divergence = true\nresolver = "apply_remote"\n'))
    text = render_status(StatusReport("demo", True, [], [], config.divergent_resolvers()))
    assert text.splitlines()[-1] == (
        "DIVERGENCE ALLOWED ([conflicts] allow_divergence = true): nodes may keep different rows under"
        " conflicts.resolver = apply_remote (every table)"
    )
    assert "DIVERGENCE" not in render_status(StatusReport("demo", True, [], []))


def test_synchronous_per_cluster_and_per_node() -> None:
    config = parse_config(MINIMAL)
    assert config.synchronous("a") == 0 and config.standby_name == "pgmesh_demo"
    text = MINIMAL.replace('name = "b"', 'name = "b"\nsynchronous = 0')
    config = parse_config(text + "\n[replication]\nsynchronous = 1\n")
    assert config.synchronous("a") == 1 and config.synchronous("b") == 0


def test_synchronous_beyond_the_other_nodes_is_refused_with_its_line() -> None:
    message = error_of(MINIMAL + "\n[replication]\nsynchronous = 2\n")
    assert "replication.synchronous: must be between 0 and 1" in message and "config.toml:" in message
    text = MINIMAL.replace('name = "b"', 'name = "b"\nsynchronous = -1')
    assert "nodes[1].synchronous: must be between 0 and 1" in error_of(text)


def test_ha_defaults_and_bounds() -> None:
    ha = parse_config(MINIMAL).ha
    assert (ha.enabled, ha.lease_s, ha.drift, ha.margin_s) == (False, 10.0, 0.01, 1.0)
    assert parse_config(MINIMAL + "\n[ha]\nenabled = true\nlease_s = 3\nmargin_s = 0.5\n").ha.enabled
    # the holder must keep at least half its lease: a margin eating it would make it stop at once
    with pytest.raises(ConfigError, match=r"ha\.margin_s"):
        parse_config(MINIMAL + "\n[ha]\nenabled = true\nlease_s = 2\nmargin_s = 1.5\n")
    with pytest.raises(ConfigError, match=r"ha\.drift"):
        parse_config(MINIMAL + "\n[ha]\ndrift = 0.6\n")
