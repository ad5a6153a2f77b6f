"""Which modules of `protocol/` may run compiled, and whether a compiled build is the one to use.

The decoder's hot modules (`COMPILED`) can be compiled with mypyc (`deploy/compile.py`, run by
`./dev setup` and the container build) into `_native/` beside the sources, with a stamp that names the
sources and the interpreter it was built from. `protocol/__init__.py` puts that folder first on the
package's path only when `native_dir` says so: the stamp matches the sources as they are now and this
interpreter, and `PGMESH_PURE_PYTHON` is not set. A build that is stale, partial or for another Python
is ignored, never loaded in place of newer sources. Without a build (a fresh checkout, the pyz) the
package is the same pure Python.

Must not: be compiled itself, import anything of `protocol/` (it runs before the package exists), or
fail: any doubt means pure Python.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from typing import Final

__all__ = [
    "COMPILED", "INPUTS", "NATIVE_DIR", "NO_COMPILE_ENV", "PURE_ENV", "STAMP", "native_dir", "stamp_text",
]

# The modules compiled, in `protocol/`. Not `messages` (msgspec Structs and the UNCHANGED_TOAST
# singleton: mypyc makes neither faster), `lsn` (LSN subclasses int, which mypyc cannot compile),
# `changes` (the router's readers subclass ChangeContext: a compiled class refuses interpreted
# subclasses), `errors` (raised, not run), `replication` and `native` (not on the hot path).
COMPILED: Final = ("pgoutput", "relations", "transactions")
# What a build depends on: the compiled modules, every module of `protocol/` they import (mypyc
# inlines their Final constants and relies on their types; a unit test checks this list), and this one.
INPUTS: Final = ("changes", "errors", "lsn", "messages", "native", "pgoutput", "relations", "transactions")
NATIVE_DIR: Final = "_native"
STAMP: Final = "STAMP"
PURE_ENV: Final = "PGMESH_PURE_PYTHON"  # set (not empty, not "0"): the sources, built or not
NO_COMPILE_ENV: Final = "PGMESH_NO_COMPILE"  # set: ./dev setup and the container build compile nothing


def _set(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "") not in ("", "0")


def stamp_text(folder: Path) -> str:
    """What a build of `folder`'s sources by this interpreter records: a digest of the modules it
    depends on (`INPUTS`), the Python, the extension suffix and the modules compiled."""
    digest = hashlib.sha256()
    for name in INPUTS:
        digest.update(name.encode() + b"\0" + (folder / f"{name}.py").read_bytes() + b"\0")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ""
    lines = (f"sources {digest.hexdigest()}", f"python {sys.version}", f"suffix {suffix}",
             f"modules {' '.join(COMPILED)}")
    return "\n".join(lines) + "\n"


def native_dir(folder: Path, environ: Mapping[str, str] = os.environ) -> str | None:
    """The folder of a compiled build of `folder`'s modules to import them from, or None for the
    sources (no build, a stale one, one for another interpreter, or `PGMESH_PURE_PYTHON` set)."""
    if _set(environ, PURE_ENV):
        return None
    native = folder / NATIVE_DIR
    try:
        recorded = (native / STAMP).read_text()
        current = stamp_text(folder)
    except (OSError, UnicodeDecodeError):
        return None
    return str(native) if recorded == current else None
