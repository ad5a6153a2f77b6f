"""The admin listener's bounds under clients that hold connections (router.service.admin): slowloris
clients that dribble partial headers, more connections than the listener keeps, and huge requests.

The listener must keep answering a normal `GET /healthz` and an authenticated `POST` while they are
connected, and must cut them off: the header timeout counts from the connection, whatever arrives.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from router.service.admin import AdminServer, admin_request
from router.testing.mesh import wait_for
from tests.unit.router.service.test_admin import AUTH, HOST, TOKEN, Router, raw, status_of

HEAD = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "  # never finished


class Slow:
    """Clients that connect and send part of a request head, then a byte now and then."""

    def __init__(self) -> None:
        self.writers: list[asyncio.StreamWriter] = []
        self.ends: list[asyncio.Task[bytes]] = []  # each: what the server sent until it closed

    async def connect(self, port: int, count: int) -> None:
        for _ in range(count):
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(HEAD)
            self.writers.append(writer)
            self.ends.append(asyncio.create_task(reader.read()))
        await asyncio.gather(*(w.drain() for w in self.writers))

    async def dribble(self) -> None:
        """One more byte of header from each client still connected."""
        for writer in self.writers:
            if not writer.is_closing():
                writer.write(b"a")
        await asyncio.gather(*(w.drain() for w in self.writers if not w.is_closing()), return_exceptions=True)

    def cut_off(self) -> int:
        return sum(1 for end in self.ends if end.done())

    async def close(self) -> None:
        for writer in self.writers:
            writer.close()
        await asyncio.gather(*self.ends, return_exceptions=True)


@asynccontextmanager
async def slow_clients(port: int, count: int) -> AsyncIterator[Slow]:
    slow = Slow()
    try:
        await slow.connect(port, count)
        yield slow
    finally:
        await slow.close()


async def answers(admin: AdminServer, router: Router, target: str) -> None:
    """A normal read and an authenticated change both get their reply."""
    assert await admin_request(HOST, admin.port, "GET", "/healthz", timeout=10) == (200, b"ok\n")
    status, _ = await admin_request(HOST, admin.port, "POST", f"/pause?target={target}", token=TOKEN,
                                    timeout=10)
    assert status == 200
    assert router.calls[-1] == ("pause", target)


async def test_a_hundred_slowloris_clients_do_not_stall_the_listener() -> None:
    """The report of issue 23: 100 clients holding connections made the port unreachable. Here they stay
    connected (a 60 s header timeout), dribbling headers, while requests keep being answered."""
    router = Router()
    async with router.server(read_timeout=60) as admin, slow_clients(admin.port, 100) as slow:
        for round in range(3):
            await slow.dribble()
            await answers(admin, router, f"n{round}")
        assert slow.cut_off() == 0  # within their 60 s, nobody was cut off: the port never filled up


async def test_slowloris_clients_are_cut_off_at_the_header_timeout() -> None:
    router = Router()
    async with router.server(read_timeout=0.5) as admin, slow_clients(admin.port, 100) as slow:
        await slow.dribble()  # data does not move the deadline, counted from the connection
        await answers(admin, router, "b")
        await wait_for(lambda: slow.cut_off() == 100, "every slow client cut off", 30)
        assert {end.result() for end in slow.ends} == {b""}  # closed without a reply
        await answers(admin, router, "c")


async def test_past_max_clients_the_oldest_silent_connections_make_room() -> None:
    router = Router()
    admin = AdminServer(HOST, 0, metrics=router.metrics, status=router.status, pause=router.pause,
                        resume=router.resume, health=router.health, token=TOKEN, read_timeout=60,
                        max_clients=20)
    async with admin, slow_clients(admin.port, 100) as slow:
        await answers(admin, router, "b")
        await wait_for(lambda: slow.cut_off() >= 80, "the oldest slow clients closed", 30)
        assert not any(end.done() for end in slow.ends[-19:])  # the newest are kept
        await answers(admin, router, "c")


async def test_a_huge_body_is_refused_before_it_is_read() -> None:
    router = Router()
    async with router.server() as admin:
        reader, writer = await asyncio.open_connection(HOST, admin.port)
        writer.write(b"POST /pause HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Length: 1073741824\r\n\r\n")
        writer.write(b"x" * 65536)  # the start of a gigabyte
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        assert status_of(reply) == 413
        assert router.calls == []
        assert status_of(await raw(admin.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")) == 200
