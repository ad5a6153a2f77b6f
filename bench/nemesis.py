"""The randomized fault run (issue 38, as Jepsen does): `python -m bench.faults --nemesis --minutes M
[--seed S]`.

Three fresh nodes (a, b, c), each under Debian's libfaketime at offset 0 (so that its clock can be
stepped), each reached by the routers through a TCP proxy of its own (so that any node's link can be
cut); two routers (`python -m router run`, `[ha]` with a LEASE_S lease, `--lease-s`: one active, one
standby); the ledger and set workloads (bench/nemesis_load.py) writing on every node directly. For M
minutes a nemesis driven by one seeded random generator (printed; `--seed` replays the schedule, not the
timing) starts a fault after a random gap and heals it after a random hold. The kinds come in shuffled
rounds (every kind once per round, so that a short run sees each):

- `router-kill`: SIGKILL the active router; after the hold it is started again (a standby now);
- `router-pause`: SIGSTOP the active router for longer than its lease, then SIGCONT: the standby must
  have taken over while it was stopped, and the woken router must notice it lost the lease (be a
  standby within PAUSE_WATCH_S) and write nothing: its sessions are watched on every node for
  PAUSE_WATCH_S (or until it holds a newer term itself), and one holding a transaction id (a write) on
  a node whose lease row shows a newer term than the one it held is a violation;
- `node-stop`: `pg_ctl stop -m immediate` one node, `pg_ctl start` after the hold;
- `link-cut`: one node's proxy cut (connections closed, new ones refused) or blackholed (bytes held),
  then restored;
- `clock-step`: one node's clock stepped by +-0.3 to 2 s (libfaketime's offset file, read at every
  call), then stepped back; `[clocks] max_offset_ms` is raised above the largest step, so that the
  step reaches the lease rows' expiry, the commit-time wait and conflict times, not only the guard.

The model: at most one fault on the nodes (stop, cut or clock) and one on the routers (kill or pause)
at a time, so a majority of nodes and one router that can hold the lease are always there.

At the end: every fault healed, the writers stopped, then (bounded) until the nodes hold identical
rows; then the checks (bench/nemesis_load.py: every acknowledged insert on every node exactly once,
ledgers whole and equal), `pgmesh compare` exit 0, exactly one active router, continuous verification's
`pgmesh_divergent_rows` 0 on it when the router has `[verify]` (sampled every 5 s during the run too:
whatever it reported is listed). A router that exits by itself is recorded (a failed check) and started
again. The report (Markdown, default bench/results/issue38/nemesis-<date>.md) lists every fault with its
start and end (seconds from the start), the checks and the counts.

Owns: its nodes, proxies, routers and temporary directory (removed unless the run failed). Must not:
touch anything it did not create.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.nemesis_load import (
    SCHEMA,
    TABLES,
    WORKLOADS,
    Check,
    Tally,
    check_rows,
    code,
    compare,
    counts_table,
    read_node,
    router_status,
    verification,
    verify_section,
    write,
)
from router.testing.localnodes import LocalNode, LocalNodeSet
from router.testing.mesh import Mesh, converged, fetch, prepare_mesh
from router.testing.proxy import TcpProxy
from router.testing.routers import Routers, ha_section

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "issue38"
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
SETTINGS = {"wal_sender_timeout": "10s", "deadlock_timeout": "100ms"}
CLUSTER = "t"
LEASE_S = 3.0
CLOCKS = "[clocks]\nmax_offset_ms = 3000\n"  # above the largest step (2 s)
GAP_S = (2.0, 10.0)  # between two fault starts
HOLD_S = (3.0, 15.0)  # how long a node fault lasts, and a killed router stays down
STEP_S = (0.3, 2.0)  # a clock step's size, either way
PAUSE_EXTRA_S = (1.0, 4.0)  # a SIGSTOP lasts LEASE_S plus this
PAUSE_WATCH_S = 10.0
ACTIVE_WAIT_S = 30.0  # for an active router before a router fault (else the fault is skipped)
PACE_S = 0.02  # each writer: at most one transaction per PACE_S
CONVERGE_S = 600.0
LANES = {"router-kill": "router", "router-pause": "router", "node-stop": "node", "link-cut": "node",
         "clock-step": "node"}


@dataclass
class Fault:
    kind: str
    target: str
    hold: float
    param: Any = None
    start: float = -1.0
    end: float = -1.0
    notes: list[str] = field(default_factory=list)
    violation: str = ""

    def row(self, index: int) -> str:
        end = f"{self.end:.1f}" if self.end >= 0 else "not healed"
        what = "; ".join(self.notes)
        mark = f" **VIOLATION: {self.violation}**" if self.violation else ""
        return f"| {index} | {self.start:.1f} | {end} | {self.kind} | {self.target} | {what}{mark} |"


class Bed:
    """The nodes, their proxies and clocks, the two routers; each fault's action and its heal."""

    def __init__(self, nodes: list[LocalNode], workdir: Path, lease_s: float = LEASE_S) -> None:
        self.nodes = {n.name: n for n in nodes}
        self.lease_s = lease_s
        # how long past the pause a standby may take to take over, as tests/integration/test_standby_router.py
        self.takeover_s = 3 * (lease_s + lease_s / 3 + 5)
        self.workdir = workdir
        self.proxies = {n.name: TcpProxy("127.0.0.1", n.port).start() for n in nodes}
        self.via = [SimpleNamespace(name=n.name, dsn=self._proxied(n)) for n in nodes]
        self.routers = Routers(workdir, ha_section(lease_s) + CLOCKS + verify_section(), cluster=CLUSTER)
        self.faketime = LIBFAKETIME.exists()
        self.t0 = time.monotonic()
        self.killed: set[str] = set()  # routers the nemesis killed and has not started again
        self.crashes: list[str] = []  # routers that exited by themselves: when, exit code, last error
        self.verify_said: list[str] = []  # what the active router's verification reported during the run

    def _proxied(self, node: LocalNode) -> Any:
        return lambda: node.dsn().replace(f"port={node.port}", f"port={self.proxies[node.name].port}")

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ------------------------------------------------------------ set-up and the end

    def clock_file(self, node: LocalNode) -> Path:
        return node.base_dir / "faketime"

    def set_clock(self, node: LocalNode, offset: float) -> None:
        self.clock_file(node).write_text(f"{offset:+.3f}s\n" if offset else "+0\n")

    async def under_faketime(self) -> None:
        """Every node's server restarted under libfaketime at offset 0 (the clocks tests' way)."""
        if not self.faketime:
            return
        for node in self.nodes.values():
            self.set_clock(node, 0)
            node.env = {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME_TIMESTAMP_FILE": str(self.clock_file(node)),
                        "FAKETIME_NO_CACHE": "1"}
            await asyncio.to_thread(node.stop)
            await asyncio.to_thread(node.start)

    async def start_routers(self) -> None:
        self.routers.start("r1", self.via)
        await self.wait_role("r1", "active", 60)
        self.routers.start("r2", self.via)
        await self.wait_role("r2", "standby", 60)

    async def wait_role(self, name: str, role: str, limit: float) -> bool:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if await self.routers.is_(name, role):
                return True
            await asyncio.sleep(0.2)
        return False

    async def active(self, limit: float = ACTIVE_WAIT_S) -> str | None:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            for name in sorted(self.routers.procs):
                if self.running(name) and await self.routers.is_(name, "active"):
                    return name
            await asyncio.sleep(0.2)
        return None

    def running(self, name: str) -> bool:
        return self.routers.procs[name].poll() is None

    async def heal_all(self) -> list[str]:
        """Whatever a fault left (none should be left): every proxy forwarding, every clock at 0, every
        node running, every router running and not stopped. Says what it had to do."""
        done = []
        for name, proxy in self.proxies.items():
            if proxy.mode.value != "forward":
                await asyncio.to_thread(proxy.restore)
                done.append(f"proxy of {name} restored")
        for node in self.nodes.values():
            if self.faketime and self.clock_file(node).read_text().strip() != "+0":
                self.set_clock(node, 0)
                done.append(f"clock of {node.name} set back")
            if not await asyncio.to_thread(node.is_running):
                await asyncio.to_thread(node.start)
                done.append(f"node {node.name} started")
        for name in list(self.routers.procs):
            if self.running(name):
                self.routers.signal(name, signal.SIGCONT)
            else:
                self.routers.start(name, self.via)
                done.append(f"router {name} started")
        return done

    async def watch_routers(self) -> None:
        """A router that exits by itself (not killed by the nemesis) is a finding: recorded, and started
        again (as a service manager would), so that the run goes on."""
        while True:
            for name, proc in list(self.routers.procs.items()):
                if name not in self.killed and proc.poll() is not None:
                    lines = (self.workdir / f"{name}.log").read_text(errors="replace").splitlines()
                    last = next((x.strip(" |") for x in reversed(lines) if "Error" in x or "Lost:" in x), "")
                    self.crashes.append(f"{self.now():.1f} s: {name} exited ({proc.returncode}): {last}")
                    print(f"{self.now():7.1f} s  router {name} EXITED by itself: {last}", flush=True)
                    self.routers.start(name, self.via)
            await asyncio.sleep(0.5)

    async def watch_verify(self) -> None:
        """Every 5 s, the active router's continuous verification: each change of the rows it reports
        apart is recorded (nodes only lag here, and it compares behind a barrier: any is worth a look)."""
        last: Any = {}
        while True:
            for name in sorted(self.routers.procs):
                status = await router_status(self.routers.ports[name])
                verify = status.get("verify") or {}
                if (status.get("lease") or {}).get("role") == "active" and verify.get("divergent") != last:
                    last = verify.get("divergent")
                    self.verify_said.append(f"{self.now():.1f} s, {name}: rows apart {last or 'none'}"
                                            f" (first keys {verify.get('first_keys') or {}})")
            await asyncio.sleep(5)

    async def close(self) -> None:
        await self.routers.stop()
        for proxy in self.proxies.values():
            await asyncio.to_thread(proxy.close)

    # ------------------------------------------------------------ faults

    async def node_stop(self, f: Fault) -> None:
        node = self.nodes[f.target]
        await asyncio.to_thread(node.stop, "immediate")
        await asyncio.sleep(f.hold)
        await asyncio.to_thread(node.start)
        f.notes.append(f"stopped -m immediate {f.hold:.1f} s, started")

    async def link_cut(self, f: Fault) -> None:
        proxy = self.proxies[f.target]
        await asyncio.to_thread(proxy.cut if f.param == "cut" else proxy.blackhole)
        await asyncio.sleep(f.hold)
        await asyncio.to_thread(proxy.restore)
        how = "cut" if f.param == "cut" else "blackholed"
        f.notes.append(f"routers' link {how} {f.hold:.1f} s, restored")

    async def clock_step(self, f: Fault) -> None:
        if not self.faketime:
            f.notes.append("skipped: libfaketime is not installed (apt-get install faketime)")
            return
        node = self.nodes[f.target]
        self.set_clock(node, f.param)
        await asyncio.sleep(f.hold)
        self.set_clock(node, 0)
        f.notes.append(f"clock stepped {f.param:+.2f} s for {f.hold:.1f} s, stepped back")

    async def router_kill(self, f: Fault) -> None:
        name = await self.active()
        if name is None:
            f.notes.append(f"skipped: no active router within {ACTIVE_WAIT_S:.0f} s")
            return
        f.target = name
        term = await self._term(name)
        self.killed.add(name)
        await self.routers.kill(name)
        other = self._other(name)
        took = await self._took_over(other, f.hold)
        await asyncio.sleep(max(0.0, f.hold - took) if took >= 0 else 0.0)
        self.routers.start(name, self.via)
        self.killed.discard(name)
        f.notes.append(f"SIGKILL (term {term}); {self._taken(other, took)}; restarted after {f.hold:.1f} s")

    async def router_pause(self, f: Fault) -> None:
        name = await self.active()
        if name is None:
            f.notes.append(f"skipped: no active router within {ACTIVE_WAIT_S:.0f} s")
            return
        f.target = name
        lease = await self.routers.lease(name)
        holder, term = (lease or {}).get("holder", ""), (lease or {}).get("term", 0)
        other = self._other(name)
        self.routers.signal(name, signal.SIGSTOP)
        took = await self._took_over(other, f.hold + self.takeover_s)  # (stopped for as long as it takes)
        await asyncio.sleep(max(0.0, f.hold - took) if took >= 0 else 0.0)
        self.routers.signal(name, signal.SIGCONT)
        f.notes.append(f"SIGSTOP {f.hold:.1f} s (lease {self.lease_s:g} s, term {term});"
                       f" {self._taken(other, took)}")
        if took < 0:
            f.violation = f"the standby did not take over within {f.hold + self.takeover_s:.1f} s (liveness)"
        standby_after, sessions, writing, again = await self._watch(name, holder, int(term))
        woken = (f"woken: standby after {standby_after:.1f} s" if standby_after >= 0 else
                 f"woken: NOT a standby within {PAUSE_WATCH_S:.0f} s")
        f.notes.append(f"{woken}; its sessions seen {sessions}, writing {writing} (on nodes in a newer term)"
                       + (f"; active again (a newer term) after {again:.1f} s" if again >= 0 else ""))
        if writing and took >= 0:
            f.violation = f"the woken router wrote after {other} took over ({writing} writing sessions seen)"
        elif standby_after < 0 and again < 0 and took >= 0:
            f.violation = "the woken router did not notice it lost the lease"

    def _other(self, name: str) -> str:
        return "r2" if name == "r1" else "r1"

    async def _term(self, name: str) -> int:
        lease = await self.routers.lease(name)
        return int((lease or {}).get("term", 0))

    async def _took_over(self, other: str, limit: float) -> float:
        """Seconds until `other` says it is active (-1: not within `limit`)."""
        began = time.monotonic()
        if await self.wait_role(other, "active", limit):
            return time.monotonic() - began
        return -1.0

    def _taken(self, other: str, took: float) -> str:
        return f"{other} active after {took:.1f} s" if took >= 0 else f"{other} not active meanwhile"

    async def _watch(self, name: str, holder: str, term: int) -> tuple[float, int, int, float]:
        """For PAUSE_WATCH_S after the SIGCONT, or until the router holds a newer term of its own: when it
        says it is a standby, how many of its sessions were seen on nodes whose lease row shows a newer term
        than the one it held, and of them how many held a transaction id (writing: the fence ended its
        sessions there when the other router took the node, and may let it open none). Seconds until it
        was active again in a newer term (-1: not meanwhile)."""
        began = time.monotonic()
        standby_after = again = -1.0
        sessions: set[tuple[str, int]] = set()
        writing: set[tuple[str, int, str]] = set()
        app = f"pgmesh router {CLUSTER} {holder}"[:63]
        query = ("SELECT a.pid, a.backend_xid::text FROM pg_stat_activity a, pgmesh.lease l"
                 " WHERE a.application_name = %s AND l.cluster = %s AND l.term > %s")
        while time.monotonic() - began < PAUSE_WATCH_S:
            lease = await self.routers.lease(name) or {}
            if lease.get("role") == "active" and int(lease.get("term", 0)) > term:
                again = time.monotonic() - began
                break
            if standby_after < 0 and lease.get("role") == "standby":
                standby_after = time.monotonic() - began
            seen: list[tuple[str, int, str | None]] = []
            for node in self.nodes.values():
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(2):
                        seen += [(node.name, int(pid), xid)
                                 for pid, xid in await fetch(node.dsn(), query, [app, CLUSTER, term])]
            lease = await self.routers.lease(name) or {}
            if lease.get("role") == "active" and int(lease.get("term", 0)) > term:
                continue  # (a newer term of its own meanwhile: its sessions may be that term's)
            sessions |= {(n, pid) for n, pid, _ in seen}
            writing |= {(n, pid, xid) for n, pid, xid in seen if xid is not None}
            await asyncio.sleep(0.2)
        return standby_after, len(sessions), len(writing), again


