"""What pgmesh costs a node's own writes: a big DELETE and pgbench TPC-B beside a plain node, and a big
INSERT reaching the other node with and without tombstones in its table.

Three throw-away nodes with the same settings (router.testing.localnodes): a and b, set up as a pgmesh
mesh (`pgmesh init` after `pgbench -i -s 1` on each, so the pgbench tables are replicated too), and
`plain`, which never sees pgmesh. One run measures, in this order:

1. With the router running (in this process): the INSERT of `--rows` keys into `ins_clean` (no tombstones)
   and into `ins_tomb` (after `--tombstones` other keys were inserted and deleted there, so
   `pgmesh.tombstones` holds keys of that table): the time from the INSERT's commit on a (its autocommit
   statement returned) until every row is visible on b.
2. Still running: `big` filled with `--rows` keys (replicated to b and waited for), VACUUM ANALYZE and
   CHECKPOINT, then the client-side wall time of `DELETE FROM big` on a; then how long until b is empty.
   Then `pgbench -c 2 -j 2 -T --seconds` on a (b applies meanwhile: the router and b share the machine).
3. With the router stopped: the same DELETE on a (other keys, as in 2) and on plain; pgbench on a and
   on plain, in turns (3 each, medians), each after a CHECKPOINT, with a's slot advanced to the end of
   its WAL first, as a router that keeps up confirms it (a stopped one would keep a's WAL from being
   recycled, and new WAL segments cost pgbench there, not pgmesh's triggers).

`--runs N` repeats on fresh nodes; medians are printed as a markdown table. The ratios are pgmesh / plain
for the DELETE (issue 18's target: at most 2x) and plain / pgmesh for pgbench's tps (at most 1.1x).

    .venv/bin/python -m bench.micro.writecost                                    # 1M rows, 20 s, 3 runs
    .venv/bin/python -m bench.micro.writecost --rows 20000 --seconds 5 --runs 1 --json /tmp/writecost.json

Owns: this workload (the `big`, `ins_clean` and `ins_tomb` tables, the pgbench runs). Must not: judge
what pgmesh does with the rows (the router replicates, the nodes' triggers write tombstones), or touch a
node it did not create.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import psycopg
from psycopg import sql

from router.testing.localnodes import LocalNode, create_nodes, find_pg_bindir
from router.testing.mesh import execute, running_router, setup_mesh

TABLES = ("big", "ins_clean", "ins_tomb")
SCHEMA = "".join(f"CREATE TABLE {t} (id int PRIMARY KEY, v int, pad text);" for t in TABLES)
FILL = "INSERT INTO {} SELECT i, i, md5(i::text) FROM generate_series(%s::int, %s::int) i"
TOMBSTONES = "SELECT count(*) FROM pgmesh.tombstones WHERE table_name LIKE '%ins\\_tomb%'"
POLL = 0.05
TPC_B_TURNS = 3
ADVANCE = "SELECT pg_replication_slot_advance(%s, pg_current_wal_lsn())"
_TPS = re.compile(r"^tps = ([0-9.]+)", re.MULTILINE)


class RunResult(msgspec.Struct):
    insert_clean_s: float | None  # commit on a -> all rows visible on b; None: not within the limit
    insert_tombstones_s: float | None
    tombstones_a: int  # rows of pgmesh.tombstones for ins_tomb before its big insert
    tombstones_b: int
    delete_plain_s: float
    delete_stopped_s: float  # a, router stopped
    delete_running_s: float  # a, router running
    delete_reached_b_s: float | None  # from the DELETE's commit on a until b's `big` is empty
    tps_plain: float
    tps_stopped: float
    tps_running: float


# ------------------------------------------------------------------ statements


async def _scalar(dsn: str, query: str, params: Any = None) -> int:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        row = await (await conn.execute(query, params)).fetchone()
        assert row is not None
        return int(row[0])


async def _fill(dsn: str, table: str, first: int, rows: int) -> float:
    """Insert keys first .. first + rows - 1 in one autocommit statement; return when it committed."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(sql.SQL(FILL).format(sql.Identifier(table)), [first, first + rows - 1])
        return time.perf_counter()


