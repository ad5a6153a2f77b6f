"""The layout's rules, checked on the source tree (issue 16): what may import what, sizes, private access.

Walks the AST of every module under `router/`, `protocol/` and `bench/`; nothing is imported or run.

- no import cycle among `router/` modules, counting imports inside functions too (a deferred import
  keeps PySpark or the JVM off start-up, never a way around a circle);
- the layer order (`LAYERS`): a module imports only from its own layer or those below it, inside
  functions too; the command line's per-command imports (`router.ops.cli`, `router.__main__`) sit on top;
- `router/apply/` does not import the replication I/O shell (`router.stream.connection`) or the source
  (`router.stream.source`): an applier only sees whole transactions;
- nothing in `router/`, `protocol/` or `bench/` imports `tests`;
- only `router/ops/demo.py`, tests and bench import `router.testing` (throw-away clusters);
- no module over 800 lines; those over 600 are listed as a warning (split by concern, not by count);
- no attribute access `x._name` on an object the module did not create: `self._x`, `cls._x`, a
  module's own private names and the short allow-list below are the only private reads;
- every error class of `router/` lives in `router/errors.py`, but for a module's private control-flow
  signals (`_Name`, never raised out of their module) and the short allow-list below.
- every package of `router/` and `protocol/` names each of its modules and subpackages in its
  `__init__` docstring (its face), as a word: "`large`" or "large.py".
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("router", "protocol", "bench")
MAX_LINES = 800
WARN_LINES = 600

# (module, attribute): private accesses that are the point of the code, each with its reason.
PRIVATE_ALLOWED: dict[tuple[str, str], str] = {
    # Python's own API for a named tuple's fields and for a running process's frames.
    ("*", "_replace"): "NamedTuple._replace is public API despite the underscore",
    ("*", "_asdict"): "NamedTuple._asdict is public API despite the underscore",
    ("*", "_fields"): "NamedTuple._fields is public API despite the underscore",
    ("*", "_exit"): "os._exit in a child process after fork",
    # PySpark has no public way to end the JVM it launched (SparkSession.stop leaves it running).
    ("router.cluster.copy.spark", "_gateway"): "py4j gateway of the JVM pyspark launched",
    ("router.cluster.copy.spark", "_jvm"): "cleared with the gateway, as SparkContext.stop would",
}


# Public exception classes that live outside router/errors.py, each with its reason.
ERRORS_ELSEWHERE: dict[str, str] = {
    "router.testing.localnodes.LocalNodeError": "the throw-away cluster harness imports only the stdlib",
    "router.nodes.pgbin.PgBinError": "stdlib only: the harness uses it without the rest of pgmesh",
    "router.cluster.copy.worker.TaskFailure": "a tagged record that survives Spark's wrapping of errors",
}


def modules(package: str) -> Iterator[tuple[str, Path]]:
    base = ROOT / package
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports(module: str, path: Path, top_level_only: bool) -> set[str]:
    """Every module `module` imports (`from a import b` counts as a.b when a.b is a module)."""
    tree = parse(path)
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    nodes: list[ast.AST]
    if top_level_only:  # `if TYPE_CHECKING:` imports count: a type hint is a dependency too
        nodes = []
        for stmt in tree.body:
            nodes.append(stmt)
            if isinstance(stmt, ast.If | ast.Try):
                nodes.extend(ast.walk(stmt))
    else:
        nodes = list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = resolve(module, is_package, node)
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


ALL = {name: path for package in PACKAGES for name, path in modules(package)}
ROUTER = {name: path for name, path in ALL.items() if name.split(".")[0] == "router"}


def graph(top_level_only: bool = False) -> dict[str, set[str]]:
    return {
        name: {m for m in imports(name, path, top_level_only) if m in ROUTER} - {name}
        for name, path in ROUTER.items()
    }


# The layers, lowest first: a module may import its own layer and those below (longest prefix decides).
# `router.conflicts.resolve` is pure rules the config names its resolvers by; the rest of `conflicts`
# (the catalog, pruning) sits with ddl and sequences. `router.testing` (throw-away clusters) is above the
# service it runs and below `router.ops` only for `pgmesh demo` (see the test after the next).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("router.errors", "router.failpoints"),
    ("router.conflicts.resolve", "router.config", "router.nodes"),
    ("router.progress",),
    ("router.stream",),
    ("router.ddl", "router.sequences", "router.conflicts"),
    ("router.apply",),
    ("router.cluster",),
    ("router.service",),
    ("router.testing",),
    ("router.ops",),
    ("router.__main__",),
)


def layer_of(module: str) -> int:
    best, found = -1, -1
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), rank
    return found


def test_every_router_module_has_a_layer() -> None:
    assert not [name for name in ROUTER if name != "router" and layer_of(name) < 0]


def test_no_import_runs_up_the_layers() -> None:
    """Counting imports inside functions: a deferred import is still an arrow."""
    up = sorted(
        f"{name} ({layer_of(name)}) imports {dep} ({layer_of(dep)})"
        for name, deps in graph().items()
        for dep in deps
        if dep != "router" and name != "router" and layer_of(dep) > layer_of(name)
    )
    assert not up, "imports up the layers:\n" + "\n".join(up)


def test_no_import_cycle_among_router_modules() -> None:
    edges = graph()  # imports inside functions count
    # Packages' __init__ re-exports are edges too; a cycle is any strongly connected set of two or more.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles among router modules: {cycles}"


def test_apply_does_not_import_the_stream_connection_or_source() -> None:
    forbidden = {"router.stream.connection", "router.stream.source"}
    bad = {
        name: sorted(imports(name, path, False) & forbidden)
        for name, path in ROUTER.items()
        if name.startswith("router.apply")
    }
    assert not {k: v for k, v in bad.items() if v}


def test_shipped_code_does_not_import_tests() -> None:
    bad = {
        name: sorted(m for m in imports(name, path, False) if m == "tests" or m.startswith("tests."))
        for name, path in ALL.items()
    }
    assert not {k: v for k, v in bad.items() if v}


def test_only_the_demo_tests_and_bench_import_router_testing() -> None:
    allowed = {"router.ops.demo"}
    bad = {}
    for name, path in ALL.items():
        if name.startswith(("router.testing", "bench")) or name in allowed:
            continue
        hits = sorted(m for m in imports(name, path, False) if m.startswith("router.testing"))
        if hits:
            bad[name] = hits
    assert not bad


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_over_800_lines(package: str) -> None:
    sizes = {
        name: len(path.read_text().splitlines())
        for name, path in ALL.items()
        if name.split(".")[0] == package
    }
    long = {name: n for name, n in sizes.items() if n > WARN_LINES}
    if long:
        warnings.warn(f"modules over {WARN_LINES} lines (split by concern): {long}", stacklevel=1)
    assert not {name: n for name, n in long.items() if n > MAX_LINES}, f"modules over {MAX_LINES} lines"


def own_private_names(tree: ast.Module) -> set[str]:
    """Private names the module's own classes define: `self._x = ...`, `__slots__`, `def _x`."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            strings = (c for c in ast.walk(node.value) if isinstance(c, ast.Constant))
            names.update(c.value for c in strings if isinstance(c.value, str))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)  # a dataclass or Struct field declared in a class body
    return {n for n in names if n.startswith("_")}


