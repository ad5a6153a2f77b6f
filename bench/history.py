"""Bounded history: a hot-key run of `--minutes` keeps each node's pgmesh.conflict_history under its bound.

The hot-key workload of bench.micro.hotkeys (three nodes a, b, c, 200 shared keys, one client per node
writing updates, deletes and upserts as fast as it can, each its own transaction) runs for `--minutes`
with `[conflicts] keep = KEEP` (and `keep_rows`, default 0 here: no cap, so that keep alone is measured).
A sampler thread reads, every `--sample` seconds on every node, `count(*)` of pgmesh.conflict_history
(exact) and `max(id)` (the history's insert counter: every row ever written has an id at or below it).

The bound asserted, per node and sample at time t (`bound_at`): the rows present are at most the rows
written during the last `keep + interval + sample` seconds, read from the ids: `max_id(t) - max_id(t0)`
with t0 the latest sample at or before `t - (keep + interval + sample)` (the run's start for the first
ones). Why: every round (every `interval` = router.conflicts.history.prune_interval(keep)) deletes every row
older than keep, so at t the oldest row left was written after `t - keep - interval - (a round's
length)`; a sample's period covers the round's length and the sampling's own granularity. Rows a link has
not counted yet also stay, but a link counts right after each commit that decided one. The report also
gives the plain form: peak rate (rows/s over any such window) x (keep + interval + sample), and the
largest count seen against it. Exit status 1 when a sample is over its bound, or the nodes did not
converge once the writes stopped.

    .venv/bin/python -m bench.history --minutes 1 --keep 10s      # the check (about 1.5 min)
    .venv/bin/python -m bench.history --minutes 10 --keep 60s     # the issue's run (about 11.5 min)

Writes bench/results/issue38/history-<minutes>m.md and .json (`--out` names another .md).
Must not: judge a conflict (the router decides), or touch a node it did not create.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import psycopg

from bench.micro.hotkeys import KEYS, MIX, NODES, SCHEMA
from router.apply.state import LinkState
from router.config.sections import duration_seconds
from router.conflicts.history import prune_interval
from router.testing.localnodes import LocalNode, create_nodes
from router.testing.mesh import running_router, setup_mesh, wait_converged, wait_for

RESULTS = Path(__file__).resolve().parent / "results" / "issue38"
_SAMPLE_SQL = ("SELECT count(*), coalesce(max(id), 0), pg_catalog.date_part('epoch', clock_timestamp())"
               " FROM pgmesh.conflict_history")


class Sample(msgspec.Struct, array_like=True):
    t: float  # seconds since the writes began (the node's clock: date_part('epoch', ...) less the start)
    rows: int  # count(*) of conflict_history
    max_id: int


class NodeResult(msgspec.Struct):
    samples: list[Sample]
    max_rows: int
    max_rows_at: float
    worst_ratio: float  # the largest rows / bound_at over the samples a whole window into the run
    over: int  # samples over their bound
    written: int  # ids issued during the run (rows written, rollbacks included)
    peak_rate: float  # rows/s over the busiest window of keep + interval + sample
    plain_bound: int  # peak_rate x window
    pruned: int
    batches: int
    capped: int
    rows_end: int
    committed: int  # the client's transactions on this node


class Result(msgspec.Struct):
    minutes: float
    keep: str
    keep_rows: int
    interval_s: float
    sample_s: float
    window_s: float
    nodes: dict[str, NodeResult]
    converged: bool
    convergence_s: float | None
    link_errors: dict[str, str]
    link_conflicts: dict[str, int]  # counted by each link (router.apply.link), into its target


# ------------------------------------------------------------------ the writers and the sampler


def _writers(nodes: Sequence[LocalNode], seconds: float, seed: int) -> dict[str, int]:
    """One client per node on its own loop in this thread, each statement its own transaction: how many
    committed on each node."""

    async def client(node: LocalNode, until: float) -> int:
        rng = random.Random(f"{seed}:{node.name}")
        weights, statements = [w for w, _ in MIX], [s for _, s in MIX]
        committed = 0
        async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
            while time.monotonic() < until:
                try:
                    await conn.execute(rng.choices(statements, weights)[0],
                                       {"id": rng.randint(1, KEYS), "who": node.name})
                    committed += 1
                except psycopg.Error:
                    if conn.closed or conn.broken:
                        raise
        return committed

    async def all_clients() -> dict[str, int]:
        until = time.monotonic() + seconds
        async with asyncio.TaskGroup() as group:
            tasks = {n.name: group.create_task(client(n, until)) for n in nodes}
        return {name: task.result() for name, task in tasks.items()}

    return asyncio.run(all_clients())


def _sampler(nodes: Sequence[LocalNode], every: float, stop: threading.Event,
             out: dict[str, list[Sample]], start: float) -> None:
    """Every `every` seconds, each node's history: exact rows and newest id (its own connection)."""
    conns = {n.name: psycopg.connect(n.dsn(), autocommit=True) for n in nodes}
    try:
        while True:
            for name, conn in conns.items():
                rows, max_id, at = conn.execute(_SAMPLE_SQL).fetchone() or (0, 0, start)
                out[name].append(Sample(float(at) - start, int(rows), int(max_id)))
            if stop.wait(every):
                break
        for name, conn in conns.items():  # one more after the writes
            rows, max_id, at = conn.execute(_SAMPLE_SQL).fetchone() or (0, 0, start)
            out[name].append(Sample(float(at) - start, int(rows), int(max_id)))
    finally:
        for conn in conns.values():
            conn.close()