async def _timed_delete(dsn: str, first: int, rows: int, replica: LocalNode | None = None,
                        limit: float = 0) -> tuple[float, float | None]:
    """Fill `big` (and wait until `replica` has the rows), VACUUM ANALYZE, CHECKPOINT, then time `DELETE
    FROM big`: its wall time, and how long after its commit `replica` held no row (None: no replica, or
    not within the limit)."""
    await execute(dsn, "VACUUM big")  # the dead rows of an earlier run's DELETE go first
    committed = await _fill(dsn, "big", first, rows)
    if replica is not None:
        await _visible(replica.dsn(), "big", first, rows, committed, limit)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("VACUUM ANALYZE big")
        await conn.execute("CHECKPOINT")
        started = time.perf_counter()
        await conn.execute("DELETE FROM big")
        deleted = time.perf_counter()
    reached = None
    if replica is not None:
        reached = await _until(replica.dsn(), sql.SQL("SELECT NOT EXISTS (SELECT FROM big)"), deleted, limit)
    return deleted - started, reached


async def _until(
    dsn: str, query: sql.SQL | sql.Composed, since: float, limit: float, params: Any = None
) -> float | None:
    """Poll a boolean query until it holds: seconds from `since`, or None after `limit` seconds."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while True:
            row = await (await conn.execute(query, params)).fetchone()
            now = time.perf_counter()
            if row is not None and row[0]:
                return now - since
            if now - since > limit:
                return None
            await asyncio.sleep(POLL)


async def _visible(dsn: str, table: str, first: int, rows: int, since: float, limit: float) -> float | None:
    """Seconds from `since` until all of keys first .. first + rows - 1 are visible in `table`: the last
    key by its index first (cheap while the apply runs), then the whole count."""
    name = sql.Identifier(table)
    last = sql.SQL("SELECT EXISTS (SELECT FROM {} WHERE id = %s)").format(name)
    if await _until(dsn, last, since, limit, [first + rows - 1]) is None:
        return None
    every = sql.SQL("SELECT count(*) = %s FROM {} WHERE id BETWEEN %s AND %s").format(name)
    return await _until(dsn, every, since, limit, [rows, first, first + rows - 1])


# ------------------------------------------------------------------ pgbench


async def _pgbench(node: LocalNode, *args: str) -> str:
    """pgbench from the harness's PostgreSQL bin dir against the node; its stdout."""
    argv = [str(find_pg_bindir() / "pgbench"), "-h", node.host, "-p", str(node.port), "-U", "postgres",
            *args, node.dbname]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}  # nothing redirects it elsewhere
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, env=env)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip()[-1500:]
        raise RuntimeError(f"node {node.name}: pgbench {' '.join(args)} exited {proc.returncode}: {tail}")
    return out.decode(errors="replace")


async def _tps(node: LocalNode, seconds: int) -> float:
    out = await _pgbench(node, "-c", "2", "-j", "2", "-T", str(seconds))
    found = _TPS.search(out)
    if found is None:
        raise RuntimeError(f"node {node.name}: no tps in pgbench's output: {out.strip()[-500:]}")
    return float(found.group(1))


# ------------------------------------------------------------------ one run


