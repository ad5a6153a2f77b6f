"""Making the router log's files durable (router.stream.log.store): fsync of files, descriptors and
directories.

Blocking calls: the log runs them in a thread, never on the event loop.

Must not: know the log's format or decide when to sync.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["fsync_all", "fsync_path", "write_durably"]


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by its name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_all(pending: list[int], fd: int | None, directory: Path, files: list[Path]) -> None:
    """fsync `files` (by name; gone meanwhile: skipped), then `pending` descriptors (closed after; -1:
    `directory`, which `files` also need), then `fd` (left open)."""
    for path in files:
        with contextlib.suppress(FileNotFoundError):  # (deleted meanwhile: no longer needed)
            fsync_path(path)
    if files:
        pending = [*pending, -1]  # their names too
    for old in pending:
        if old < 0:
            fsync_path(directory)
        else:
            os.fsync(old)
            os.close(old)
    if fd is not None:
        with contextlib.suppress(OSError):  # closed by a reset meanwhile
            os.fsync(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically and durably (the file, then its directory)."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
