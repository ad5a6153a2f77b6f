"""The `pgmesh` command line without a server: a bad config is one line on stderr, exit code 2.

The command line end to end over real nodes: tests/integration/test_cli.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def pgmesh(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_config_errors_are_one_line_with_key_and_line(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[cluster]\nname = "x"\n[[nodes]]\nname = "a"\ndsn = "host=h"\n'
                      '[[nodes]]\nname = "b"\ndsn = "host=h"\n[replication]\napply_delay_ms = "soon"\n')
    result = pgmesh("status", "--config", str(config))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert f"{config}:10" in line and "apply_delay_ms" in line
