"""`router.cluster.checks` on facts no local server can show (no server): Debian's plugin allow-list, and
a node with every replication slot taken. The checks against real nodes: tests/integration/test_init.py.
"""

from __future__ import annotations

import msgspec

from router.cluster.checks import NodeFacts, _node_checks
from router.config.model import parse_config

CONFIG = """
[cluster]
name = "pure"

[[nodes]]
name = "a"
dsn = "host=x"

[[nodes]]
name = "b"
dsn = "host=y"

[replication]
tables = ["*.*"]
exclude = []
"""


def facts(**settings: str) -> NodeFacts:
    base = {"server_version": "15.20", "server_version_num": "150020", "wal_level": "logical"}
    base |= {"track_commit_timestamp": "on", "max_replication_slots": "2", "max_wal_senders": "2"}
    return NodeFacts(base | settings, "postgres", True, 2, None, "app", 1, {})


def test_output_plugin_libraries_and_slot_counts_without_a_server() -> None:
    """Checks a local 15.18 cannot show: Debian's plugin allow-list, and a node with every slot taken."""
    config = parse_config(CONFIG)
    checks = {c.check: c for c in _node_checks("a", facts(output_plugin_libraries="test_decoding"), config)}
    assert not checks["output_plugin_libraries"].ok
    assert "pgoutput" in (checks["output_plugin_libraries"].hint or "")
    assert not checks["replication_slots"].ok  # 2 of 2 used, pgmesh's own slot not among them
    assert "at least 3" in (checks["replication_slots"].hint or "")
    assert checks["wal_senders"].ok
    checks = {
        c.check: c for c in _node_checks("a", facts(output_plugin_libraries="pgoutput, wal2json"), config)
    }
    assert checks["output_plugin_libraries"].ok
    assert "output_plugin_libraries" not in {c.check for c in _node_checks("a", facts(), config)}


def test_room_for_the_replication_origins_is_checked_per_version() -> None:
    """pgmesh may hold progress for an origin per other node, its early apply twin, and the recorder's:
    2 * (N - 1) + 1 here. 18+ sizes them with max_active_replication_origins (default 10), 15-17 with
    max_replication_slots; origins of other tools count against it."""
    config = parse_config(CONFIG)  # two nodes: 3 origins each
    assert config.origins_per_node() == 3
    checks = {c.check: c for c in _node_checks("a", facts(max_replication_slots="3"), config)}
    assert checks["replication_origins"].ok
    eighteen = {"server_version": "18.1", "server_version_num": "180001"}
    eighteen["max_active_replication_origins"] = "3"
    busy = msgspec.structs.replace(facts(**eighteen), origins_used=1)
    check = {c.check: c for c in _node_checks("a", busy, config)}["replication_origins"]
    assert not check.ok
    assert "raise max_active_replication_origins to at least 4" in (check.hint or "")
