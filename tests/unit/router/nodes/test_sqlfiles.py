"""The SQL pgmesh installs lives in `.sql` files shipped as package data (issue 16).

Owns: that every `.sql` file a module of `router/` names (a string constant `<name>.sql`, read with
`router.nodes.sqlfiles.statements(__name__, ...)` from `sql/` in the module's package) exists, is
matched by `[tool.setuptools.package-data]` in pyproject.toml (so a wheel ships it), is found through
the installed package (`importlib.resources`), and splits into statements; that no `.sql` file lies
unused; that placeholders are only the ones the modules fill, through `psycopg.sql`, quoted; and the
splitting rules. Must not connect to a server.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import string
import tomllib
from importlib import resources
from pathlib import Path

import pytest
from psycopg import sql

from router.nodes.sqlfiles import split, statements

ROOT = Path(__file__).resolve().parents[4]
ROUTER = ROOT / "router"
SQL_NAME = re.compile(r"[\w-]+\.sql")
PLACEHOLDERS = {"schema", "epoch"}


def named_files() -> dict[Path, tuple[str, str]]:
    """Each .sql file a router module names -> (that module, the name as written)."""
    found: dict[Path, tuple[str, str]] = {}
    for path in sorted(ROUTER.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            value = node.value if isinstance(node, ast.Constant) else None
            if isinstance(value, str) and SQL_NAME.fullmatch(value):
                found[path.parent / "sql" / value] = (module, value)
    return found


NAMED = named_files()


def package_data() -> set[Path]:
    """Every file of router/ that pyproject's package-data patterns for `router` take into a wheel."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["router"]
    return {p for pattern in patterns for p in ROUTER.glob(pattern) if p.is_file()}


def test_modules_name_sql_files() -> None:
    """Guards the guard: the walk finds the files of ddl/, conflicts/ and sequences/."""
    folders = {path.parent.parent.name for path in NAMED}
    assert {"ddl", "conflicts", "sequences"} <= folders


@pytest.mark.parametrize("path", sorted(NAMED), ids=lambda p: str(p.relative_to(ROUTER)))
def test_every_named_sql_file_is_package_data_and_found_installed(path: Path) -> None:
    module, name = NAMED[path]
    assert path.is_file(), f"{module} names {name}, but {path.relative_to(ROOT)} does not exist"
    shipped = package_data()
    assert path in shipped, f"{path.relative_to(ROOT)} is not matched by [tool.setuptools.package-data]"
    package = module.rpartition(".")[0]
    installed = resources.files(package) / "sql" / name
    assert installed.is_file(), f"the installed package {package} does not find sql/{name}"
    assert installed.read_text(encoding="utf-8") == path.read_text(encoding="utf-8")
    assert statements(module, name), f"{path.relative_to(ROOT)} holds no statement"


def test_pgmesh_is_installed() -> None:
    assert importlib.metadata.distribution("pgmesh").metadata["Name"] == "pgmesh"


def test_no_sql_file_is_left_unused() -> None:
    on_disk = set(ROUTER.rglob("*.sql"))
    assert on_disk == set(NAMED), f"not named by any module: {sorted(map(str, on_disk - set(NAMED)))}"


@pytest.mark.parametrize("path", sorted(NAMED), ids=lambda p: str(p.relative_to(ROUTER)))
def test_placeholders_are_filled_quoted(path: Path) -> None:
    """Only {schema} and {epoch}; a schema name that needs quoting comes out quoted, never pasted."""
    module, name = NAMED[path]
    for text in statements(module, name):
        fields = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
        assert fields <= PLACEHOLDERS, f"{name}: unknown placeholders {fields - PLACEHOLDERS}"
        filled = sql.SQL(text).format(schema=sql.Identifier('we"ird'), epoch=sql.Literal(1)).as_string(None)
        if "schema" in fields:
            assert '"we""ird".' in filled and 'we"ird.' not in filled.replace('"we""ird"', "")


def test_split_drops_comments_and_ends_at_semicolons_outside_bodies() -> None:
    text = """-- a header
-- over two lines

CREATE TABLE t (a int);

-- what comes next
CREATE FUNCTION f() RETURNS void LANGUAGE plpgsql AS $body$
BEGIN
  PERFORM 1;
  -- a comment inside the body stays;
END
$body$;
"""
    first, second = split(text)
    assert first == "CREATE TABLE t (a int)"
    assert second.startswith("CREATE FUNCTION f()") and second.endswith("END\n$body$")
    assert "  PERFORM 1;\n  -- a comment inside the body stays;" in second


def test_split_refuses_an_unterminated_statement() -> None:
    with pytest.raises(ValueError, match="does not end with ';'"):
        split("CREATE TABLE t (a int);\nCREATE TABLE u (b int)\n")
    with pytest.raises(ValueError):
        split("CREATE FUNCTION f() AS $body$\nSELECT 1;\n")  # the body never closes