# ------------------------------------------------------------------ the bound


def bound_at(samples: Sequence[Sample], i: int, window: float) -> int:
    """Rows written during the `window` seconds before sample i (from the ids; see the docstring)."""
    t = samples[i].t
    earlier = [s for s in samples[:i + 1] if s.t <= t - window]
    base = earlier[-1].max_id if earlier else samples[0].max_id - samples[0].rows
    return samples[i].max_id - base


def peak_rate(samples: Sequence[Sample], window: float) -> float:
    """The largest rows/s over any span of at least `window` seconds between two samples."""
    best = 0.0
    for i, last in enumerate(samples):
        earlier = [s for s in samples[:i] if s.t <= last.t - window]
        if earlier:
            first = earlier[-1]
            best = max(best, (last.max_id - first.max_id) / (last.t - first.t))
    return best


def judge(samples: list[Sample], window: float) -> tuple[int, float, float, int, float]:
    """(max rows, when, worst rows/bound once a whole window into the run (before, the bound is every
    row written: met trivially), samples over their bound, peak rate)."""
    worst, over, top, top_at = 0.0, 0, 0, 0.0
    for i, sample in enumerate(samples):
        bound = bound_at(samples, i, window)
        if sample.rows > top:
            top, top_at = sample.rows, sample.t
        if bound > 0 and sample.t >= samples[0].t + window:
            worst = max(worst, sample.rows / bound)
        over += sample.rows > bound
    return top, top_at, worst, over, peak_rate(samples, window)


# ------------------------------------------------------------------ the run


async def _seed(nodes: Sequence[LocalNode]) -> None:
    async with await psycopg.AsyncConnection.connect(nodes[0].dsn(), autocommit=True) as conn:
        await conn.execute(f"INSERT INTO hot SELECT i, 0, 'a' FROM generate_series(1, {KEYS}) i")

    async def seeded() -> bool:
        for node in nodes:
            async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
                row = await (await conn.execute("SELECT count(*) FROM hot")).fetchone()
                if row is None or row[0] != KEYS:
                    return False
        return True

    await wait_for(seeded, "the seeded keys on every node", limit=120)


