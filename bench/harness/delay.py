"""A delaying TCP proxy on loopback: the replication links of a bench system with a round-trip time.

This kernel has no netem qdisc, so a link with latency is a proxy: every chunk read on one side is written
to the other `delay_s` later (each direction, so the round trip gains twice that), in order, without
limiting throughput. It runs in a process of its own (threads that sleep to the microsecond: an event
loop's timers round to milliseconds), so it takes nothing from the bench process, which runs pgmesh's
router. `DelayLinks.dsn(node)` is the node's DSN through its proxy: what a system's replication
connections use (a subscriber's CONNECTION, the router's node DSNs), never the workload's clients.

Owns: the proxy process and its ports. Must not: know any system or workload.
"""

from __future__ import annotations

import collections
import contextlib
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import psycopg

from router.testing.localnodes import LocalNode

_REPO = Path(__file__).resolve().parents[2]  # where `python -m bench.harness.delay` is found
READ_SIZE = 1 << 16
START_TIMEOUT_S = 10.0


def _pump(source: socket.socket, sink: socket.socket, delay_s: float) -> None:
    """Copy `source` to `sink`, each chunk `delay_s` after it was read; EOF is passed on the same way."""
    queue: collections.deque[tuple[float, bytes]] = collections.deque()
    ready = threading.Condition()

    def read() -> None:
        while True:
            try:
                data = source.recv(READ_SIZE)
            except OSError:
                data = b""
            with ready:
                queue.append((time.monotonic() + delay_s, data))
                ready.notify()
            if not data:
                return

    def write() -> None:
        while True:
            with ready:
                while not queue:
                    ready.wait()
                due, data = queue.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                sink.sendall(data)
            except OSError:
                source.close()  # the other side is gone: end the reader too
                return

    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=write, daemon=True).start()


def _serve(targets: Sequence[int], delay_s: float) -> None:
    """The proxy process: one listening port per target port, printed in order on one line; ends when
    its standard input does (the bench closed it, or is gone)."""
    listeners = []
    for _ in targets:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        listeners.append(listener)
    print(" ".join(str(listener.getsockname()[1]) for listener in listeners), flush=True)

    def accept(listener: socket.socket, port: int) -> None:
        while True:
            client, _ = listener.accept()
            server = socket.create_connection(("127.0.0.1", port))
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _pump(client, server, delay_s)
            _pump(server, client, delay_s)

    for listener, port in zip(listeners, targets, strict=True):
        threading.Thread(target=accept, args=(listener, port), daemon=True).start()
    sys.stdin.read()


class DelayLinks:
    """Proxies to `nodes` adding `rtt_ms` to every round trip (half each way), in a process of their own
    (`python -m bench.harness.delay`)."""

    def __init__(self, nodes: Sequence[LocalNode], rtt_ms: float) -> None:
        self.rtt_ms = rtt_ms
        ports = [str(n.port) for n in nodes]
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench.harness.delay", str(rtt_ms / 2000.0), *ports],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=_REPO,
        )
        assert self._process.stdout is not None
        ready, _, _ = select.select([self._process.stdout], [], [], START_TIMEOUT_S)
        line = self._process.stdout.readline() if ready else ""
        listening = [int(p) for p in line.split()]
        if len(listening) != len(nodes):
            self.close()
            raise RuntimeError("the delay proxy did not start")
        self._ports = {n.name: p for n, p in zip(nodes, listening, strict=True)}

    def dsn(self, node: LocalNode) -> str:
        """`node`'s DSN through its proxy."""
        return node.dsn().replace(f"port={node.port}", f"port={self._ports[node.name]}")

    def round_trip_ms(self, node: LocalNode, trips: int = 200) -> tuple[float, float]:
        """The median round trip of `SELECT 1` to `node` directly and through its proxy, in ms (the
        proxy's threads add their wake-ups to the delay asked for)."""
        medians = []
        for dsn in (node.dsn(), self.dsn(node)):
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("SELECT 1")
                times = []
                for _ in range(trips):
                    began = time.perf_counter()
                    conn.execute("SELECT 1")
                    times.append(time.perf_counter() - began)
            medians.append(statistics.median(times) * 1000)
        return medians[0], medians[1]

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self._process.stdin is not None
            self._process.stdin.close()
        try:
            self._process.wait(5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


if __name__ == "__main__":
    _serve([int(p) for p in sys.argv[2:]], float(sys.argv[1]))
