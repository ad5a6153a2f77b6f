"""Ports for throw-away nodes: below the ephemeral range, reserved across processes, stale ones taken over."""

from __future__ import annotations

import os
import subprocess
import sys

from router.testing import ports


def test_ports_are_reserved_below_the_ephemeral_range() -> None:
    got = ports.reserve(3, set())
    try:
        assert len(set(got)) == 3
        assert all(ports.LOWEST <= port < ports._ephemeral_low() for port in got)
        assert all((ports._DIR / str(port)).read_text() == str(os.getpid()) for port in got)
        assert not any(ports._claim(port) for port in got)  # held by a live process: not given twice
    finally:
        for port in got:
            ports.release(port)
    assert not any((ports._DIR / str(port)).exists() for port in got)


def test_a_reservation_of_a_dead_process_is_taken_over() -> None:
    port = ports.reserve(1, set())[0]
    ports.release(port)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (ports._DIR / str(port)).write_text(dead)
    try:
        assert ports._claim(port)
    finally:
        ports.release(port)


def test_release_leaves_another_process_reservation() -> None:
    port = ports.reserve(1, set())[0]
    (ports._DIR / str(port)).write_text("1")  # pid 1: alive, not ours
    ports.release(port)
    assert (ports._DIR / str(port)).exists()
    (ports._DIR / str(port)).unlink()
