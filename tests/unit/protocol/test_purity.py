"""`protocol/` is sans-I/O: it imports no event loop, no driver and nothing of the router."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import protocol

FORBIDDEN = ("asyncio", "psycopg", "asyncpg", "uvloop", "router", "socket", "selectors", "threading")
ROOT = Path(protocol.__file__).parent


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_protocol_sources_import_nothing_forbidden() -> None:
    files = sorted(ROOT.glob("*.py"))
    assert len(files) >= 8
    for path in files:
        for name in imported_modules(path):
            top = name.split(".")[0]
            assert top not in FORBIDDEN, f"{path.name} imports {name}"
            assert top in sys.stdlib_module_names or top in ("msgspec", "protocol"), f"{path.name}: {name}"


def test_importing_protocol_loads_no_forbidden_module() -> None:
    code = (
        "import sys, protocol, protocol.pgoutput, protocol.transactions;"
        "import protocol.replication, protocol.relations;"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
