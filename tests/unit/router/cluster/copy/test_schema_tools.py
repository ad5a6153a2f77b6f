"""`router.cluster.copy.schema`: which pg_dump and pg_restore a join runs (issue 19, 15 to 18).

The rule: a pg_dump refuses a server newer than itself (the donor), and the new node must load its
output, so the tools are of the newer of the two servers' major versions, or newer still. Fake bin
directories are real executables (`pg_dump --version` answers as the real one does).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from router.cluster.copy import schema
from router.cluster.copy.schema import (
    ClientDir,
    choose_client_dir,
    drop_options,
    find_client_dir,
    needed_major,
)
from router.errors import PgmeshError


def fake_client_dir(root: Path, major: int) -> Path:
    """A directory whose pg_dump and pg_restore are scripts answering `--version` with `major`."""
    bindir = root / f"pg{major}" / "bin"
    bindir.mkdir(parents=True)
    for tool in ("pg_dump", "pg_restore"):
        script = bindir / tool
        script.write_text(f"#!/bin/sh\necho '{tool} (PostgreSQL) {major}.6'\n")
        script.chmod(0o755)
    return bindir


def test_the_newer_of_donor_and_new_node_decides() -> None:
    assert needed_major(15, 18) == 18  # an 18 node joins a 15 cluster: its output loads into 18
    assert needed_major(18, 15) == 18  # a 15 pg_dump refuses an 18 donor
    assert needed_major(15, 15) == 15


def test_the_exact_version_first_then_the_oldest_newer_one() -> None:
    found = [
        ClientDir("PATH", Path("/usr/bin"), 15),
        ClientDir("wheel", Path("/w/19"), 19),
        ClientDir("wheel", Path("/w/18"), 18),
        ClientDir("Debian", Path("/d/18"), 18),
        ClientDir("empty", Path("/nothing"), None),
    ]
    assert choose_client_dir(18, found) == found[2]  # the first of the exact major, in search order
    assert choose_client_dir(17, found) == found[2]  # none of 17: the oldest newer one
    assert choose_client_dir(15, found) == found[0]
    assert choose_client_dir(20, found) is None
    assert choose_client_dir(15, []) is None


def test_pgmesh_pg_bin_is_used_when_new_enough_and_refused_with_the_versions_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = fake_client_dir(tmp_path, 15), fake_client_dir(tmp_path, 18)
    monkeypatch.setenv("PGMESH_PG_BIN", str(new))
    assert find_client_dir(18, new="c", new_major=18, donor="a", donor_major=15) == new
    monkeypatch.setenv("PGMESH_PG_BIN", str(old))
    with pytest.raises(PgmeshError) as caught:
        find_client_dir(18, new="c", new_major=18, donor="a", donor_major=15)
    text = str(caught.value)
    for part in ("node c (PostgreSQL 18)", "donor a (PostgreSQL 15)", "PostgreSQL 18 or later",
                 "they are of PostgreSQL 15", "PGMESH_PG_BIN"):
        assert part in text, text


def test_none_installed_names_nodes_versions_and_what_was_searched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    only15 = fake_client_dir(tmp_path, 15)
    monkeypatch.delenv("PGMESH_PG_BIN", raising=False)
    monkeypatch.setattr(schema, "_client_candidates", lambda: [ClientDir("PATH", only15, 15)])
    with pytest.raises(PgmeshError) as caught:
        find_client_dir(18, new="c", new_major=18, donor="a", donor_major=15)
    text = str(caught.value)
    assert text.startswith("node c: the join of node c (PostgreSQL 18) from donor a (PostgreSQL 15)"), text
    assert f"{only15} via PATH (version 15)" in text and "postgresql-client-18" in text, text
    monkeypatch.setattr(
        schema, "_client_candidates",
        lambda: [ClientDir("PATH", only15, 15), ClientDir("wheel", fake_client_dir(tmp_path, 18), 18)],
    )
    assert find_client_dir(18, new="c", new_major=18, donor="a", donor_major=15).parent.name == "pg18"


def test_the_version_probe_reads_pg_dump_and_needs_pg_restore(tmp_path: Path) -> None:
    bindir = fake_client_dir(tmp_path, 17)
    assert schema._client_major(bindir) == 17
    (bindir / "pg_restore").unlink()
    assert schema._client_major(bindir) is None


def test_column_options_the_new_node_refuses_are_dropped_and_the_others_kept() -> None:
    script = "\n".join([
        "CREATE TABLE public.acct (id integer NOT NULL, v text);",
        "ALTER TABLE ONLY public.acct ALTER COLUMN id SET (pg_attver=26506696);",
        "ALTER TABLE ONLY public.acct ALTER COLUMN v SET (n_distinct=-1, pg_attver=26506696);",
        "ALTER TABLE ONLY public.\"odd, name\" ALTER COLUMN \"x\" SET (n_distinct=5);",
    ])
    kept, dropped = drop_options(script, {"pg_attver"})
    assert dropped == 2
    assert kept.splitlines() == [
        "CREATE TABLE public.acct (id integer NOT NULL, v text);",
        "",
        "ALTER TABLE ONLY public.acct ALTER COLUMN v SET (n_distinct=-1);",
        "ALTER TABLE ONLY public.\"odd, name\" ALTER COLUMN \"x\" SET (n_distinct=5);",
    ]


def test_the_restore_leaves_out_what_pgmesh_init_puts_on_the_new_node() -> None:
    toc = {
        "3; 1 2 EVENT TRIGGER - pgmesh_ddl_capture postgres": True,
        "6; 2620 1 TRIGGER public acct pgmesh_tombstone postgres": True,
        "8; 0 0 ACL pg_catalog FUNCTION pg_logical_emit_message(boolean, text, bytea) postgres": True,
        "9; 0 0 ACL pg_catalog FUNCTION pg_replication_origin_advance(text, pg_lsn) postgres": True,
        "4; 0 0 ACL public TABLE acct postgres": False,
        "7; 2620 1 TRIGGER public acct audit_trigger postgres": False,
        "5; 0 0 ACL pg_catalog FUNCTION pg_read_file(text) postgres": False,
    }
    assert {line: bool(schema._SKIP_TOC.search(line)) for line in toc} == toc
