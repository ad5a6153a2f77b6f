"""`pgmesh compare` and `pgmesh repair` against the floor (issue 22's bench).

Three nodes a, b, c, each loaded with the same `--rows` rows (pgbench_accounts' shape: bigint key, two
ints, a char(84) filler), loaded on each node before pgmesh is installed (identical, not replicated), then
pgmesh and the router (a process of its own). Measured, wall clock:

- the floor: one server-side hash pass over the table on each node, the three at once
  (`SELECT bit_xor(hashtextextended((t.*)::text, 1))`: nothing can compare without reading every row);
- `compare` of identical tables, the first of the run (the command's threads, Spark started only if the
  rest is projected to take longer than its start: router.ops.compare.lanes) and three more;
- for reference, `compare` on Spark only with the JVM started for it (`spark_after_s = 0`, cold);
- `compare` with `--diffs` rows changed on b in a session replication does not carry (found exactly?);
- `repair` of them, and a last compare (nothing left?).

    .venv/bin/python -m bench.micro.compare [--rows 5000000] [--diffs 100] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from bench.faults import Cluster
from bench.micro import emit
from router.cluster.copy.spark import reuse_spark
from router.cluster.install import init_cluster
from router.config.model import parse_config
from router.ops.compare.job import compare_cluster
from router.ops.compare.repair import repair_cluster
from router.testing.localnodes import LocalNode, LocalNodeSet
from router.testing.mesh import execute

SCHEMA = "CREATE TABLE acc (aid bigint PRIMARY KEY, bid int NOT NULL, abalance int NOT NULL, filler char(84))"
LOAD = "INSERT INTO acc SELECT g, (g - 1) / 100000 + 1, 0, '' FROM generate_series(1, %s) g"
FLOOR = "SELECT bit_xor(pg_catalog.hashtextextended((t.*)::text, 1)) FROM acc t"


async def floor(nodes: list[LocalNode]) -> float:
    async def one(node: LocalNode) -> None:
        async with await psycopg.AsyncConnection.connect(node.dsn(), autocommit=True) as conn:
            await conn.execute(FLOOR)

    began = time.monotonic()
    await asyncio.gather(*(one(n) for n in nodes))
    return time.monotonic() - began


async def run(rows: int, diffs: int) -> str:
    workdir = Path(tempfile.mkdtemp(prefix="pgmesh-compare-"))
    os.chmod(workdir, 0o755)
    out: list[str] = []
    with LocalNodeSet(["a", "b", "c"], base_dir=workdir) as nodes:
        b = nodes[1]
        cluster = Cluster(nodes, workdir)
        began = time.monotonic()
        async def load(node: LocalNode) -> None:
            await execute(node.dsn(), SCHEMA)
            await execute(node.dsn(), LOAD, params=[rows])
            await execute(node.dsn(), "VACUUM ANALYZE acc")

        await asyncio.gather(*(load(n) for n in nodes))
        load_s = time.monotonic() - began
        config = parse_config(cluster.config_path.read_text())
        report, _ = await init_cluster(config)
        assert report.ok, report.render()
        cluster.start_router()
        try:
            floors = [await floor(nodes) for _ in range(3)]
            cold = await compare_cluster(config)  # the first of the run; Spark only if it pays
            with reuse_spark():
                only_spark = await compare_cluster(config, spark_after_s=0)  # the JVM started for it
            with reuse_spark():
                warm = [await compare_cluster(config) for _ in range(3)]
                assert not cold.differences and not any(w.differences for w in [*warm, only_spark])
                step = max(1, rows // diffs)
                keys = list(range(7, rows, step))[:diffs]
                async with await psycopg.AsyncConnection.connect(b.dsn(), autocommit=True) as conn:
                    await conn.execute("SELECT pg_replication_origin_create('bench_local')")
                    await conn.execute("SELECT pg_replication_origin_session_setup('bench_local')")
                    await conn.execute("UPDATE acc SET abalance = abalance + 1 WHERE aid = ANY(%s)", [keys])
                found = await compare_cluster(config)
                began = time.monotonic()
                repaired = await repair_cluster(config)
                repair_s = time.monotonic() - began
                after = await compare_cluster(config)
        finally:
            cluster.stop_router()
    exact = {d.key for d in found.differences} == {f"({k})" for k in keys}
    best_floor = min(floors)
    warm_s = sorted(w.seconds for w in warm)[1]
    out += [
        f"compare of 3 nodes x {rows:,} rows (`python -m bench.micro.compare --rows {rows} --diffs {diffs}`);"
        f" loading took {load_s:.0f} s\n",
        "| what | seconds | against the floor |",
        "|---|--:|--:|",
        f"| floor: one hash pass over the table on each node, the three at once (best of 3: "
        f"{', '.join(f'{f:.1f}' for f in floors)}) | {best_floor:.1f} | 1.00x |",
        f"| compare, identical, the first of the run (Spark started: {'yes' if cold.spark else 'no'})"
        f" | {cold.seconds:.1f} | {cold.seconds / best_floor:.2f}x |",
        f"| compare, identical, median of 3 more (Spark started: {sum(w.spark for w in warm)} of 3)"
        f" | {warm_s:.1f} | {warm_s / best_floor:.2f}x |",
        f"| reference: compare on Spark only, the JVM started for it | {only_spark.seconds:.1f}"
        f" | {only_spark.seconds / best_floor:.2f}x |",
        f"| compare, {diffs} rows differ on b (found exactly: {'yes' if exact else 'NO'}; recheck included;"
        f" Spark started: {'yes' if found.spark else 'no'})"
        f" | {found.seconds:.1f} | {found.seconds / best_floor:.2f}x |",
        f"| repair of them (its compare included: {repaired.compared.seconds:.1f} s; rows written:"
        f" {sum(len(f.written) for f in repaired.fixes)}) | {repair_s:.1f} | |",
        f"| repair alone (writes) | {repair_s - repaired.compared.seconds:.1f} | |",
        f"| compare after the repair: {len(after.differences)} difference(s) | {after.seconds:.1f} | |",
    ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.compare", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--diffs", type=int, default=100)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    text = asyncio.run(run(args.rows, args.diffs))
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
