"""The replication socket read and written by pgmesh itself, from START_REPLICATION on (no TLS, no GSS).

libpq reads a replication stream one CopyData message per `get_copy_data` call (a malloc, a copy and
two Python objects each); on a plain socket `router.stream.connection` instead sends START_REPLICATION
here and reads the stream in large chunks, split into frames by `protocol.copyframes.CopyReader`.
Standby status updates go out here too: libpq would read the socket while writing (PQputCopyData
parses its input first, and pqSendSome reads input when a send would block), and libpq must never see
a byte of the stream once this owns it. The connection keeps libpq for the commands before (they end
at ReadyForQuery, with nothing left in libpq's buffer) and for closing.

Must not: use the socket after `close()` (its number may already belong to another connection), decode
pgoutput, or wait for readability (the connection does, so that `abort` wakes it).
"""

from __future__ import annotations

import asyncio
import logging
import os

from protocol.copyframes import CopyEnd, CopyReader, error_text
from protocol.errors import ProtocolError
from router.errors import Action, ConnectionLost, SourceError, decide_sqlstate

__all__ = ["WireStream"]

logger = logging.getLogger(__name__)


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


class WireStream:
    """One replication connection's socket, owned from START_REPLICATION until the connection closes."""

    __slots__ = ("_node", "_writing", "closed", "fd", "reader")

    def __init__(self, fd: int, node: str) -> None:
        self.fd = fd
        self._node = node
        self.reader = CopyReader()
        self.closed = False
        self._writing: asyncio.Future[None] | None = None

    def close(self, reason: ConnectionLost | None = None) -> None:
        """The connection is being closed: never touch the socket again; a waiting write fails."""
        self.closed = True
        waiting, self._writing = self._writing, None
        if waiting is not None:
            asyncio.get_running_loop().remove_writer(self.fd)
            if not waiting.done():
                waiting.set_exception(reason or self._lost("the connection was closed"))

    def _lost(self, what: str, lsn: int | None = None) -> ConnectionLost:
        return ConnectionLost(f"replication connection lost: {what}", node=self._node, lsn=lsn)

    # ---------------------------------------------------------------- reading

    def receive(self, lsn: int | None = None) -> int:
        """Read once what the socket holds (up to the reader's `read_size`): the bytes read, 0 when none
        were waiting. Raises ConnectionLost at the end of the socket.
        """
        if self.closed:
            raise self._lost("the connection was closed", lsn)
        reader = self.reader
        try:
            chunk = os.read(self.fd, reader.read_size())
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            raise self._lost(str(exc), lsn) from exc
        if not chunk:
            raise self._lost("server closed the connection unexpectedly", lsn)
        try:
            reader.feed(chunk)
        except ProtocolError as exc:
            raise self._lost(f"cannot read the stream: {exc}", lsn) from exc
        return len(chunk)

    def available(self, limit: int, lsn: int | None = None) -> list[bytes] | None:
        """Up to `limit` CopyData bodies received, and up to the first that is not XLogData (then the last);
        [] when none; None when the COPY stream ended.

        The socket is read only when the buffer holds no whole message.
        """
        if self.closed:
            raise self._lost("the connection was closed", lsn)
        reader = self.reader
        try:
            out = reader.split(limit)
            if not out and reader.end is None and self.receive(lsn):
                out = reader.split(limit)
        except ProtocolError as exc:
            raise self._lost(f"cannot read the stream: {exc}", lsn) from exc
        if reader.notices:
            self._log_notices()
        if out or reader.end is None:
            return out
        return None

    def answer(self, lsn: int | None = None) -> CopyEnd | bool:
        """The server's answer to START_REPLICATION so far: True once COPY BOTH began, the error when it
        failed, False while it has not come whole (read what the socket holds first)."""
        reader = self.reader
        try:
            reader.split(1)
            if not reader.copying and reader.end is None and self.receive(lsn):
                reader.split(1)
        except ProtocolError as exc:
            raise self._lost(f"cannot read the answer to START_REPLICATION: {exc}", lsn) from exc
        if reader.notices:
            self._log_notices()
        if reader.end is not None:
            return reader.end
        return reader.copying

    def ended(self, lsn: int) -> Exception:
        """The error that ended the COPY stream, as ours: retryable or not by its SQLSTATE."""
        end = self.reader.end
        if end is None or end.fields is None:
            return ConnectionLost("the server ended the replication stream", node=self._node, lsn=lsn)
        code = end.sqlstate
        retry = code is None or decide_sqlstate(code) is Action.RETRY
        error_cls = ConnectionLost if retry else SourceError
        return error_cls(f"stream ended: {end.text}", node=self._node, lsn=lsn, sqlstate=code)

    def _log_notices(self) -> None:
        notices, self.reader.notices = self.reader.notices, []
        for fields in notices:
            logger.debug("node %s: the walsender says %s", self._node, error_text(fields))

    # ---------------------------------------------------------------- writing

    async def write(self, data: bytes, limit: float | None) -> None:
        """Write `data` whole (waiting while the socket's send buffer is full, up to `limit` each time).

        Raises ConnectionLost when the connection is closed or fails, TimeoutError when it stays full.
        """
        view = memoryview(data)
        loop = asyncio.get_running_loop()
        while view:
            if self.closed:
                raise self._lost("the connection was closed")
            try:
                view = view[os.write(self.fd, view) :]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                raise self._lost(str(exc)) from exc
            if not view:
                return
            ready: asyncio.Future[None] = loop.create_future()
            loop.add_writer(self.fd, _wake, ready)
            self._writing = ready
            try:
                async with asyncio.timeout(limit):
                    await ready
            finally:
                if self._writing is ready:
                    self._writing = None
                    loop.remove_writer(self.fd)