ACTIONS = {"router-kill": Bed.router_kill, "router-pause": Bed.router_pause, "node-stop": Bed.node_stop,
           "link-cut": Bed.link_cut, "clock-step": Bed.clock_step}


# ------------------------------------------------------------ the nemesis


class Nemesis:
    """A seeded schedule: shuffled rounds of every kind, random gaps, holds and targets; at most one
    fault per lane (the nodes, the routers) at a time."""

    def __init__(self, bed: Bed, seed: int) -> None:
        self.bed = bed
        self.rng = random.Random(seed)
        self.deck: list[str] = []
        self.faults: list[Fault] = []
        self.busy: dict[str, asyncio.Task[None]] = {}

    def _draw(self, free: set[str]) -> Fault | None:
        if not self.deck:
            self.deck = sorted(ACTIONS)
            self.rng.shuffle(self.deck)
        kind = next((k for k in self.deck if LANES[k] in free), None)
        if kind is None:
            return None
        self.deck.remove(kind)
        target = self.rng.choice(sorted(self.bed.nodes))
        hold = self.rng.uniform(*HOLD_S)
        param: Any = None
        if kind == "router-pause":
            hold = self.bed.lease_s + self.rng.uniform(*PAUSE_EXTRA_S)
        elif kind == "link-cut":
            param = self.rng.choice(["cut", "blackhole"])
        elif kind == "clock-step":
            param = self.rng.choice([-1, 1]) * self.rng.uniform(*STEP_S)
        return Fault(kind, target if LANES[kind] == "node" else "active router", hold, param)

    async def run(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        while True:
            gap = self.rng.uniform(*GAP_S)
            if time.monotonic() + gap >= until:
                break
            await asyncio.sleep(gap)
            self.busy = {lane: t for lane, t in self.busy.items() if not t.done()}
            fault = self._draw({"node", "router"} - set(self.busy))
            if fault is not None:
                self.faults.append(fault)
                self.busy[LANES[fault.kind]] = asyncio.create_task(self._one(fault))
        await asyncio.gather(*self.busy.values())

    async def _one(self, f: Fault) -> None:
        f.start = self.bed.now()
        print(f"{f.start:7.1f} s  {f.kind} {f.target} ...", flush=True)
        try:
            async with asyncio.timeout(f.hold + 3 * ACTIVE_WAIT_S + 120):
                await ACTIONS[f.kind](self.bed, f)
        except Exception as exc:  # the heal at the end repairs whatever it left
            f.notes.append(f"fault failed: {type(exc).__name__}: {exc}")
        f.end = self.bed.now()
        print(f"{f.end:7.1f} s  {f.kind} {f.target}: {'; '.join(f.notes)}", flush=True)


# ------------------------------------------------------------ the run


@dataclass
class Outcome:
    seed: int
    minutes: float
    faults: list[Fault]
    checks: list[Check]
    counts: list[str]
    converge_s: float
    notes: list[str]
    lease_s: float = LEASE_S

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks) and not any(f.violation for f in self.faults)

    def render(self, when: str) -> str:
        kinds: dict[str, int] = {}
        for f in self.faults:
            kinds[f.kind] = kinds.get(f.kind, 0) + 1
        lines = [
            f"# Randomized fault run, {when}\n",
            f"`python -m bench.faults --nemesis --minutes {self.minutes:g} --seed {self.seed} --lease-s"
            f" {self.lease_s:g}`: 3 nodes, each behind a proxy and under libfaketime; two routers with [ha];"
            f" ledger and set writers on every node. At most one fault on the nodes (stop, cut or clock step)"
            f" and one on the routers (kill or pause) at a time. **{'PASSED' if self.ok else 'FAILED'}**.\n",
            f"Faults: {len(self.faults)} ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))});"
            f" converged {self.converge_s:.1f} s after the writers stopped"
            if self.converge_s >= 0 else f"Faults: {len(self.faults)}; NOT converged", "",
            "## Checks\n", "| check | result | detail |", "|---|---|---|",
        ]
        lines += [f"| {c.name} | {'ok' if c.ok else '**FAILED**'} | {c.detail} |" for c in self.checks]
        lines += ["", "## Counts\n", *self.counts, "", "## Faults (seconds from the start)\n",
                  "| # | start | end | fault | target | what happened |", "|--:|--:|--:|---|---|---|"]
        lines += [f.row(i + 1) for i, f in enumerate(self.faults)]
        lines += ["", *[f"- {n}" for n in self.notes]]
        return "\n".join(lines) + "\n"


