"""Compile the decoder's hot modules (`protocol.native.COMPILED`) with mypyc, into `protocol/_native/`.

    python deploy/compile.py            # the protocol package this interpreter imports (./dev setup)
    python deploy/compile.py --force    # rebuild even when the build is current

Run by `./dev setup` (the repository's package, installed editable) and by the container build (the
package installed in the image's virtualenv, with mypy put on PYTHONPATH for the build only). It does
nothing when the build in `_native/` is current (its stamp, `protocol.native.stamp_text`, matches the
sources and this interpreter) or when `PGMESH_NO_COMPILE` is set. Otherwise it builds in a temporary
folder (gcc, the interpreter's headers, mypy with mypyc, setuptools), checks that a fresh interpreter
imports the result, and only then puts it in place with its stamp, computed before the sources were
read: a source changed during the build leaves the build stale, so unused. A failed build leaves
the previous state (pure Python without a build) and exits 1.

Lives in `deploy/` with the other build helpers (not in `protocol/`, which imports only the standard
library and msgspec, nor in the router): nothing at run time imports it.

Must not: write anywhere but `protocol/_native/` and a temporary folder, or leave a build without
its stamp in place.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from protocol import native

GROUP = "protocol.hot"


def _build(folder: Path, work: Path) -> Path:
    """Compile `folder`'s COMPILED modules under `work`; the folder holding the extension files."""
    from mypyc.build import mypycify
    from setuptools import Distribution  # type: ignore[import-untyped]

    sources = [str(folder / f"{name}.py") for name in native.COMPILED]
    options = ["--cache-dir", str(work / "mypy-cache"), "--python-executable", sys.executable]
    cwd = os.getcwd()
    os.chdir(work)  # no mypy or setuptools configuration of the caller's folder applies
    try:
        # One group, its shared library inside the package (protocol.hot__mypyc), so that the folder
        # put first on `protocol.__path__` holds the whole build.
        try:
            extensions = mypycify([*options, *sources], opt_level="3", target_dir=str(work / "c"),
                                  group_name=GROUP)
        except TypeError:  # a mypy before `group_name` (1.18): the same group, named the older way
            extensions = mypycify([*options, *sources], opt_level="3", target_dir=str(work / "c"),
                                  separate=[(sources, GROUP)])
        dist = Distribution({"name": "pgmesh-protocol-native", "ext_modules": extensions})
        build = dist.get_command_obj("build_ext")
        build.build_lib = str(work / "lib")
        build.build_temp = str(work / "temp")
        dist.run_command("build_ext")
    finally:
        os.chdir(cwd)
    return work / "lib" / "protocol"


def _loads(package_parent: Path) -> str | None:
    """Why a fresh interpreter does not import the compiled modules from `package_parent`, or None."""
    code = (
        "import protocol, importlib, sys\n"
        "mods = [importlib.import_module('protocol.' + m) for m in protocol.native.COMPILED]\n"
        "bad = [m.__name__ for m in mods if not m.__file__.endswith(sys.argv[1])]\n"
        "print('not compiled: ' + ' '.join(bad) if bad or not protocol.compiled else '')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != native.PURE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(package_parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    done = subprocess.run([sys.executable, "-c", code, suffix], capture_output=True, text=True, env=env,
                          cwd=package_parent)
    if done.returncode != 0:
        return done.stderr.strip()[-2000:]
    return done.stdout.strip() or None


def compile_package(folder: Path, *, force: bool = False) -> str:
    """Build `folder`'s compiled modules unless current; what was done, in words. Raises on failure."""
    target = folder / native.NATIVE_DIR
    stamp = native.stamp_text(folder)  # before the sources are read for the build
    if not force and native.native_dir(folder, {}) is not None:
        return f"{target} is current"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pgmesh-mypyc-") as tmp:
        work = Path(tmp)
        built = _build(folder, work)
        # What a fresh interpreter imports: the sources as they are, the build beside them.
        trial = work / "trial" / "protocol"
        shutil.copytree(folder, trial, ignore=shutil.ignore_patterns("__pycache__", native.NATIVE_DIR))
        shutil.copytree(built, trial / native.NATIVE_DIR)
        (trial / native.NATIVE_DIR / native.STAMP).write_text(stamp)
        problem = _loads(trial.parent)
        if problem is not None:
            raise RuntimeError(f"the compiled modules do not load: {problem}")
        fresh = folder / f"{native.NATIVE_DIR}.new-{os.getpid()}"
        old = folder / f"{native.NATIVE_DIR}.old-{os.getpid()}"
        shutil.copytree(trial / native.NATIVE_DIR, fresh)
    if target.exists():
        target.rename(old)
    fresh.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    return f"compiled {', '.join(native.COMPILED)} into {target} in {time.monotonic() - started:.1f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python deploy/compile.py", description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even when the build is current")
    args = parser.parse_args(argv)
    if os.environ.get(native.NO_COMPILE_ENV, "") not in ("", "0"):
        print(f"compile: {native.NO_COMPILE_ENV} is set: protocol/ runs as pure Python")
        return 0
    folder = Path(native.__file__).resolve().parent
    try:
        print(f"compile: {compile_package(folder, force=args.force)}")
    except Exception as exc:  # a missing compiler, mypy, or a module mypyc refuses: say so, change nothing
        print(f"compile: failed, protocol/ stays pure Python ({type(exc).__name__}: {exc}); "
              f"set {native.NO_COMPILE_ENV}=1 to skip this step", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
