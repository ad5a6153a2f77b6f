"""The `tcp_proxy` pytest factory fixture: loopback TCP forwarders (router.testing.proxy) that tests cut,
stall and restore; every proxy made is closed at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from router.testing.proxy import Mode, TcpProxy

__all__ = ["Mode", "TcpProxy", "tcp_proxy"]


@pytest.fixture
def tcp_proxy() -> Iterator[Callable[[str, int], TcpProxy]]:
    """Factory: `tcp_proxy(host, port)` returns a started TcpProxy; all are closed at teardown."""
    proxies: list[TcpProxy] = []

    def make(target_host: str, target_port: int) -> TcpProxy:
        proxy = TcpProxy(target_host, target_port).start()
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in reversed(proxies):
        proxy.close()
