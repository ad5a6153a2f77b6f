"""Hot keys: three nodes write the same 200 keys at full speed; how soon do they agree once writes stop?

Three throw-away nodes a, b and c hold one table `hot` with 200 keys seeded through pgmesh itself. With
the router running in this process, one client per node (an asyncio task, autocommit single-statement
transactions one after the other) updates (70%), deletes (15%) and re-inserts (15%, `INSERT ... ON
CONFLICT DO UPDATE`) random keys for `--seconds`. Then the writes stop and the rows of every node are
compared every 50 ms until they are identical or `--limit` seconds have passed ("not converged"; also at
once when a link is in error, which only an operator's resume ends).

Reported per run: transactions committed per node (and how many changed a row: an update or delete of a
missing key commits without writing, so there is nothing to replicate), the convergence time (to the
first poll that finds identical rows; the transactions the links still had queued then are shown), each
link's apply rate while the clients wrote (the applier's `applied_transactions`) and the conflicts it
decided, the conflicts recorded on each node, the CPU of the router (this process's CPU less the
clients' thread), of the clients and of each node's server processes, and every link or source that
ended in error with its last error. `--runs N` repeats on fresh nodes and prints medians; the exit
status is 1 when a run did not converge.

    .venv/bin/python -m bench.micro.hotkeys                       # 30 s of writes, 1 run
    .venv/bin/python -m bench.micro.hotkeys --seconds 5 --runs 3 --json /tmp/hotkeys.json

Owns: this workload (the `hot` table and its statement mix). Must not: judge a conflict itself (the
router decides; the counts are read from the nodes' conflict history), or touch a node it did not create.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import psycopg

from router.apply.state import LinkState
from router.config.model import Config
from router.service.supervisor import Router
from router.testing.localnodes import LocalNode, create_nodes
from router.testing.mesh import running_router, setup_mesh, wait_for

NODES = ("a", "b", "c")
KEYS = 200
SCHEMA = "CREATE TABLE hot (id int PRIMARY KEY, v int NOT NULL, who text NOT NULL);"
ROWS = "SELECT id, v, who FROM hot ORDER BY id"
# the statement mix: (share, statement); each one is its own autocommit transaction
MIX: tuple[tuple[float, str], ...] = (
    (0.70, "UPDATE hot SET v = v + 1, who = %(who)s WHERE id = %(id)s"),
    (0.15, "DELETE FROM hot WHERE id = %(id)s"),
    (0.15, "INSERT INTO hot (id, v, who) VALUES (%(id)s, 0, %(who)s)"
           " ON CONFLICT (id) DO UPDATE SET v = hot.v + 1, who = EXCLUDED.who"),
)
POLL = 0.05


class ClientResult(msgspec.Struct):
    committed: int = 0  # statements that committed (each its own transaction)
    changed: int = 0  # of those, the ones that changed a row (rowcount > 0)
    failed: int = 0  # statements that raised (counted by SQLSTATE in `errors`)
    errors: dict[str, int] = msgspec.field(default_factory=dict)


class LinkResult(msgspec.Struct):
    applied_during_writes: int
    rate_during_writes: float  # applied transactions per second while the clients wrote
    applied_until_end: int  # from the first write until converged (or the limit)
    conflicts: int  # decided on this link (the applier's conflict_counts(), as /metrics reads them)
    state: str
    last_error: str | None


class RunResult(msgspec.Struct):
    seconds: float  # the clients' write window, measured
    clients: dict[str, ClientResult]
    converged: bool
    convergence_s: float | None  # from the writes' end until identical rows everywhere
    waited_s: float
    queued_then: int  # transactions the links still had queued when the rows were first identical
    links: dict[str, LinkResult]  # "a->b"
    conflicts: dict[str, int]  # rows of pgmesh.conflict_history per node
    rows: dict[str, int]  # rows of `hot` per node at the end
    router_cpu_s: float
    clients_cpu_s: float
    nodes_cpu_s: dict[str, float | None]
    source_errors: dict[str, str]


# ------------------------------------------------------------------ clients


async def _client(dsn: str, who: str, until: float, rng: random.Random) -> ClientResult:
    """One statement per transaction, one after the other (not pipelined: psycopg's pipeline would run
    all statements up to its next Sync as one implicit transaction)."""
    result = ClientResult()
    weights = [share for share, _ in MIX]
    statements = [sql for _, sql in MIX]
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < until:
            sql = rng.choices(statements, weights)[0]
            try:
                cur = await conn.execute(sql, {"id": rng.randint(1, KEYS), "who": who})
            except psycopg.Error as exc:
                if conn.closed or conn.broken:
                    raise
                state = exc.sqlstate or type(exc).__name__
                result.errors[state] = result.errors.get(state, 0) + 1
                result.failed += 1
                continue
            result.committed += 1
            result.changed += cur.rowcount > 0
    return result


def _clients_thread(nodes: Sequence[LocalNode], seconds: float, seed: int) -> tuple[dict[str, ClientResult],
                                                                                    float, float]:
    """Run the clients on their own event loop in this thread: their results, the window, their CPU."""

    async def all_clients() -> tuple[dict[str, ClientResult], float]:
        started = time.monotonic()
        until = started + seconds
        async with asyncio.TaskGroup() as group:
            tasks = {
                n.name: group.create_task(_client(n.dsn(), n.name, until, random.Random(f"{seed}:{n.name}")))
                for n in nodes
            }
        return {name: task.result() for name, task in tasks.items()}, time.monotonic() - started

    cpu = time.thread_time()
    results, window = asyncio.run(all_clients())
    return results, window, time.thread_time() - cpu


# ------------------------------------------------------------------ measuring


def _clock_ticks() -> int:
    return int(os.sysconf("SC_CLK_TCK"))


def _proc_times(pid: int) -> tuple[int, int, float]:
    """(ppid, own + reaped children's CPU ticks, own ticks) of a process, from /proc/<pid>/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2:].split()  # fields from the 3rd (state) on
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return int(fields[1]), utime + stime + cutime + cstime, utime + stime


def node_cpu_seconds(node: LocalNode) -> float | None:
    """CPU of the node's postmaster and every child it has or had (reaped children count in its cutime)."""
    try:
        postmaster = int((node.datadir / "postmaster.pid").read_text().split()[0])
        _, total, _ = _proc_times(postmaster)
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == postmaster:
                continue
            try:
                ppid, ticks, _ = _proc_times(int(entry))
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile, or not readable
            if ppid == postmaster:
                total += ticks
    except (OSError, ValueError, IndexError):
        return None
    return total / _clock_ticks()


def _applied(router: Router) -> dict[str, int]:
    return {f"{s}->{t}": a.stats.applied_transactions for (s, t), a in router.appliers.items()}


def _links_in_error(router: Router) -> list[str]:
    return [f"{s}->{t}" for (s, t), a in router.appliers.items() if a.state is LinkState.ERROR]


async def _wait_identical(
    router: Router, nodes: Sequence[LocalNode], limit: float
) -> tuple[bool, float, int]:
    """Poll every node's rows until all are identical, the limit passes or a link is in error: whether they
    became identical, when, and how many transactions the links still had queued then."""
    conns = [await psycopg.AsyncConnection.connect(n.dsn(), autocommit=True) for n in nodes]
    started = time.monotonic()
    try:
        while True:
            rows = [await (await conn.execute(ROWS)).fetchall() for conn in conns]
            waited = time.monotonic() - started
            if all(r == rows[0] for r in rows[1:]):
                return True, waited, sum(link.queued for link in router.status().links)
            if waited > limit or _links_in_error(router):
                return False, waited, sum(link.queued for link in router.status().links)
            await asyncio.sleep(POLL)
    finally:
        for conn in conns:
            await conn.close()


async def _scalar(dsn: str, query: str) -> int:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        row = await (await conn.execute(query)).fetchone()
        assert row is not None
        return int(row[0])


async def _seed(nodes: Sequence[LocalNode]) -> None:
    """The 200 keys written on a and replicated by the running router, so every node has them."""
    async with await psycopg.AsyncConnection.connect(nodes[0].dsn(), autocommit=True) as conn:
        await conn.execute(f"INSERT INTO hot SELECT i, 0, 'a' FROM generate_series(1, {KEYS}) i")

    async def seeded() -> bool:
        counts = [await _scalar(n.dsn(), "SELECT count(*) FROM hot") for n in nodes]
        return all(count == KEYS for count in counts)

    await wait_for(seeded, "the seeded keys on every node", limit=120)


# ------------------------------------------------------------------ one run


async def one_run(seconds: float, limit: float, seed: int) -> RunResult:
    nodes: list[LocalNode] = await asyncio.to_thread(create_nodes, list(NODES))
    try:
        config: Config = await setup_mesh(nodes, SCHEMA)
        async with running_router(config, admin=False) as router:
            await _seed(nodes)
            before = _applied(router)
            cpu, node_cpu = time.process_time(), {n.name: node_cpu_seconds(n) for n in nodes}
            clients, window, clients_cpu = await asyncio.to_thread(_clients_thread, nodes, seconds, seed)
            during = _applied(router)
            converged, waited, queued = await _wait_identical(router, nodes, limit)
            router_cpu = time.process_time() - cpu - clients_cpu
            node_cpu = {n.name: _delta(node_cpu_seconds(n), node_cpu[n.name]) for n in nodes}
            after = _applied(router)
            status = router.status()
            links = {
                f"{link.source}->{link.target}": LinkResult(
                    applied_during_writes=during[key] - before[key],
                    rate_during_writes=(during[key] - before[key]) / window,
                    applied_until_end=after[key] - before[key],
                    conflicts=sum(router.appliers[(link.source, link.target)].conflict_counts().values()),
                    state=link.state, last_error=link.last_error,
                )
                for link in status.links
                for key in [f"{link.source}->{link.target}"]
            }
            sources = {s.node: s.last_error for s in status.sources if s.state == "error" and s.last_error}
        history = "SELECT count(*) FROM pgmesh.conflict_history"
        conflicts = {n.name: await _scalar(n.dsn(), history) for n in nodes}
        rows = {n.name: await _scalar(n.dsn(), "SELECT count(*) FROM hot") for n in nodes}
        return RunResult(
            seconds=window, clients=clients, converged=converged, convergence_s=waited if converged else None,
            waited_s=waited, queued_then=queued, links=links, conflicts=conflicts, rows=rows,
            router_cpu_s=router_cpu, clients_cpu_s=clients_cpu, nodes_cpu_s=node_cpu, source_errors=sources,
        )
    finally:
        for node in nodes:
            await asyncio.to_thread(node.destroy)


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


# ------------------------------------------------------------------ report


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def medians(runs: Sequence[RunResult]) -> dict[str, Any]:
    """The median of every number over the runs (convergence over the converged runs only)."""
    first = runs[0]
    return {
        "committed": {n: _median([r.clients[n].committed for r in runs]) for n in first.clients},
        "changed": {n: _median([r.clients[n].changed for r in runs]) for n in first.clients},
        "converged_runs": sum(r.converged for r in runs),
        "convergence_s": _median([r.convergence_s for r in runs]),
        "rate_during_writes": {link: _median([r.links[link].rate_during_writes for r in runs])
                               for link in first.links},
        "link_conflicts": {link: _median([r.links[link].conflicts for r in runs]) for link in first.links},
        "conflicts": {n: _median([r.conflicts[n] for r in runs]) for n in first.conflicts},
        "router_cpu_s": _median([r.router_cpu_s for r in runs]),
        "clients_cpu_s": _median([r.clients_cpu_s for r in runs]),
        "nodes_cpu_s": {n: _median([r.nodes_cpu_s[n] for r in runs]) for n in first.nodes_cpu_s},
    }


def _num(value: float | None, fmt: str = ",.0f") -> str:
    return "-" if value is None else format(value, fmt)


def render(runs: Sequence[RunResult], seconds: float, limit: float) -> str:
    m = medians(runs)
    lines = [
        f"pgmesh hot keys: nodes {', '.join(NODES)}, {KEYS} shared keys, one client per node,"
        f" {seconds:g} s of writes, limit {limit:g} s, {len(runs)} run(s), medians",
        "",
        "| node | committed tx | of which changed a row | conflicts recorded | node CPU s |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {n} | {_num(m['committed'][n])} | {_num(m['changed'][n])} | {_num(m['conflicts'][n])}"
              f" | {_num(m['nodes_cpu_s'][n], '.1f')} |" for n in m["committed"]]
    lines += ["", "| link | applied tx/s during writes | conflicts decided |", "|---|---:|---:|"]
    lines += [f"| {k} | {_num(rate, ',.1f')} | {_num(m['link_conflicts'][k])} |"
              for k, rate in m["rate_during_writes"].items()]
    converged = (f"{m['convergence_s']:.2f} s after the writes stopped" if m["convergence_s"] is not None
                 else f"not converged within {limit:g} s")
    lines += [
        "",
        f"- convergence: {converged} ({m['converged_runs']} of {len(runs)} run(s) converged)",
        f"- router CPU: {_num(m['router_cpu_s'], '.1f')} s"
        f" (the clients' own, not included: {_num(m['clients_cpu_s'], '.1f')} s),"
        " from the first write until converged or the limit",
    ]
    for i, run in enumerate(runs, 1):
        if not run.converged:
            lines.append(f"- run {i}: not converged after {run.waited_s:.1f} s; rows per node {run.rows}")
        if run.queued_then:
            lines.append(f"- run {i}: identical while the links still had {run.queued_then} tx queued")
        for key, link in run.links.items():
            if link.state != LinkState.STREAMING.value or link.last_error:
                lines.append(f"- run {i}: link {key} {link.state}: {link.last_error}")
        for node, error in run.source_errors.items():
            lines.append(f"- run {i}: source {node} in error: {error}")
        for node, client in run.clients.items():
            if client.failed:
                lines.append(f"- run {i}: client {node}: {client.failed} statement(s) failed {client.errors}")
    return "\n".join(lines)


def to_json(runs: Sequence[RunResult], params: Mapping[str, Any]) -> bytes:
    doc = {"bench": "hotkeys", "params": dict(params), "runs": runs, "median": medians(runs)}
    return msgspec.json.format(msgspec.json.encode(doc), indent=2)


def main(argv: Sequence[str] | None = None) -> int:
    about = (__doc__ or "").splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m bench.micro.hotkeys", description=about)
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the clients write")
    parser.add_argument("--limit", type=float, default=240.0, help="longest wait for convergence (s)")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    runs = [asyncio.run(one_run(args.seconds, args.limit, args.seed + i)) for i in range(args.runs)]
    print(render(runs, args.seconds, args.limit))
    if args.json is not None:
        params = {"seconds": args.seconds, "limit": args.limit, "runs": args.runs, "seed": args.seed,
                  "keys": KEYS, "nodes": list(NODES), "mix": [share for share, _ in MIX]}
        args.json.write_bytes(to_json(runs, params))
    return 0 if all(r.converged for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
