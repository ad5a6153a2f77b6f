"""The verification task: every `[verify] interval` (a pass starts that long after the last one started,
or at once when it took longer; the first soon after the router starts), every compared table is read in
rolling key ranges (router.service.verify.scope) on the verification's own sessions on every node
(router.service.verify.sessions), at most `rows_per_second` rows a second on average over the pass.

A key that differs in a range is a candidate. Once a table's ranges are read, each node's barrier position
is taken (after the reads: past everything they saw), and the candidates wait until every link out of
each node has flushed past that node's position: the barrier, known inside the router (`synced`:
router.service.wiring `Wiring._synced`, what `pgmesh compare` asks over the admin API). Then they are
read again: a key is divergent only if it still differs and its values are the ones the first read saw
(else it was being written: read again behind a new barrier, up to `ROUNDS` times, then left unsettled,
not reported), as `pgmesh compare`'s recheck. A barrier not reached within `BARRIER_S` (a link paused or
down) decides nothing this pass.

What it found (router.service.verify.findings) replaces the table's previous finding at once: status
(`report`), pgmesh_divergent_rows{node,table} (`export`; 0 for every node of a table found identical),
one log line per table that differs per pass (its first keys; never a DSN) and one when it is identical
again.

Must not: run on a standby router (the supervisor starts it with the links, under the lease), use an
applier's session, block the event loop (the sessions' calls run on a thread of its own), or write.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar

import msgspec

from router.cluster.compare.worker import CompareJob, Difference
from router.config.model import Config, NodeConfig
from router.errors import describe
from router.service.metrics import Metrics
from router.service.status import VerifyStatus
from router.service.verify.findings import TableFinding, finding, merged
from router.service.verify.scope import Scope, read_scope
from router.service.verify.sessions import NodeSessions

__all__ = ["BARRIER_S", "FIRST_PASS_S", "ROUNDS", "Verifier"]

logger = logging.getLogger(__name__)

ROUNDS: Final = 3  # rechecks of a key still being written before it is left unsettled (as compare's)
BARRIER_S: Final = 120.0  # a barrier not reached within this decides nothing this pass
FIRST_PASS_S: Final = 5.0  # the first pass starts this long after the router (or the interval, if shorter)
MAX_CANDIDATES: Final = 100_000  # per table and pass: more differing keys are not rechecked this pass
_POLL_S: Final = 0.1
T = TypeVar("T")


class Verifier:
    """Continuous verification over `nodes` (the members); `synced(node)`: the position of `node` up to
    which every other node has flushed everything. `previous`: the one this replaces (after a hold or a
    lost lease): its findings and counts carry on."""

    def __init__(
        self, config: Config, nodes: Sequence[NodeConfig], synced: Callable[[str], int], *,
        clock: Callable[[], float] = time.time, previous: Verifier | None = None,
    ) -> None:
        assert config.verify is not None
        self.config = config
        self.section = config.verify
        self.nodes = list(nodes)
        self.synced = synced
        self.clock = clock
        self.barrier_s = BARRIER_S
        self.findings: dict[str, TableFinding] = dict(previous.findings) if previous else {}
        self.passes: int = previous.passes if previous else 0
        self.last_end: float | None = previous.last_end if previous else None
        self.last_seconds: float | None = previous.last_seconds if previous else None
        self.tables: int = previous.tables if previous else 0
        self.skipped: list[str] = list(previous.skipped) if previous else []
        self.reading: str | None = None
        self.error: str | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pgmesh-verify-pass")

    # ------------------------------------------------------------ the task

    async def run(self) -> None:
        """A pass every interval until cancelled; a pass that fails is logged and tried at the next one."""
        interval = self.section.interval_s
        await asyncio.sleep(min(interval, FIRST_PASS_S))
        try:
            while True:
                began = time.monotonic()
                try:
                    await self.one_pass()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    why = describe(exc)
                    if why != self.error:
                        logger.warning("verify: pass stopped short: %s; next pass in %.0f s", why, interval)
                    self.error = why
                finally:
                    self.reading = None
                await asyncio.sleep(max(0.0, began + interval - time.monotonic()))
        finally:
            self._thread.shutdown(wait=False)

    async def _off_loop(self, work: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, work, *args)

    async def one_pass(self) -> None:
        """Every compared table once; its finding replaces the last as soon as the table is done."""
        began, wall = time.monotonic(), self.clock()
        sessions = NodeSessions(self.nodes, self.config.replication.node_timeout_ms / 1000)
        try:
            await self._off_loop(sessions.open)
            scope: Scope = await self._off_loop(read_scope, sessions.reads, self.nodes, self.config)
            await self._off_loop(sessions.end)
            job = CompareJob(tuple(n.name for n in self.nodes), tuple(n.dsn for n in self.nodes),
                             ("",) * len(self.nodes), scope.tables)
            found: dict[str, TableFinding] = {}
            rows = 0
            for index, table in enumerate(scope.tables):
                self.reading = table.label
                ranges = [(task, n) for task, n in scope.ranges if task.table == index]
                candidates: list[Difference] = []
                for task, estimate in ranges:
                    differ = await self._off_loop(sessions.read_range, job, task)
                    candidates += differ[:max(0, MAX_CANDIDATES - len(candidates))]
                    rows += estimate  # the rate bound: never ahead of rows_per_second since the pass began
                    due = began + rows / self.section.rows_per_second
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                names = [job.nodes[i] for i in job.nodes_of(table)]
                divergent, unsettled = await self._settle(sessions, job, candidates)
                result = finding(table.label, names, [(d.key, d.hashes) for d in divergent], unsettled)
                found[table.label] = merged(found.get(table.label), result)
                self._record(found[table.label])
        finally:
            self._thread.submit(sessions.close)  # (after the read in hand, if cancelled in the middle of one)
        for gone in set(self.findings) - set(found):  # no longer compared
            del self.findings[gone]
        self.passes += 1
        self.last_end, self.last_seconds = self.clock(), time.monotonic() - began
        self.tables, self.skipped, self.error = len(found), list(scope.skipped), None
        total = sum(f.total for f in found.values())
        logger.info("verify: pass %d done in %.1f s (started %s): %d table(s), %d divergent key(s)%s",
                    self.passes, self.last_seconds, _iso(wall), len(found), total,
                    f"; not compared: {'; '.join(scope.skipped)}" if scope.skipped else "")

    async def _settle(
        self, sessions: NodeSessions, job: CompareJob, candidates: list[Difference]
    ) -> tuple[list[Difference], int]:
        """The candidates that still differ, with the values of their first read, behind the barrier; and
        how many are still being written (unsettled)."""
        if not candidates:
            return [], 0
        logger.debug("verify: %d key(s) differed at the first read: read again behind the barrier",
                     len(candidates))
        open_ = {(d.table, d.key): d for d in candidates}
        last = {(d.table, d.key): d.hashes for d in candidates}
        divergent: list[Difference] = []
        for _ in range(ROUNDS):
            wanted = await self._off_loop(sessions.positions)
            if not await self._barrier(wanted):
                logger.debug("verify: barrier not reached in %.0f s: %d key(s) undecided this pass",
                             self.barrier_s, len(open_))
                break
            now = await self._off_loop(sessions.recheck, job, list(open_.values()))
            for ident, values in now.items():
                if all(v == values[0] for v in values[1:]):
                    del open_[ident]  # converged: it was on its way
                elif values == last[ident]:
                    divergent.append(msgspec.structs.replace(open_.pop(ident), hashes=values))
                last[ident] = values
            if not open_:
                break
        return sorted(divergent, key=lambda d: (d.table, d.key)), len(open_)

    async def _barrier(self, wanted: dict[str, int]) -> bool:
        """Wait until every link out of each node has flushed past its position in `wanted`."""
        deadline = time.monotonic() + self.barrier_s
        while not all(self.synced(node) >= position for node, position in wanted.items()):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(_POLL_S)
        return True

    def _record(self, result: TableFinding) -> None:
        """The table's finding replaces its last; its log line."""
        before = self.findings.get(result.table)
        self.findings[result.table] = result
        if result.total:
            apart = ", ".join(f"{node} {n}" for node, n in result.rows.items() if n)
            logger.warning("verify: table %s: %d key(s) differ across nodes (rows held apart: %s); first: %s",
                           result.table, result.total, apart, ", ".join(result.keys))
        elif before is not None and before.total:
            logger.info("verify: table %s: identical on every node again", result.table)

    # ------------------------------------------------------------ what it reports

    def report(self) -> VerifyStatus:
        differ = {t: f for t, f in self.findings.items() if f.total}
        return VerifyStatus(
            interval_s=self.section.interval_s, passes=self.passes,
            last_pass_end=None if self.last_end is None else _iso(self.last_end),
            last_pass_seconds=None if self.last_seconds is None else round(self.last_seconds, 3),
            tables=self.tables,
            divergent={t: {n: c for n, c in f.rows.items() if c} for t, f in differ.items()},
            divergent_keys={t: f.total for t, f in differ.items()},
            first_keys={t: f.keys for t, f in differ.items()},
            skipped=self.skipped, reading=self.reading, last_error=self.error,
        )

    def export(self, metrics: Metrics) -> None:
        """pgmesh_divergent_rows{node,table} for every table as last found (0: identical)."""
        metrics.divergent_rows.clear()
        for table, result in self.findings.items():
            for node, count in result.rows.items():
                metrics.divergent_rows.labels(node=node, table=table).set(count)


def _iso(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, datetime.UTC).isoformat(timespec="seconds")

