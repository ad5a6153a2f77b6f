"""`pgmesh repair`'s progress line and hints, on stderr while it runs.

Owns: the line (keys decided of the total, rows written of those planned, the rate and an estimate of
the time left), printed at most every `EVERY_S` seconds (rewritten in place on a terminal, one line each
time otherwise), the final summary, and the run-time hints (`hint`): where the default rule copied rows
to a node that held no record of deleting them, or could not weigh a table without a key, the `--from
NODE` that would decide otherwise.

Must not: decide or write anything (router.cluster.compare.fix does; this is its `Progress`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final, TextIO

__all__ = ["RepairProgress"]

EVERY_S: Final = 1.0


class RepairProgress:
    """Counts what router.cluster.compare.fix reports and prints it to `out`."""

    __slots__ = ("_clock", "_last", "_live", "_out", "_started", "decided_keys", "planned", "total",
                 "written_rows")

    def __init__(self, out: TextIO | None, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._out = out
        self._clock = clock
        self._started = clock()
        self._last = -EVERY_S
        self._live = out is not None and out.isatty()
        self.total = total  # keys to decide
        self.planned = 0  # rows to write, known once decided
        self.decided_keys = 0
        self.written_rows = 0

    def start(self, total: int) -> None:
        """The comparison is done: `total` keys to decide, counted (and timed) from now."""
        self.total = total
        self._started = self._clock()

    def decided(self, keys: int) -> None:
        self.decided_keys += keys
        self._show()

    def written(self, rows: int) -> None:
        self.written_rows += rows
        self._show()

    def plan(self, rows: int) -> None:
        """`rows` more rows to write (a table's, once decided)."""
        self.planned += rows

    def line(self) -> str:
        elapsed = max(self._clock() - self._started, 1e-6)
        done = self.decided_keys + self.written_rows
        # rows not yet decided: about as many as keys (one node each), until the plan says
        left = (self.total - self.decided_keys) * 2 + max(self.planned - self.written_rows, 0)
        rate = done / elapsed
        eta = f"{left / rate:.0f} s" if rate > 0 and left else "-"
        return (f"repair: {self.decided_keys:,}/{self.total:,} keys decided, {self.written_rows:,}/"
                f"{self.planned:,} rows written, {rate:,.0f}/s, {elapsed:.1f} s, about {eta} left")

    def _show(self) -> None:
        now = self._clock()
        if self._out is None or now - self._last < EVERY_S:
            return
        self._last = now
        end = "\r" if self._live else "\n"
        self._out.write(self.line() + end)
        self._out.flush()

    def note(self, text: str) -> None:
        """A line of its own (what the command is doing before it can count)."""
        if self._out is not None:
            self._out.write(("\n" if self._live else "") + f"repair: {text}\n")
            self._out.flush()

    def hint(self, text: str) -> None:
        if self._out is None:
            return
        self._out.write(("\n" if self._live else "") + f"hint: {text}\n")
        self._out.flush()

    def finish(self) -> None:
        """The summary: what was decided and written, in how long."""
        if self._out is None:
            return
        elapsed = self._clock() - self._started
        keys_s = self.decided_keys / elapsed if elapsed > 0 else 0.0
        self._out.write(("\n" if self._live else "") + f"repair: {self.decided_keys:,} keys decided,"
                        f" {self.written_rows:,} rows written in {elapsed:.1f} s after the comparison"
                        f" ({keys_s:,.0f} keys/s)\n")
        self._out.flush()
