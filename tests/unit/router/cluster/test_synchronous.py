"""Synchronous replication's pure parts: reading synchronous_standby_names, the appliers' commit mode."""

from __future__ import annotations

import pytest

from router.cluster.synchronous import names_router
from router.config.model import parse_config

CONFIG = """\
[cluster]
name = "demo"

[[nodes]]
name = "a"
dsn = "host=10.0.0.1 dbname=app"

[[nodes]]
name = "b"
dsn = "host=10.0.0.2 dbname=app"
synchronous = 0

[[nodes]]
name = "c"
dsn = "host=10.0.0.3 dbname=app"
"""


@pytest.mark.parametrize(("setting", "named"), [
    ("pgmesh_demo", True), ('"pgmesh_demo"', True), ("FIRST 2 (pgmesh_demo, s1)", True),
    ("ANY 1 (s1, \"pgmesh_demo\")", True), ("*", True), ("s1, s2", False), ("2 (s1, s2)", False), ("", False),
])
def test_names_router(setting: str, named: bool) -> None:
    assert names_router(setting, "pgmesh_demo") is named


def test_apply_commit_mode_is_durable_and_never_waits_for_the_router() -> None:
    asynchronous = parse_config(CONFIG)
    assert [asynchronous.apply_synchronous_commit(n) for n in "abc"] == ["off", "off", "off"]
    config = parse_config(CONFIG + "\n[replication]\nsynchronous = 1\n")
    assert [config.apply_synchronous_commit(n) for n in "abc"] == ["local", "local", "local"]
    strict = parse_config(CONFIG + '\n[replication]\nsynchronous = 1\n'
                          'apply_synchronous_commit = "remote_apply"\n')
    # on b (k = 0) its physical standbys are waited for; a and c have the router as standby: local
    assert [strict.apply_synchronous_commit(n) for n in "abc"] == ["local", "remote_apply", "local"]
