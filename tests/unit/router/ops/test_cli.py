"""The `pgmesh` command line without a server: a bad config is one line on stderr, exit code 2.

The command line end to end over real nodes: tests/integration/test_cli.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


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


def _unreachable_cluster(tmp_path: Path) -> Path:
    """Two nodes and an admin listener where nothing listens: every command answers at once."""
    config = tmp_path / "config.toml"
    config.write_text('[cluster]\nname = "x"\n'
                      '[[nodes]]\nname = "a"\ndsn = "host=127.0.0.1 port=1 user=u dbname=d"\n'
                      '[[nodes]]\nname = "b"\ndsn = "host=127.0.0.1 port=1 user=u dbname=d"\n'
                      '[admin]\nlisten = "127.0.0.1:1"\n')
    return config


@pytest.mark.parametrize(
    ("command", "after"),
    [(("status",), ()), (("status", "--json"), ()), (("conflicts",), ()), (("sequences",), ("status",)),
     (("sequences",), ("status", "--json"))],
)
def test_a_reader_that_goes_away_ends_the_command_quietly(
    tmp_path: Path, command: tuple[str, ...], after: tuple[str, ...]
) -> None:
    """`pgmesh status | head -1`: stdout's reader is gone before pgmesh writes (the worst case of
    `head` closing early). No traceback; the exit code of a command killed by SIGPIPE, as `cat` gives."""
    config = _unreachable_cluster(tmp_path)
    argv = [*command, "--config", str(config), *after]
    read_through = pgmesh(*argv)
    assert read_through.stdout and "Traceback" not in read_through.stderr
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "router", *argv],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, check=False,
        )
    finally:
        os.close(write_end)
    assert result.stderr == read_through.stderr  # nothing but what it says anyway
    assert result.returncode == 128 + signal.SIGPIPE


def test_a_reader_that_reads_one_line_ends_the_command_quietly(tmp_path: Path) -> None:
    """The shape a user types: the reader takes the first line and closes."""
    config = _unreachable_cluster(tmp_path)
    with subprocess.Popen(
        [sys.executable, "-m", "router", "status", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        proc.stdout.close()
        stderr = proc.stderr.read()
        code = proc.wait(timeout=60)
    assert first.startswith("cluster x: router NOT running")
    assert stderr == ""
    assert code in (0, 128 + signal.SIGPIPE)  # 0 when every line was written before the reader left


@pytest.mark.parametrize("verb", ["pause", "resume"])
def test_pause_without_router_and_a_node_down_is_one_line_naming_the_node(tmp_path: Path, verb: str) -> None:
    """No router listens, so the links' state is recorded on the nodes: one that cannot be reached is
    named on one line of stderr (exit 2), with what to do, never a psycopg traceback."""
    result = pgmesh(verb, "--config", str(_unreachable_cluster(tmp_path)))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("pgmesh: node a: ") and "Connection refused" in line
    assert f"nothing {verb}d" in line