async def _inserts(a: LocalNode, b: LocalNode, rows: int, tombstones: int,
                   limit: float) -> tuple[float | None, float | None, int, int]:
    """Router running: the big insert into ins_clean, then into ins_tomb after `tombstones` keys were
    inserted and deleted there; each timed from its commit on a until visible on b."""
    first = tombstones + 1  # the big inserts use other keys than the deleted ones
    if tombstones:
        await _fill(a.dsn(), "ins_tomb", 1, tombstones)
        await execute(a.dsn(), "DELETE FROM ins_tomb")
        deleted = time.perf_counter()
        # b applied them (an empty table is not enough: b may not have had the rows yet) and a recorded
        # them (a's own deletes: by the router after their commit, router.apply.recorder)
        recorded = sql.SQL("SELECT count(*) >= %s FROM pgmesh.tombstones"
                           " WHERE table_name = 'public.ins_tomb'")
        for node in (b, a):
            if await _until(node.dsn(), recorded, deleted, limit, [tombstones]) is None:
                raise RuntimeError(f"node {node.name}: {tombstones} tombstones of ins_tomb not there"
                                   f" within {limit:g} s")
    counts = (await _scalar(a.dsn(), TOMBSTONES), await _scalar(b.dsn(), TOMBSTONES))
    times = []
    for table in ("ins_clean", "ins_tomb"):
        committed = await _fill(a.dsn(), table, first, rows)
        times.append(await _visible(b.dsn(), table, first, rows, committed, limit))
    return times[0], times[1], *counts


async def one_run(rows: int, seconds: int, tombstones: int, limit: float) -> RunResult:
    nodes: list[LocalNode] = await asyncio.to_thread(create_nodes, ["a", "b", "plain"])
    try:
        a, b, plain = nodes
        for node in nodes:
            await _pgbench(node, "-i", "-s", "1", "-q")
        await execute(plain.dsn(), SCHEMA)
        config = await setup_mesh([a, b], SCHEMA)  # after pgbench -i: its tables are replicated too
        async with running_router(config, admin=False):
            clean, tomb, tombs_a, tombs_b = await _inserts(a, b, rows, tombstones, limit)
            delete_running, reached = await _timed_delete(a.dsn(), 1, rows, replica=b, limit=limit)
            tps_running = await _tps(a, seconds)
        delete_stopped, _ = await _timed_delete(a.dsn(), rows + 1, rows)  # new keys: new tombstones, as above
        delete_plain, _ = await _timed_delete(plain.dsn(), 1, rows)
        # pgbench, router stopped: a and plain in turns (TPC_B_TURNS each, medians), each after a
        # CHECKPOINT, and a's slot advanced to its WAL's end first, as a router that keeps up confirms
        # it: a stopped router would otherwise keep a's WAL from being recycled (new segments cost)
        stopped: list[float] = []
        plain_tps: list[float] = []
        for _ in range(TPC_B_TURNS):
            await execute(a.dsn(), ADVANCE, params=[config.slot_name])
            await execute(a.dsn(), "CHECKPOINT")
            stopped.append(await _tps(a, seconds))
            await execute(plain.dsn(), "CHECKPOINT")
            plain_tps.append(await _tps(plain, seconds))
        tps_stopped = statistics.median(stopped)
        tps_plain = statistics.median(plain_tps)
        return RunResult(
            insert_clean_s=clean, insert_tombstones_s=tomb, tombstones_a=tombs_a, tombstones_b=tombs_b,
            delete_plain_s=delete_plain, delete_stopped_s=delete_stopped, delete_running_s=delete_running,
            delete_reached_b_s=reached, tps_plain=tps_plain, tps_stopped=tps_stopped, tps_running=tps_running,
        )
    finally:
        for node in nodes:
            await asyncio.to_thread(node.destroy)


# ------------------------------------------------------------------ report


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def medians(runs: Sequence[RunResult]) -> dict[str, float | None]:
    """The median of every number over the runs (a time over the runs that reached it)."""
    return {field: _median([getattr(r, field) for r in runs]) for field in RunResult.__struct_fields__}


def _ratio(top: float | None, bottom: float | None) -> str:
    return "-" if top is None or not bottom else f"{top / bottom:.2f}x"


def _num(value: float | None, fmt: str) -> str:
    return "not reached" if value is None else format(value, fmt)


