"""The router's task lifecycle helpers: cancelling a group of tasks and waiting for them, and leaving
the start-up state out of later garbage collections.

Must not: know what the tasks do (router.service.supervisor owns them).
"""

from __future__ import annotations

import asyncio
import gc
import logging

__all__ = ["cancel_all", "freeze_startup_objects"]

logger = logging.getLogger(__name__)


def freeze_startup_objects() -> None:
    """Leave what exists now (modules, configuration, the process's start-up state) out of every later
    garbage collection: a full collection walks every tracked object, and with the start-up state in
    its walk one took 55 ms in the bench process, stalling every link that long (lag p99)."""
    gc.collect()
    gc.freeze()


async def cancel_all(tasks: list[asyncio.Task[None]], what: str, limit: float = 10.0) -> None:
    """Cancel and wait; a task that ignores its cancel for `limit` seconds is reported and cancelled again."""
    if not tasks:  # (asyncio.wait refuses an empty set)
        return
    for task in tasks:
        task.cancel()
    while True:
        _, pending = await asyncio.wait(tasks, timeout=limit)
        if not pending:
            return
        logger.warning("stopping %s: %d task(s) still running after %.0f s; cancelling again",
                       what, len(pending), limit)
        for task in pending:
            task.cancel()
