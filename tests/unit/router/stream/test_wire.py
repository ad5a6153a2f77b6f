"""`router.stream.wire` over a socket pair (no server): reads, the stream's end, writes that must wait."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Iterator

import pytest

from protocol.replication import copy_data
from router.errors import ConnectionLost, SourceError
from router.stream.wire import WireStream


def message(tag: bytes, body: bytes) -> bytes:
    return tag + struct.pack(">I", len(body) + 4) + body


def xlog(wal_start: int, payload: bytes) -> bytes:
    return b"w" + struct.pack(">QQq", wal_start, wal_start, 0) + payload


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, server = socket.socketpair()
    ours.setblocking(False)
    yield ours, server
    ours.close()
    server.close()


def started(server: socket.socket, ours: socket.socket) -> WireStream:
    wire = WireStream(ours.fileno(), "a")
    server.sendall(message(b"W", b"\x00\x00\x00"))
    assert wire.answer() is True
    return wire


def test_frames_then_nothing_waiting(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, server = pair
    wire = started(server, ours)
    assert wire.available(512) == []  # nothing waiting: 0 bytes, no error
    sent = [xlog(1, b"B"), xlog(2, b"C")]
    server.sendall(b"".join(map(copy_data, sent)))
    assert wire.available(512) == sent
    assert wire.available(512) == []


def test_end_of_socket_is_connection_lost(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, server = pair
    wire = started(server, ours)
    server.sendall(copy_data(xlog(1, b"B")))
    server.shutdown(socket.SHUT_WR)
    assert wire.available(512) == [xlog(1, b"B")]
    with pytest.raises(ConnectionLost, match="server closed the connection"):
        wire.available(512)


@pytest.mark.parametrize(("code", "error"), [("57P01", ConnectionLost), ("42501", SourceError)])
def test_error_response_by_sqlstate(
    pair: tuple[socket.socket, socket.socket], code: str, error: type[Exception]
) -> None:
    ours, server = pair
    wire = started(server, ours)
    server.sendall(message(b"E", f"SFATAL\0VFATAL\0C{code}\0Mgone\0\0".encode()))
    assert wire.available(512) is None
    ended = wire.ended(0x100)
    assert type(ended) is error and "stream ended: FATAL:  gone" in str(ended)


def test_closed_is_never_read(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, server = pair
    wire = started(server, ours)
    server.sendall(copy_data(xlog(1, b"B")))
    wire.close()
    with pytest.raises(ConnectionLost):
        wire.available(512)


async def test_a_write_waits_for_room_and_close_wakes_it(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, server = pair
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    wire = WireStream(ours.fileno(), "a")
    big = copy_data(b"r" * 2_000_000)
    writing = asyncio.ensure_future(wire.write(big, 10))
    received = bytearray()
    server.setblocking(False)
    while not writing.done():
        await asyncio.sleep(0)
        try:
            received += server.recv(1 << 20)
        except BlockingIOError:
            pass
    await writing
    server.setblocking(True)
    while len(received) < len(big):
        received += server.recv(1 << 20)
    assert bytes(received) == big  # whole, in order, across partial writes

    stuck = asyncio.ensure_future(wire.write(big, 10))  # nobody reads: it must wait for room
    for _ in range(5):
        await asyncio.sleep(0)
    assert not stuck.done()
    wire.close()
    with pytest.raises(ConnectionLost):
        await stuck
