"""The router's log of every source (router.stream.log), as `pgmesh run` keeps them.

It opens each source's log at start (what an earlier run left is read back, a torn tail cut off) and
places the links: one whose target lacks transactions the log holds reads them from it (and so does one
into a node that is down, from the position saved at the last tick: `links` in the log's directory).
A log that was not left open starts at the source's start position. At every progress tick (`upkeep`,
before the source is confirmed) it gives the source's progress the log's `since` and durable position,
deletes the segments every link has flushed past, saves the links' positions, and, once a log that
stopped growing at its cap is no longer needed, deletes it and starts a new one.

Must not: decide what a link reads (router.stream.fanout), or confirm a slot (router.service.supervisor).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec

from router.config import Config
from router.errors import PgmeshError
from router.progress import SourceProgress
from router.stream.log import SourceLog, write_durably
from router.stream.spool import Spool

__all__ = ["RouterLogs"]

logger = logging.getLogger(__name__)

_POSITIONS = "links"


class RouterLogs:
    """One `SourceLog` per source node, or none at all (`[log] enabled = false`)."""

    def __init__(self, config: Config, spool: Spool) -> None:
        self.config = config
        self.spool = spool
        self.logs: dict[str, SourceLog] = {}
        self._saved: dict[str, dict[str, int]] = {}

    @property
    def enabled(self) -> bool:
        return self.config.log.enabled

    def open(self, node: str, position: Callable[[], int], system_id: str | None) -> SourceLog | None:
        """`node`'s log, read back from disk; `position`: where its fan-out has got to; `system_id`: the
        node's system identifier (None: unknown now, the node is down)."""
        if not self.enabled:
            return None
        section = self.config.log
        old = self.logs.pop(node, None)
        if old is not None:
            old.close()
        log = SourceLog(
            self.config.log_directory(node), node, identity=system_id,
            spool=self.spool, segment_bytes=section.segment_mb << 20, cap_bytes=section.cap_mb << 20,
            fsync_ms=section.fsync_ms, position=position,
        )
        try:
            log.open()
        except OSError as exc:
            raise PgmeshError(f"cannot open the router log in {log.directory}: {exc}", node=node) from exc
        self.logs[node] = log
        return log

    def stored(self, node: str) -> dict[str, int]:
        """The positions of `node`'s links saved by the last tick of an earlier run (target -> LSN)."""
        log = self.logs.get(node)
        if log is None:
            return {}
        path = log.directory / _POSITIONS
        try:
            saved = msgspec.msgpack.decode(path.read_bytes(), type=dict[str, int])
        except (OSError, msgspec.DecodeError):
            return {}
        self._saved[node] = dict(saved)
        return saved

    def place(self, node: str, progress: SourceProgress, down: set[str]) -> None:
        """Links that must read the log read it; a log not left open starts where the source starts."""
        log = self.logs.get(node)
        if log is None:
            return
        if not log.active:
            log.activate(progress.start_position())
        for link in progress.links:
            if log.covers(link.flushed) and (link.flushed < log.end or link.target in down):
                link.read_log(link.flushed)
        progress.log_since, progress.log_durable = log.since, log.durable

    def upkeep(self, node: str, progress: SourceProgress) -> None:
        """At each tick, before the source is confirmed."""
        log = self.logs.get(node)
        if log is None:
            return
        log.idle()
        if log.active and progress.links:
            low = min(link.flushed for link in progress.links)
            log.truncate_before(low)
            idle = not progress.logging() and not any(link.has_until for link in progress.links)
            if not log.appending and idle and low >= log.end:
                log.reset()  # it reached its cap and nobody needs it any more: a new one starts here
                log.activate(progress.seen)
            self._save(node, log, {link.target: int(link.flushed) for link in progress.links})
        progress.log_since, progress.log_durable = log.since, log.durable

    def _save(self, node: str, log: SourceLog, positions: dict[str, int]) -> None:
        if self._saved.get(node) == positions:
            return
        try:
            write_durably(log.directory / _POSITIONS, msgspec.msgpack.encode(positions))
        except OSError as exc:
            logger.warning("node %s: cannot save the links' positions in %s: %s", node, log.directory, exc)
            return
        self._saved[node] = positions

    def run(self, group: asyncio.TaskGroup) -> list[asyncio.Task[None]]:
        """Start every log's group fsync in `group`."""
        return [group.create_task(log.run(), name=f"router log {node}") for node, log in self.logs.items()]

    async def close(self) -> None:
        """Make what was appended durable, and close."""
        for log in self.logs.values():
            with contextlib.suppress(OSError):
                await log.sync()
            log.close()
