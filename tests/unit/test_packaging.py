"""How the package is declared (pyproject.toml) and what an install of it recorded.

Owns: that the license is the SPDX expression setuptools asks for (the `{ text = ... }` table makes
every `pip install` print a deprecation warning), that the build requires a setuptools that reads it,
and that the installed metadata carries it. Must not build or install anything.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _minimum(requirement: str) -> tuple[int, ...]:
    match = re.fullmatch(r"\s*setuptools\s*>=\s*([\d.]+)\s*", requirement)
    assert match, f"the setuptools requirement {requirement!r} has no plain lower bound"
    return tuple(int(part) for part in match.group(1).split("."))


def test_the_license_is_an_spdx_expression_that_the_build_can_read() -> None:
    assert PYPROJECT["project"]["license"] == "PostgreSQL"
    (setuptools,) = [r for r in PYPROJECT["build-system"]["requires"] if r.strip().startswith("setuptools")]
    assert _minimum(setuptools) >= (77,)  # the first setuptools that takes `license` as a string


def test_the_installed_package_records_the_license_expression() -> None:
    """Fails on a virtualenv installed from an older pyproject.toml: `./dev` reinstalls when it changes."""
    metadata = importlib.metadata.metadata("pgmesh")
    assert metadata["License-Expression"] == "PostgreSQL"