async def run(minutes: float, seed: int, pace_s: float = PACE_S, lease_s: float = LEASE_S,
              base: Path | None = None) -> tuple[Outcome, Path]:
    workdir = Path(tempfile.mkdtemp(prefix="pgmesh-nemesis-", dir=base))
    os.chmod(workdir, 0o755)  # the nodes' directories are in it, and their servers run as postgres
    with LocalNodeSet(["a", "b", "c"], settings=SETTINGS, base_dir=workdir) as nodes:
        bed = Bed(nodes, workdir, lease_s)
        try:
            outcome = await _run(bed, minutes, seed, pace_s)
        finally:
            await bed.close()
    if outcome.ok:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        outcome.notes.append(f"the routers' output and the nodes' logs are in {workdir}")
    return outcome, workdir


async def _run(bed: Bed, minutes: float, seed: int, pace_s: float) -> Outcome:
    notes = [code()]
    if not bed.faketime:
        notes.append("libfaketime is not installed: no clock steps (apt-get install faketime)")
    await bed.under_faketime()
    mesh = await prepare_mesh(list(bed.nodes.values()), SCHEMA, cluster=CLUSTER, extra=CLOCKS)
    await bed.start_routers()
    stop = asyncio.Event()
    tallies = [Tally(w, n) for n in sorted(bed.nodes) for w in WORKLOADS]
    writers = [asyncio.create_task(write(t, bed.nodes[t.node].dsn(), i + 1, stop, pace_s))
               for i, t in enumerate(tallies)]
    nemesis = Nemesis(bed, seed)
    bed.t0 = time.monotonic()
    watches = [asyncio.create_task(bed.watch_routers())]
    if verify_section():
        watches.append(asyncio.create_task(bed.watch_verify()))
    try:
        try:
            await nemesis.run(minutes * 60)
            healed = await bed.heal_all()
            notes += [f"left by a fault, healed at the end: {h}" for h in healed]
        finally:
            stop.set()
            _, late = await asyncio.wait(writers, timeout=60)
            for task in late:
                task.cancel()
        checks, rows, converge_s = await _the_end(bed, mesh, tallies)
    finally:
        for task in watches:
            task.cancel()
    said = [x for x in bed.verify_said if "rows apart none" not in x]
    notes.append("continuous verification during the run: " + ("; ".join(bed.verify_said[-20:]) if said
                 else "reported no row apart"))
    checks.append(Check("no router exited by itself", not bed.crashes, "; ".join(bed.crashes) or "none"))
    return Outcome(seed, minutes, nemesis.faults, checks, counts_table(rows, tallies), converge_s, notes,
                   bed.lease_s)