def render(runs: Sequence[RunResult], rows: int, seconds: int, tombstones: int, limit: float) -> str:
    m = medians(runs)
    lines = [
        f"pgmesh write cost: {rows:,} rows, pgbench -s 1 -c 2 -j 2 -T {seconds}, {len(runs)} run(s), medians;"
        " pgmesh = node a of a 2-node mesh, plain = same settings, no pgmesh",
        "",
        "| measure | plain | pgmesh, router stopped | ratio | pgmesh, router running | ratio | target |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| `DELETE FROM big` ({rows:,} rows), s | {_num(m['delete_plain_s'], '.3f')}"
        f" | {_num(m['delete_stopped_s'], '.3f')} | {_ratio(m['delete_stopped_s'], m['delete_plain_s'])}"
        f" | {_num(m['delete_running_s'], '.3f')} | {_ratio(m['delete_running_s'], m['delete_plain_s'])}"
        " | <= 2x |",
        f"| pgbench TPC-B, tps | {_num(m['tps_plain'], ',.0f')} | {_num(m['tps_stopped'], ',.0f')}"
        f" | {_ratio(m['tps_plain'], m['tps_stopped'])} | {_num(m['tps_running'], ',.0f')}"
        f" | {_ratio(m['tps_plain'], m['tps_running'])} | <= 1.1x |",
        "",
        "| router running: INSERT of rows into a, commit -> visible on b | without tombstones"
        f" | with {tombstones:,} tombstones | ratio |",
        "|---|---:|---:|---:|",
        f"| {rows:,} rows, s | {_num(m['insert_clean_s'], '.2f')} | {_num(m['insert_tombstones_s'], '.2f')}"
        f" | {_ratio(m['insert_tombstones_s'], m['insert_clean_s'])} |",
        "",
        "- ratios: pgmesh / plain for the DELETE, plain / pgmesh for tps (a slowdown factor either way)",
        f"- the router-running DELETE reached b (b's `big` empty) {_num(m['delete_reached_b_s'], '.2f')} s"
        " after its commit; during pgbench with the router running, the router and b apply a's"
        " transactions on the same machine",
        f"- pgmesh.tombstones rows of ins_tomb before its insert: a {_num(m['tombstones_a'], ',.0f')},"
        f" b {_num(m['tombstones_b'], ',.0f')}",
    ]
    for i, run in enumerate(runs, 1):
        for field in ("insert_clean_s", "insert_tombstones_s", "delete_reached_b_s"):
            if getattr(run, field) is None:
                lines.append(f"- run {i}: {field} not reached within {limit:g} s")
    return "\n".join(lines)


def to_json(runs: Sequence[RunResult], params: Mapping[str, Any]) -> bytes:
    doc = {"bench": "writecost", "params": dict(params), "runs": runs, "median": medians(runs)}
    return msgspec.json.format(msgspec.json.encode(doc), indent=2)


def main(argv: Sequence[str] | None = None) -> int:
    about = (__doc__ or "").splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m bench.micro.writecost", description=about)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the DELETE and of the INSERTs")
    parser.add_argument("--seconds", type=int, default=20, help="pgbench -T")
    parser.add_argument("--tombstones", type=int, default=1000, help="keys deleted from ins_tomb first")
    parser.add_argument("--limit", type=float, default=900.0, help="longest wait for b to catch up (s)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    runs = [asyncio.run(one_run(args.rows, args.seconds, args.tombstones, args.limit))
            for _ in range(args.runs)]
    print(render(runs, args.rows, args.seconds, args.tombstones, args.limit))
    if args.json is not None:
        params = {"rows": args.rows, "seconds": args.seconds, "tombstones": args.tombstones,
                  "limit": args.limit, "runs": args.runs, "pgbench": "-s 1 -c 2 -j 2"}
        args.json.write_bytes(to_json(runs, params))
    reached = ("insert_clean_s", "insert_tombstones_s", "delete_reached_b_s")
    return 0 if all(getattr(r, f) is not None for r in runs for f in reached) else 1


if __name__ == "__main__":
    sys.exit(main())
