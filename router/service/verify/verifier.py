"""The verification task: every `[verify] interval` (a pass starts that long after the last one started,
or at once when it took longer; the first soon after the router starts), every compared table is read in
rolling key ranges (router.service.verify.scope) on the verification's own sessions on every node
(router.service.verify.sessions), each range followed by a pause that keeps it to `rows_per_second` rows
(by the statistics' estimate) a second.

The ranges are read under one snapshot per node (taken again every `PIN_S`), staggered: the first full
node's is taken first, the others' once every link out of that node has committed there what it had then
(`visible`: `applied_through` over its links). So a change of that node's still on its way is in its
snapshot alone only for the moment the wait takes to notice, not for the links' whole lag: under writes
on that node, few keys differ at the first read (each one costs a descent and a recheck).

A key that differs in a range is a candidate. Once every range is read, each node's barrier position is
taken (after the reads: past everything they saw), and the candidates wait until every link out of
each node has flushed past that node's position: the barrier, known inside the router (`synced`:
router.service.wiring `Wiring._synced`, what `pgmesh compare` asks over the admin API). Then they are
read again: a key is divergent only if it still differs and its values are the ones the first read saw
(else it was being written: read again behind a new barrier, up to `ROUNDS` times, then left unsettled,
not reported), as `pgmesh compare`'s recheck. A barrier not reached within `BARRIER_S` (a link paused or
down) decides nothing this pass.

A table named in `[verify] auto_repair` (with a key, compared on full nodes) has its divergent keys
repaired at once (router.cluster.compare.fix `decide_table` and `write_node`, as `pgmesh repair`: each
key's winner by the conflict path's versions, a row written since the comparison left alone); the finding
still says what the pass found, the next pass whether the table is identical.

What it found (router.service.verify.findings) replaces each table's previous finding: status
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
import psycopg

from router.cluster.compare.fix import KeyDiff, decide_table, to_hex, write_node
from router.cluster.compare.worker import SESSION_SQL, CompareJob, Difference
from router.cluster.partial import is_partial
from router.config.model import Config, NodeConfig, split_table_name
from router.errors import PgmeshError, describe
from router.nodes.connect import connect
from router.progress.positions import LinkProgress
from router.service.metrics import Metrics
from router.service.status import VerifyStatus
from router.service.verify.findings import TableFinding, finding, merged
from router.service.verify.scope import Scope, read_scope
from router.service.verify.sessions import APPLICATION_NAME, NodeSessions

__all__ = ["BARRIER_S", "FIRST_PASS_S", "PIN_S", "ROUNDS", "Verifier", "applied_through"]

logger = logging.getLogger(__name__)

ROUNDS: Final = 3  # rechecks of a key still being written before it is left unsettled (as compare's)
BARRIER_S: Final = 120.0  # a barrier not reached within this decides nothing this pass
PIN_S: Final = 30.0  # a table's snapshots are taken again after this long (vacuum waits behind them)
VISIBLE_S: Final = 10.0  # the staggered snapshots wait at most this long (links far behind: no longer)
_VISIBLE_POLL_S: Final = 0.01
FIRST_PASS_S: Final = 5.0  # the first pass starts this long after the router (or the interval, if shorter)
MAX_CANDIDATES: Final = 100_000  # per table and pass: more differing keys are not rechecked this pass
_POLL_S: Final = 0.1
T = TypeVar("T")


class Verifier:
    """Continuous verification over `nodes` (the members); `synced(node)`: the position of `node` up to
    which every other node has flushed everything; `visible(node)`: committed (`applied_through`).
    `previous`: the one this replaces (after a hold or a lost lease): its findings and counts carry on."""

    def __init__(
        self, config: Config, nodes: Sequence[NodeConfig], synced: Callable[[str], int], *,
        visible: Callable[[str], int] | None = None, clock: Callable[[], float] = time.time,
        previous: Verifier | None = None,
    ) -> None:
        assert config.verify is not None
        self.config = config
        self.section = config.verify
        self.nodes = list(nodes)
        self.synced = synced
        self.visible = visible or synced
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
        self.repaired: dict[str, int] = {}  # table -> keys repaired by the last pass (auto_repair)
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
        """Every compared table once, range after range; then the recheck of what differed; then each
        table's finding replaces its last."""
        began, wall = time.monotonic(), self.clock()
        sessions = NodeSessions(self.nodes, self.config.replication.node_timeout_ms / 1000)
        try:
            await self._off_loop(sessions.open)
            scope: Scope = await self._off_loop(read_scope, sessions.reads, self.nodes, self.config)
            await self._off_loop(sessions.end)
            job = CompareJob(tuple(n.name for n in self.nodes), tuple(n.dsn for n in self.nodes),
                             ("",) * len(self.nodes), scope.tables)
            candidates: list[Difference] = []
            pinned = -PIN_S
            for task, estimate in scope.ranges:
                self.reading = scope.tables[task.table].label
                if time.monotonic() - pinned >= PIN_S:
                    await self._off_loop(sessions.end)
                    await self._pin(sessions)
                    pinned = time.monotonic()
                read_began = time.monotonic()
                differ = await self._off_loop(sessions.read_range, job, task)
                candidates += differ[:max(0, MAX_CANDIDATES - len(candidates))]
                # the rate bound, range by range (a wait above is never made up for)
                spent = time.monotonic() - read_began
                await asyncio.sleep(max(0.0, estimate / self.section.rows_per_second - spent))
            await self._off_loop(sessions.end)
            self.reading = f"{len(candidates)} differing key(s) again, behind the barrier"
            divergent, unsettled = await self._settle(sessions, job, candidates)
        finally:
            self._thread.submit(sessions.close)  # (after the read in hand, if cancelled in the middle of one)
        self.repaired = await self._repair(job, divergent) if self.section.auto_repair and divergent else {}
        found: dict[str, TableFinding] = {}
        for index, table in enumerate(scope.tables):
            names = [job.nodes[i] for i in job.nodes_of(table)]
            keys = [(d.key, d.hashes) for d in divergent if d.table == index]
            found[table.label] = merged(found.get(table.label),
                                        finding(table.label, names, keys, unsettled.get(index, 0)))
        for result in found.values():
            self._record(result)
        for gone in set(self.findings) - set(found):  # no longer compared
            del self.findings[gone]
        self.passes += 1
        self.last_end, self.last_seconds = self.clock(), time.monotonic() - began
        self.tables, self.skipped, self.error = len(found), list(scope.skipped), None
        total = sum(f.total for f in found.values())
        logger.info("verify: pass %d done in %.1f s (started %s): %d table(s), %d key(s) read again, %d"
                    " divergent%s", self.passes, self.last_seconds, _iso(wall), len(found), len(candidates),
                    total, f"; not compared: {'; '.join(scope.skipped)}" if scope.skipped else "")

    async def _repair(self, job: CompareJob, divergent: Sequence[Difference]) -> dict[str, int]:
        """Repair the divergent keys of the tables `auto_repair` names (with a key, compared on full nodes):
        table -> keys repaired. A repair that fails is logged; the pass goes on."""
        named = {".".join(split_table_name(t)) for t in self.section.auto_repair}
        out: dict[str, int] = {}
        for index, table in enumerate(job.tables):
            nodes = [self.nodes[i] for i in job.nodes_of(table)]
            mine = [d for d in divergent if d.table == index]
            if not mine or table.label not in named or table.keyless or any(is_partial(n) for n in nodes):
                continue
            names = [n.name for n in nodes]
            diffs = [KeyDiff(d.key, d.key_json, {n: to_hex(h) for n, h in zip(names, d.hashes, strict=True)})
                     for d in mine]
            conns: dict[str, psycopg.AsyncConnection[Any]] = {}
            try:
                for node in nodes:
                    conns[node.name] = await connect(node, purpose=APPLICATION_NAME)
                    await conns[node.name].execute(SESSION_SQL)
                repair = await decide_table(conns, self.config, table.label, diffs)
                await asyncio.gather(*(write_node(conn, self.config, name, repair)
                                       for name, conn in conns.items()))
            except (PgmeshError, psycopg.Error) as exc:
                logger.warning("verify: table %s: auto_repair of %d key(s) failed: %s", table.label,
                               len(mine), describe(exc))
                continue
            finally:
                for conn in conns.values():
                    await conn.close()
            fixed = sum(1 for where in repair.written.values() if where)
            out[table.label] = fixed
            logger.warning("verify: table %s: auto_repair repaired %d of %d divergent key(s) (winners: %s)%s",
                           table.label, fixed, len(mine), repair.winners(),
                           f"; left alone, written since the comparison: {len(repair.changed)}"
                           if repair.changed else "")
        return out

    async def _pin(self, sessions: NodeSessions) -> None:
        """Snapshots on every node: the first full node's now, the others' once every link out of it has
        committed there what it had then (at most VISIBLE_S later)."""
        first = next(i for i, n in enumerate(self.nodes) if not is_partial(n))
        await self._off_loop(sessions.pin, [first])
        name = self.nodes[first].name
        position = (await self._off_loop(sessions.positions, [first]))[name]
        deadline = time.monotonic() + VISIBLE_S
        while self.visible(name) < position:
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(_VISIBLE_POLL_S)
        await self._off_loop(sessions.pin, [i for i in range(len(self.nodes)) if i != first])

    async def _settle(
        self, sessions: NodeSessions, job: CompareJob, candidates: list[Difference]
    ) -> tuple[list[Difference], dict[int, int]]:
        """The candidates that still differ, with the values of their first read, behind the barrier; and
        per table, how many are still being written (unsettled)."""
        if not candidates:
            return [], {}
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
        unsettled: dict[int, int] = {}
        for index, _ in open_:
            unsettled[index] = unsettled.get(index, 0) + 1
        return sorted(divergent, key=lambda d: (d.table, d.key)), unsettled

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
            skipped=self.skipped, reading=self.reading, last_error=self.error, repaired=self.repaired,
        )

    def export(self, metrics: Metrics) -> None:
        """pgmesh_divergent_rows{node,table} for every table as last found (0: identical)."""
        metrics.divergent_rows.clear()
        for table, result in self.findings.items():
            for node, count in result.rows.items():
                metrics.divergent_rows.labels(node=node, table=table).set(count)


def applied_through(link: LinkProgress, seen: int) -> int:
    """The source position up to which the link's target has committed everything it needs (`seen`: the
    source's position passed): `LinkProgress.synced` with what is committed, not only what is flushed."""
    if link.missed_until is not None or link.log_from is not None or link.enqueued > link.applied:
        return link.applied
    return max(link.applied, seen)


def _iso(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, datetime.UTC).isoformat(timespec="seconds")

