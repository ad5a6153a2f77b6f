"""Loopback ports for throw-away servers: below the kernel's ephemeral range, reserved across processes.

A port the kernel hands out for `bind(0)` comes from the ephemeral range, the same range every outgoing
connection takes its local port from: a node stopped for a while (a fault test) could find its port taken
by a client socket, or by a node another test process created meanwhile, and fail to start again
("Address already in use"). So nodes get ports below that range, each reserved by a file named after it
in `<tmp>/pgmesh-ports` holding the reserving process's pid; a file whose process is gone is stale and
taken over. `release` gives a port back when its node is destroyed.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import tempfile
from pathlib import Path
from typing import Final

from router.stream.spool import process_alive

LOWEST: Final = 20000  # below: well-known and registered services are likelier
_DIR: Final = Path(tempfile.gettempdir()) / "pgmesh-ports"
_RANGE_FILE: Final = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _claim(port: int) -> bool:
    """Create the port's reservation file; a stale one (its process gone) is taken over."""
    path = _DIR / str(port)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = int(path.read_text() or "0")
            except (OSError, ValueError):
                return False  # being written right now, or unreadable: someone else's
            if owner and process_alive(owner):
                return False
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            continue
        with os.fdopen(fd, "w") as out:
            out.write(str(os.getpid()))
        return True
    return False


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def reserve(count: int, avoid: set[int]) -> list[int]:
    """`count` distinct free loopback ports below the ephemeral range, reserved for this process."""
    high = _ephemeral_low()
    if high - LOWEST < 1000:  # an unusual kernel setting: the kernel's own choice, unreserved
        return _kernel_ports(count, avoid)
    _DIR.mkdir(mode=0o1777, exist_ok=True)
    ports: list[int] = []
    for port in random.sample(range(LOWEST, high), min(high - LOWEST, 4 * count + 200)):
        if port in avoid or not _claim(port):
            continue
        if not _bindable(port):
            release(port)
            continue
        ports.append(port)
        if len(ports) == count:
            return ports
    for port in ports:
        release(port)
    raise OSError(f"no {count} free loopback ports between {LOWEST} and {high}")


def release(port: int) -> None:
    """Give back a port this process reserved (nothing when it is not this process's)."""
    path = _DIR / str(port)
    with contextlib.suppress(OSError, ValueError):
        if int(path.read_text()) == os.getpid():
            path.unlink()


def _kernel_ports(count: int, avoid: set[int]) -> list[int]:
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            if port not in avoid:
                ports.append(port)
    finally:
        for sock in held:
            sock.close()
    return ports
