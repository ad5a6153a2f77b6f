"""Test-suite wiring: makes the repository importable and registers the shared fixtures.

Owns: sys.path set-up (only when the repository root is missing) and fixture registration.
Must not: define fixtures or test logic itself (they live in fix_cluster.py, fix_mesh.py and proxy.py).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
if not any(Path(entry or ".").resolve() == ROOT for entry in sys.path):
    sys.path.insert(0, str(ROOT))

from tests.fix_cluster import pg_backend, pg_nodes  # noqa: E402
from tests.fix_mesh import mesh  # noqa: E402
from tests.proxy import tcp_proxy  # noqa: E402

__all__ = ["mesh", "pg_backend", "pg_nodes", "tcp_proxy"]
