"""The SQL pgmesh installs on a node, read from the `.sql` files shipped beside the modules that run it.

A module that installs functions or tables keeps their text in `sql/<name>.sql` in its own package
(package data: `[tool.setuptools.package-data]` in pyproject.toml) and reads it with
`statements(__name__, "<name>.sql")`. A file is plain SQL with `{placeholder}` fields: a header of `--`
comment lines, then statements, each ending with `;` at the end of a line outside `$body$` quotes. Each
statement comes back without the comment lines before it and without its closing `;`, as the text the
caller wraps in `psycopg.sql.SQL` and fills with `.format(schema=sql.Identifier(...))`, so what goes into
a placeholder is quoted by psycopg, never pasted here.

Must not: fill placeholders, talk to a node, or import anything of pgmesh (the modules of `ddl/`,
`conflicts/` and `sequences/` read their files through it).
"""

from __future__ import annotations

from importlib import resources
from typing import Final

__all__ = ["DOLLAR_QUOTE", "SQL_FOLDER", "split", "statements"]

SQL_FOLDER: Final = "sql"
DOLLAR_QUOTE: Final = "$body$"  # the only dollar quote the files use, around every function body


def split(text: str) -> tuple[str, ...]:
    """The statements of one file's text: leading comment lines dropped, closing `;` removed."""
    found: list[str] = []
    lines: list[str] = []
    quotes = 0
    for line in text.splitlines():
        if not lines and (not line.strip() or line.lstrip().startswith("--")):
            continue  # the file's header, or the comment introducing the next statement
        lines.append(line)
        quotes += line.count(DOLLAR_QUOTE)
        if quotes % 2 == 0 and line.rstrip().endswith(";") and not line.lstrip().startswith("--"):
            found.append("\n".join(lines).rstrip()[:-1])
            lines, quotes = [], 0
    if lines:
        raise ValueError(f"SQL after the last statement does not end with ';': {lines[0][:60]!r}")
    return tuple(found)


def statements(module: str, name: str) -> tuple[str, ...]:
    """The statements of `sql/<name>` in the package of `module` (a module's `__name__`)."""
    package = module.rpartition(".")[0]
    text = (resources.files(package) / SQL_FOLDER / name).read_text(encoding="utf-8")
    try:
        return split(text)
    except ValueError as exc:
        raise ValueError(f"{package}/{SQL_FOLDER}/{name}: {exc}") from None
