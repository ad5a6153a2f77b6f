"""The first pass's key ranges, shared between the command's own threads and Spark.

Starting Spark costs a fixed few seconds (the JVM, then its Python workers: about 5.5 s on a small
machine), as much as reading a few million rows on every node. So the ranges go first to `lanes` threads
of the command itself, each running the very task Spark would run (`worker.run_partition`: one session per
node, a range read on every node at once, a differing range descended to rows). While they work, the
projection of what is left (elapsed time x ranges left / ranges done, from the first second on) is
checked; once it exceeds `spark_after_s` (`SPARK_AFTER_S`: about what starting Spark costs), Spark is
started, the lanes stop taking ranges when it is up, and Spark runs the rest. A comparison that ends
before Spark would pay for itself never starts it; a large one pays the start once, in parallel with the
lanes' work.

Must not: import pyspark (router.cluster.copy.spark does), or read anything itself (the worker does).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Final

from router.cluster.compare.plan import RangeTask
from router.cluster.compare.worker import CompareJob, Difference, run_partition

__all__ = ["SPARK_AFTER_LOCAL_S", "SPARK_AFTER_S", "RangeQueue", "run_shared"]

SPARK_AFTER_S: Final = 6.0
# With a local master (`local[N]`) Spark brings no core the lanes do not use already (as many threads as
# it would take), so its start (about 6 s on 2 cores, taken from the lanes' cores) is paid back only in
# a long comparison: it starts when what is left is projected past this (its start then under a tenth).
SPARK_AFTER_LOCAL_S: Final = 60.0
_POLL_S: Final = 0.1
_SETTLE_S: Final = 1.0  # the rate is judged after this long (sessions opened, first ranges read)


class RangeQueue:
    """Ranges handed out one at a time until closed; `taken` counts those handed out."""

    def __init__(self, tasks: Sequence[RangeTask]) -> None:
        self._tasks = collections.deque(tasks)
        self._lock = threading.Lock()
        self.total = len(tasks)
        self.taken = 0
        self.closed = False

    def take(self) -> RangeTask | None:
        with self._lock:
            if self.closed or not self._tasks:
                return None
            self.taken += 1
            return self._tasks.popleft()

    def stream(self) -> Iterator[RangeTask]:
        return iter(self.take, None)

    def close(self) -> list[RangeTask]:
        """Hand out nothing more; the ranges nobody took."""
        with self._lock:
            self.closed = True
            rest = list(self._tasks)
            self._tasks.clear()
            return rest

    def left_after(self, elapsed: float, in_hand: int) -> float:
        """Seconds the ranges not yet taken would take at the rate so far, with `in_hand` of those taken
        still being read (infinite before the first is done)."""
        with self._lock:
            if not self._tasks:
                return 0.0
            done = self.taken - in_hand
            return elapsed * len(self._tasks) / done if done > 0 else float("inf")


def run_shared(
    job: CompareJob, tasks: Sequence[RangeTask], lanes: int, spark_after_s: float,
    on_spark: Callable[[Callable[[], list[RangeTask]]], list[Difference]] | None,
) -> tuple[list[Difference], bool]:
    """Compare `tasks` on `lanes` threads, and, once what is left is projected past `spark_after_s`, with
    `on_spark`: it starts Spark, then calls the function it is given for the ranges left (the lanes take
    none after that) and returns what differed among them. Returns what differed and whether Spark ran."""
    queue = RangeQueue(tasks)
    began = time.monotonic()
    found: list[Difference] = []
    lanes = max(1, lanes)
    with ThreadPoolExecutor(lanes + 1, thread_name_prefix="pgmesh-compare-lane") as pool:
        running: set[Future[list[Difference]]] = {
            pool.submit(lambda: list(run_partition(job, queue.stream()))) for _ in range(lanes)
        }
        spark = False
        while running:
            done, running = wait(running, timeout=_POLL_S, return_when=FIRST_COMPLETED)
            for future in done:
                found += future.result()  # (a lane that failed raises its error here)
            elapsed = time.monotonic() - began
            if (not spark and on_spark is not None and running and elapsed >= min(_SETTLE_S, spark_after_s)
                    and queue.left_after(elapsed, len(running)) > spark_after_s):
                running.add(pool.submit(on_spark, queue.close))
                spark = True
    return found, spark