async def _the_end(bed: Bed, mesh: Mesh, tallies: list[Tally]) -> tuple[list[Check], dict[str, Any], float]:
    """Until converged (bounded), then every check."""
    stopped = time.monotonic()
    converge_s = -1.0
    while time.monotonic() - stopped < CONVERGE_S:
        with contextlib.suppress(Exception):
            if await converged(mesh.nodes, TABLES):
                converge_s = time.monotonic() - stopped
                break
        await asyncio.sleep(2)
    rows = {name: await read_node(node.dsn()) for name, node in sorted(bed.nodes.items())}
    checks = [Check("converged: identical rows on every node", converge_s >= 0,
                    f"{converge_s:.1f} s after the writers stopped" if converge_s >= 0
                    else f"not within {CONVERGE_S:.0f} s")]
    checks += check_rows(rows, tallies)
    roles = {n: await bed.routers.role(n) for n in sorted(bed.routers.procs)}
    actives = [n for n, r in roles.items() if r == "active"]
    port = bed.routers.ports[actives[0]] if actives else None
    checks.append(await compare(mesh.nodes, CLUSTER, CLOCKS, bed.workdir, port or 0))
    checks.append(Check("exactly one active router", len(actives) == 1, f"roles {roles}"))
    checks.append(await verification(port))
    return checks, rows, converge_s


async def main(minutes: float, seed: int | None, report: Path | None, pace_s: float = PACE_S,
               lease_s: float = LEASE_S) -> int:
    seed = seed if seed is not None else random.randrange(1, 10**6)
    print(f"nemesis: seed {seed}, {minutes:g} minutes", flush=True)
    outcome, _ = await run(minutes, seed, pace_s, lease_s)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = outcome.render(when)
    print(text)
    if report is None:
        RESULTS.mkdir(parents=True, exist_ok=True)
        report = RESULTS / f"nemesis-{time.strftime('%Y-%m-%d-%H%M', time.gmtime())}.md"
    report.write_text(text)
    print(f"report: {report}")
    return 0 if outcome.ok else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nemesis", action="store_true", help="the randomized fault run (bench.nemesis)")
    parser.add_argument("--minutes", type=float, default=30.0, help="--nemesis: how long the faults go on")
    parser.add_argument("--seed", type=int, help="--nemesis: the schedule's seed (default: a random one)")
    parser.add_argument("--lease-s", type=float, default=LEASE_S, help="--nemesis: the routers' [ha] lease_s")
    parser.add_argument("--pace-ms", type=float, default=PACE_S * 1000,
                        help="--nemesis: each writer's least time between two transactions")