async def run(minutes: float, keep: str, keep_rows: int, every: float, seed: int) -> Result:
    keep_s = duration_seconds(keep)
    interval = prune_interval(keep_s)
    window = keep_s + interval + every
    nodes: list[LocalNode] = await asyncio.to_thread(create_nodes, list(NODES))
    try:
        extra = f'[conflicts]\nkeep = "{keep}"\nkeep_rows = {keep_rows}\n'
        config = await setup_mesh(nodes, SCHEMA, extra=extra)
        async with running_router(config, admin=False) as router:
            await _seed(nodes)
            samples: dict[str, list[Sample]] = {n.name: [] for n in nodes}
            stop = threading.Event()
            sampler = threading.Thread(target=_sampler, args=(nodes, every, stop, samples, time.time()))
            sampler.start()
            try:
                committed = await asyncio.to_thread(_writers, nodes, minutes * 60, seed)
            finally:
                stop.set()
                await asyncio.to_thread(sampler.join)
            ended = time.monotonic()
            try:
                await wait_converged(nodes, ["hot"], limit=300)
                converged, took = True, time.monotonic() - ended
            except AssertionError:
                converged, took = False, None
            stats = router.history.stats
            errors = {f"{s}->{t}": str(a.last_error) for (s, t), a in router.appliers.items()
                      if a.last_error is not None or a.state is LinkState.ERROR}
            counted: dict[str, int] = {}
            for (s, t), applier in router.appliers.items():
                counted[f"{s}->{t}"] = sum(applier.conflict_counts().values())
        results = {}
        for node in nodes:
            got = samples[node.name]
            top, top_at, worst, over, rate = judge(got, window)
            st = stats[node.name]
            results[node.name] = NodeResult(
                samples=got, max_rows=top, max_rows_at=top_at, worst_ratio=worst, over=over,
                written=got[-1].max_id - (got[0].max_id - got[0].rows), peak_rate=rate,
                plain_bound=int(rate * window), pruned=st.pruned, batches=st.batches, capped=st.capped,
                rows_end=got[-1].rows, committed=committed[node.name],
            )
        return Result(minutes=minutes, keep=keep, keep_rows=keep_rows, interval_s=interval, sample_s=every,
                      window_s=window, nodes=results, converged=converged, convergence_s=took,
                      link_errors=errors, link_conflicts=counted)
    finally:
        for node in nodes:
            await asyncio.to_thread(node.destroy)


def passed(result: Result) -> bool:
    return result.converged and not result.link_errors and all(n.over == 0 for n in result.nodes.values())


def render(result: Result) -> str:
    r = result
    cap = f"keep_rows = {r.keep_rows:,}" if r.keep_rows else "keep_rows = 0 (no cap)"
    lines = [
        f"pgmesh bounded history: nodes {', '.join(NODES)}, {KEYS} hot keys, {r.minutes:g} min of writes,"
        f" keep = {r.keep} ({cap}), pruning every {r.interval_s:g} s, sampled every {r.sample_s:g} s",
        "",
        f"Bound per sample: rows <= rows written in the last keep + interval + sample = {r.window_s:g} s"
        " (from conflict_history's ids).",
        "",
        "| node | tx committed | history rows written | peak rate rows/s | max rows (at s) | peak rate x"
        f" {r.window_s:g} s | worst rows/bound after {r.window_s:g} s | samples over | pruned (batches)"
        " | rows at the end |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, n in r.nodes.items():
        lines.append(
            f"| {name} | {n.committed:,} | {n.written:,} | {n.peak_rate:,.0f} | {n.max_rows:,}"
            f" ({n.max_rows_at:.0f}) | {n.plain_bound:,} | {n.worst_ratio:.2f} | {n.over} of"
            f" {len(n.samples)} | {n.pruned:,} ({n.batches:,}) | {n.rows_end:,} |"
        )
    converged = f"{r.convergence_s:.1f} s after the writes stopped" if r.convergence_s is not None else (
        "NOT converged within 300 s")
    errors = ", ".join(f"{k}: {v}" for k, v in r.link_errors.items()) or "none"
    counted = ", ".join(f"{k} {v:,}" for k, v in r.link_conflicts.items())
    lines += ["", f"- convergence: {converged}", f"- links in error: {errors}",
              f"- conflicts counted by the links: {counted}", f"- verdict: {'PASS' if passed(r) else 'FAIL'}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    about = (__doc__ or "").splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m bench.history", description=about)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the clients write")
    parser.add_argument("--keep", default="60s", help="[conflicts] keep (a duration: 10s, 1m, ...)")
    parser.add_argument("--keep-rows", type=int, default=0, help="[conflicts] keep_rows (0: no cap)")
    parser.add_argument("--sample", type=float, default=3.0, help="seconds between samples")
    parser.add_argument("--seed", type=int, default=38)
    parser.add_argument("--out", type=Path, help="the report (.md; the numbers beside it as .json)")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args.minutes, args.keep, args.keep_rows, args.sample, args.seed))
    text = render(result)
    print(text)
    out: Path = args.out or RESULTS / f"history-{args.minutes:g}m.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    params = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {"out": str(out)}
    doc: dict[str, Any] = {"bench": "history", "params": params, "result": result}
    out.with_suffix(".json").write_bytes(msgspec.json.format(msgspec.json.encode(doc), indent=2))
    return 0 if passed(result) else 1


if __name__ == "__main__":
    sys.exit(main())
