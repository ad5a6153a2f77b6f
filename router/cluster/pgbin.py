"""Where the PostgreSQL (>= 15) programs are: `find_pg_bindir`.

Owns the search for a binary directory holding `postgres`, `initdb` and `pg_ctl` of PostgreSQL 15 or
later: $PGMESH_PG_BINDIR, `pg_config --bindir`, the highest /usr/lib/postgresql/*/bin, then PATH.
Used by `pgmesh join` (pg_dump and pg_restore beside the server) and by the throw-away clusters of
`router.testing.localnodes`.

Must not: import anything outside the standard library (`router.testing.localnodes` imports it and
stays free of the rest of pgmesh), start or stop a server, or run anything but `postgres --version`
and `pg_config --bindir`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Final

__all__ = ["MIN_MAJOR", "PgBinError", "find_pg_bindir"]

MIN_MAJOR: Final = 15


class PgBinError(RuntimeError):
    """No usable PostgreSQL (>= 15) binary directory was found; the text says where it looked."""


def _major_version(bindir: Path) -> int | None:
    """Major version of the `postgres` binary in `bindir`, or None when it is not a usable bindir."""
    for tool in ("postgres", "initdb", "pg_ctl"):
        if not os.access(bindir / tool, os.X_OK):
            return None
    try:
        out = subprocess.run(
            [str(bindir / "postgres"), "--version"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"\(PostgreSQL\)\s+(\d+)", out)
    return int(match.group(1)) if match else None


def _candidate_bindirs() -> Iterator[tuple[str, Path]]:
    """Where to look, in order, as (how it was found, directory)."""
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            if out:
                yield "pg_config --bindir", Path(out)
        except (OSError, subprocess.SubprocessError):
            pass
    versioned: list[tuple[int, Path]] = []
    for path in Path("/usr/lib/postgresql").glob("*/bin"):
        if path.parent.name.isdigit():
            versioned.append((int(path.parent.name), path))
    for _, path in sorted(versioned, reverse=True):
        yield "/usr/lib/postgresql/*/bin", path
    on_path = shutil.which("pg_ctl")
    if on_path:
        yield "PATH", Path(on_path).resolve().parent


def find_pg_bindir() -> Path:
    """The PostgreSQL (>= 15) binary directory: $PGMESH_PG_BINDIR, `pg_config --bindir`,
    the highest /usr/lib/postgresql/*/bin, then PATH."""
    explicit = os.environ.get("PGMESH_PG_BINDIR")
    if explicit:
        major = _major_version(Path(explicit))
        if major is None or major < MIN_MAJOR:
            found = "not a usable bindir" if major is None else f"version {major}"
            raise PgBinError(
                f"PGMESH_PG_BINDIR={explicit!r} does not hold postgres, initdb and pg_ctl of "
                f"PostgreSQL >= {MIN_MAJOR} ({found}); fix or unset it"
            )
        return Path(explicit)
    searched: list[str] = ["$PGMESH_PG_BINDIR (unset)"]
    for how, path in _candidate_bindirs():
        major = _major_version(path)
        searched.append(f"{path} via {how} (version {major})")
        if major is not None and major >= MIN_MAJOR:
            return path
    if shutil.which("pg_ctl") is None:
        searched.append("PATH (no pg_ctl)")
    raise PgBinError(
        f"no PostgreSQL >= {MIN_MAJOR} binaries (postgres, initdb, pg_ctl) found; searched: "
        + "; ".join(searched)
        + ". Install PostgreSQL 15+ or set PGMESH_PG_BINDIR."
    )
