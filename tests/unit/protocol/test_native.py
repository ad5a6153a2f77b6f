"""Which build of the hot modules is imported: the compiled one only while it is current
(protocol.native), the sources with PGMESH_PURE_PYTHON=1 or without a build.

Takes about a second (one subprocess).
"""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import protocol
from protocol import native

ROOT = Path(protocol.__file__).parent
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")


def test_the_modules_loaded_are_what_the_stamp_says() -> None:
    current = native.native_dir(ROOT) is not None
    assert protocol.compiled == current
    for name in native.COMPILED:
        module = importlib.import_module(f"protocol.{name}")
        assert module.__file__ is not None
        assert module.__file__.endswith(SUFFIX) == current, module.__file__
    for name in ("messages", "errors", "lsn", "native"):  # never compiled
        assert str(importlib.import_module(f"protocol.{name}").__file__).endswith(".py")


def test_pure_python_when_asked() -> None:
    code = (
        "import importlib, protocol\n"
        "from protocol.native import COMPILED\n"
        "files = [importlib.import_module('protocol.' + m).__file__ for m in COMPILED]\n"
        "print(protocol.compiled, *files)\n"
    )
    env = {**os.environ, native.PURE_ENV: "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd=ROOT.parent).stdout.split()
    assert out[0] == "False"
    assert [Path(f) for f in out[1:]] == [ROOT / f"{m}.py" for m in native.COMPILED]


def _package(tmp_path: Path) -> Path:
    folder = tmp_path / "protocol"
    folder.mkdir()
    for name in native.INPUTS:
        shutil.copy(ROOT / f"{name}.py", folder / f"{name}.py")
    (folder / native.NATIVE_DIR).mkdir()
    return folder


def test_only_a_current_build_for_this_interpreter_is_used(tmp_path: Path) -> None:
    folder = _package(tmp_path)
    stamp = folder / native.NATIVE_DIR / native.STAMP
    assert native.native_dir(folder, {}) is None  # no stamp: a build that did not finish
    stamp.write_text(native.stamp_text(folder))
    assert native.native_dir(folder, {}) == str(folder / native.NATIVE_DIR)
    assert native.native_dir(folder, {native.PURE_ENV: "1"}) is None
    assert native.native_dir(folder, {native.PURE_ENV: "0"}) is not None
    other = native.stamp_text(folder).replace(f"python {sys.version}", "python 3.11.0 (another)")
    stamp.write_text(other)
    assert native.native_dir(folder, {}) is None  # built by another interpreter
    stamp.write_text(native.stamp_text(folder))
    with (folder / "pgoutput.py").open("a") as source:
        source.write("# changed after the build\n")
    assert native.native_dir(folder, {}) is None  # stale: the sources changed
    stamp.write_text(native.stamp_text(folder))
    (folder / "messages.py").unlink()
    assert native.native_dir(folder, {}) is None  # a source it depends on is gone


def _protocol_imports(name: str) -> set[str]:
    tree = ast.parse((ROOT / f"{name}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("protocol."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("protocol."))
    return found


def test_the_stamp_covers_every_module_the_compiled_ones_depend_on() -> None:
    seen: set[str] = set()
    todo = list(native.COMPILED)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += _protocol_imports(name)
    assert seen | {"native"} <= set(native.INPUTS), sorted(seen - set(native.INPUTS))
    assert set(native.COMPILED) <= set(native.INPUTS)