def private_reads(path: Path) -> Iterator[tuple[int, str, str]]:
    """(line, object text, attribute) for every `x._name` where x is not self/cls, and `_name` is not
    something a class of this same module defines (its own objects, made here)."""
    tree = parse(path)
    own = own_private_names(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        attr = node.attr
        if not attr.startswith("_") or attr.startswith("__"):
            continue
        value = node.value
        if (isinstance(value, ast.Name) and value.id in ("self", "cls")) or attr in own:
            continue
        yield node.lineno, ast.unparse(value), attr


def test_no_private_attribute_read_across_objects() -> None:
    bad = []
    for name, path in ALL.items():
        for line, obj, attr in private_reads(path):
            if ("*", attr) in PRIVATE_ALLOWED or (name, attr) in PRIVATE_ALLOWED:
                continue
            bad.append(f"{name}:{line}: {obj}.{attr}")
    assert not bad, "private attributes read on objects the module did not create:\n" + "\n".join(bad)


def exception_classes(tree: ast.Module) -> Iterator[str]:
    """Names of the classes whose bases name an Exception or Error (the direct ones are enough here)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b) for b in node.bases]
            if any(b.endswith(("Exception", "Error", "Failure", "Lost", "Mismatch")) for b in bases):
                yield node.name


def test_error_classes_live_in_router_errors() -> None:
    bad = []
    for name, path in ROUTER.items():
        if name == "router.errors":
            continue
        for cls in exception_classes(parse(path)):
            if not cls.startswith("_") and f"{name}.{cls}" not in ERRORS_ELSEWHERE:
                bad.append(f"{name}.{cls}")
    assert not bad, f"error classes outside router/errors.py: {bad}"


def package_faces() -> Iterator[tuple[str, str, list[str]]]:
    """(package, its `__init__` docstring, its modules and subpackages) for `router/` and `protocol/`."""
    for package in ("router", "protocol"):
        for init in sorted((ROOT / package).rglob("__init__.py")):
            folder = init.parent
            members = [p.stem for p in folder.glob("*.py") if p.name != "__init__.py"]
            members += [d.name for d in folder.iterdir() if (d / "__init__.py").is_file()]
            name = ".".join(folder.relative_to(ROOT).parts)
            yield name, ast.get_docstring(parse(init)) or "", sorted(members)


def test_every_package_names_its_modules() -> None:
    """A package's face: a reader finds each module's place from the folder's `__init__` docstring."""
    unnamed = {
        package: missing
        for package, doc, members in package_faces()
        if (missing := [m for m in members if not re.search(rf"(?<!\w){re.escape(m)}(?!\w)", doc)])
    }
    assert not unnamed, "modules not named in their package's __init__ docstring:\n" + "\n".join(
        f"{package}: {', '.join(missing)}" for package, missing in sorted(unnamed.items())
    )


def test_the_rules_see_the_tree() -> None:
    """Guards the guards: the walk finds the packages and the folders the data path runs through."""
    folders = {name.split(".")[1] for name in ROUTER if name.count(".") >= 2}
    rooms = {"stream", "apply", "conflicts", "ddl", "sequences", "cluster", "service", "ops", "testing"}
    assert rooms <= folders
    assert len(ROUTER) > 40


def test_unit_tests_mirror_the_source_folders() -> None:
    """`tests/unit/router/<folder>/` holds the unit tests of `router/<folder>/`: every test folder names a
    source folder, and no unit test of a package sits loose beside them."""
    base = ROOT / "tests" / "unit"
    folders = sorted(p.parent for p in base.rglob("test_*.py") if p.parent != base)
    missing = sorted({str(f.relative_to(base)) for f in folders if not (ROOT / f.relative_to(base)).is_dir()})
    assert not missing, f"unit test folders without a source folder: {missing}"
    loose = sorted(
        p.name for p in (base / "router").glob("test_*.py")
        if (ROOT / "router" / p.stem.removeprefix("test_")).is_dir()
        or not (ROOT / "router" / f"{p.stem.removeprefix('test_')}.py").exists()
    )
    assert not loose, f"unit tests of router/ beside the folders (move them to their folder): {loose}"
