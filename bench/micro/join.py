"""Initial copy of one large table into an empty node: pgmesh's PySpark copy beside native and pg_dump.

One donor holds `bench_join (id bigint primary key, a int, b text (64 chars), c numeric, d timestamptz)`
with --rows rows (1,000,000: about 120 MB). Each run copies it into a fresh empty node three ways, in an
order that rotates between runs, every node with the same settings (NODE_SETTINGS below):

  native   the target has the same schema (the table with its primary key); `CREATE SUBSCRIPTION ...
           WITH (copy_data = true)` for a publication of the table, timed until pg_subscription_rel says
           'r' (ready) for it; then the subscription is dropped.
  pg_dump  `pg_dump -t bench_join donor | psql target` into an empty database (one text-format COPY,
           the primary key built after the data).
  pgmesh   what `pgmesh join` does: export a snapshot (a REPEATABLE READ transaction kept open),
           `pg_dump --section=pre-data --snapshot` | psql, `copy_snapshot` on Spark `local[*]` (parallel
           ctid ranges streamed as binary COPY, no index on the target yet), then `--section=post-data`
           (the primary key, built once over the loaded table). Reported three ways:
             pgmesh total     everything above, Spark start-up (JVM, Python workers) included;
             pgmesh no-start  the same without the Spark start-up (a running router would keep it
                              warm only for several joins in a row; see `reuse_spark`);
             copy job         copy_snapshot alone (planning + the Spark job), no schema, no index.

Per method: seconds (min and median over the runs), MB/s and rows/s of the median (MB = 2^20 bytes of
pg_table_size on the donor), and the speed-up over native (native median seconds / this median seconds:
higher is better, 1.00x = as fast as native). Note what native does differently: it copies in text
format through one walsender into a table that already has its primary key, so every row also
updates the index; pgmesh loads binary COPY in parallel into a bare heap and builds the index once after.
The table goes to stdout and, with --write, to bench/results/join.txt with the machine's details.

    .venv/bin/python -m bench.micro.join                    # 1,000,000 rows, 2 runs
    .venv/bin/python -m bench.micro.join --rows 200000 --runs 1
    .venv/bin/python -m bench.micro.join --tasks 4 --write  # 4 ctid ranges instead of the automatic choice

Owns: the donor table, the three copy methods as timed here and join.txt. Must not: change how
`pgmesh join` copies (it calls `router.cluster.copy` as the command does), or touch anything but the
nodes it creates and destroys.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from bench.harness.nodes import client_env
from router.cluster.copy.initial import CopyTable, copy_snapshot, reuse_spark
from router.cluster.copy.spark import spark_session
from router.cluster.copy.worker import run_partition
from router.testing.localnodes import LocalNode, create_nodes, find_pg_bindir

NODE_SETTINGS = {
    "shared_buffers": "256MB",
    "max_wal_size": "4GB",
    "checkpoint_timeout": "30min",
    "maintenance_work_mem": "256MB",
    # The launcher starts a subscription's workers at most once per this interval (default 5 s).
    "wal_retrieve_retry_interval": "50ms",
}
TABLE = "bench_join"
COLUMNS = ("id", "a", "b", "c", "d")
SCHEMA = f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, a int, b text, c numeric, d timestamptz)"
FILL = (
    f"INSERT INTO {TABLE} SELECT g, g %% 100000, md5(g::text) || md5((g * 7)::text),"
    " round((g * 3.14159)::numeric, 3), timestamptz '2024-01-01' + g * interval '1 second'"
    " FROM generate_series(1, %s) g"
)
MASTER = "local[*]"
RESULTS = Path(__file__).resolve().parents[1] / "results" / "join.txt"
POLL_S = 0.02
TIMEOUT_S = 1800.0
METHODS = ("native", "pg_dump", "pgmesh total", "pgmesh no-start", "copy job")


@dataclass(slots=True)
class Run:
    seconds: dict[str, float] = field(default_factory=dict)
    details: dict[str, float] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)


def tool(name: str) -> str:
    return str(find_pg_bindir() / name)


def sql(node: LocalNode, query: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(node.dsn(), autocommit=True) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


def pipe(dump: list[str], restore: list[str]) -> None:
    """`dump | restore`; raise with stderr when either fails."""
    env = client_env()
    with subprocess.Popen(dump, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as producer:
        assert producer.stdout is not None
        done = subprocess.run(restore, stdin=producer.stdout, capture_output=True, env=env, check=False)
        producer.stdout.close()
        err = producer.stderr.read() if producer.stderr else b""
        producer.wait()
    if producer.returncode or done.returncode:
        raise RuntimeError(f"{dump[0]} | {restore[0]} failed: {(err + done.stderr).decode()[-2000:]}")


def psql(node: LocalNode) -> list[str]:
    return [tool("psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", node.dsn()]


def checkpoint(*nodes: LocalNode) -> None:
    for node in nodes:
        sql(node, "CHECKPOINT")


def check_copy(donor: LocalNode, target: LocalNode, rows: int, method: str) -> None:
    query = f"SELECT count(*), sum(id), sum(length(b)) FROM {TABLE}"
    want, got = sql(donor, query), sql(target, query)
    if want != got or want[0][0] != rows:
        raise RuntimeError(f"{method}: the target has {got}, the donor {want}")
    keys = sql(target, f"SELECT count(*) FROM pg_index WHERE indrelid = '{TABLE}'::regclass AND indisprimary")
    if keys[0][0] != 1:
        raise RuntimeError(f"{method}: the target has no primary key")


# ---------------------------------------------------------------------------------------------------------
# The three methods; each gets a fresh empty target node and returns its timings


def run_native(donor: LocalNode, target: LocalNode, run: Run) -> None:
    sql(target, SCHEMA)
    checkpoint(donor, target)
    connection = donor.dsn().replace("'", "''")
    start = time.perf_counter()
    sql(target, f"CREATE SUBSCRIPTION bench_join_sub CONNECTION '{connection}' PUBLICATION bench_join_pub"
                " WITH (copy_data = true)")
    deadline = start + TIMEOUT_S
    with psycopg.connect(target.dsn(), autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT srsubstate FROM pg_subscription_rel WHERE srrelid = %s::regclass", [TABLE]
            ).fetchone()
            if row is not None and row[0] == "r":
                break
            if time.perf_counter() > deadline:
                raise RuntimeError("native: the table did not reach state 'r'")
            time.sleep(POLL_S)
    run.seconds["native"] = time.perf_counter() - start
    sql(target, "DROP SUBSCRIPTION bench_join_sub")


def run_pg_dump(donor: LocalNode, target: LocalNode, run: Run) -> None:
    checkpoint(donor, target)
    start = time.perf_counter()
    pipe([tool("pg_dump"), "-t", TABLE, "-d", donor.dsn()], psql(target))
    run.seconds["pg_dump"] = time.perf_counter() - start


def run_pgmesh(donor: LocalNode, target: LocalNode, run: Run, tasks: int) -> None:
    checkpoint(donor, target)
    columns = [CopyTable("public", TABLE, COLUMNS)]
    with reuse_spark():
        start = time.perf_counter()
        with psycopg.connect(donor.dsn()) as holder:
            holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            snapshot = str(holder.execute("SELECT pg_export_snapshot()").fetchone()[0])  # type: ignore[index]
            section = [tool("pg_dump"), "--schema-only", f"--snapshot={snapshot}", "-t", TABLE,
                       "-d", donor.dsn()]
            pipe([*section, "--section=pre-data"], psql(target))
            pre = time.perf_counter()
            # Start Spark the way copy_snapshot would (it then reuses this session) to time it apart.
            with spark_session(MASTER, None, max_task_failures=4, worker_modules=(run_partition.__module__,)):
                pass
            started = time.perf_counter()
            report = copy_snapshot(donor.dsn(), target.dsn(), snapshot, columns, spark_master=MASTER,
                                   partitions_per_table=tasks)
            copied = time.perf_counter()
            pipe([*section, "--section=post-data"], psql(target))
            end = time.perf_counter()
    run.seconds["pgmesh total"] = end - start
    run.seconds["pgmesh no-start"] = (end - start) - (started - pre)
    run.seconds["copy job"] = copied - started
    run.details.update({
        "pre-data s": pre - start, "spark start s": started - pre, "copy job s": copied - started,
        "post-data s": end - copied, "tasks": report.tasks, "copy MB": report.bytes / 2**20,
    })


RUNNERS: dict[str, Callable[[LocalNode, LocalNode, Run, int], None]] = {
    "native": lambda d, t, r, _: run_native(d, t, r),
    "pg_dump": lambda d, t, r, _: run_pg_dump(d, t, r),
    "pgmesh": run_pgmesh,
}


# ---------------------------------------------------------------------------------------------------------
# Report


def machine(donor: LocalNode) -> str:
    version = sql(donor, "SELECT version()")[0][0]
    java = subprocess.run(["java", "-version"], capture_output=True, text=True, check=False).stderr
    java_line = java.splitlines()[0] if java else "java: unknown"
    import pyspark

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), {mem:.0f} GiB RAM,"
            f" {platform.system()} {platform.release()}\n{version}\nPython {platform.python_version()},"
            f" pyspark {pyspark.__version__}, {java_line}")


def table(rows: int, size: int, runs: Sequence[Run], tasks: int) -> list[str]:
    native = statistics.median(r.seconds["native"] for r in runs)
    lines = [
        f"{'method':<18}{'min s':>9}{'median s':>10}{'MB/s':>9}{'rows/s':>12}{'vs native':>11}",
    ]
    for method in METHODS:
        values = [r.seconds[method] for r in runs]
        median = statistics.median(values)
        lines.append(
            f"{method:<18}{min(values):>9.2f}{median:>10.2f}{size / 2**20 / median:>9.1f}"
            f"{rows / median:>12,.0f}{native / median:>10.2f}x"
        )
    lines.append(break_even(size, runs))
    keys = list(runs[0].details)
    parts = ", ".join(f"{k} {statistics.median(r.details[k] for r in runs):.2f}" for k in keys)
    lines.append(f"pgmesh phases (medians): {parts}")
    return lines


def break_even(size: int, runs: Sequence[Run]) -> str:
    """Where pgmesh total would match native, extrapolating both medians linearly in table size."""
    native = statistics.median(r.seconds["native"] for r in runs) / size
    no_start = statistics.median(r.seconds["pgmesh no-start"] for r in runs) / size
    start = statistics.median(r.details["spark start s"] for r in runs)
    if no_start >= native:
        return "without Spark start-up pgmesh is not faster than native here: no break-even size"
    at = start / (native - no_start)
    return (f"break-even (linear extrapolation of the medians): pgmesh total = native at about"
            f" {at / 2**30:.1f} GiB of table; Spark start-up {start:.1f} s")


def describe_run(number: int, run: Run) -> str:
    timings = ", ".join(f"{k} {v:.2f} s" for k, v in run.seconds.items())
    phases = ", ".join(f"{k} {v:.2f}" for k, v in run.details.items())
    return f"run {number} (order {', '.join(run.order)}): {timings} ({phases})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.join", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=0, help="ctid ranges for the table (0: automatic)")
    parser.add_argument("--write", action="store_true", help=f"also write the table to {RESULTS}")
    args = parser.parse_args(argv)

    load_before = os.getloadavg()
    donor = create_nodes(["donor"], settings=NODE_SETTINGS)[0]
    try:
        print(f"loading {args.rows:,} rows into the donor ...", file=sys.stderr)
        sql(donor, SCHEMA)
        sql(donor, FILL, [args.rows])
        sql(donor, f"VACUUM ANALYZE {TABLE}")
        sql(donor, f"CREATE PUBLICATION bench_join_pub FOR TABLE {TABLE}")
        size = int(sql(donor, "SELECT pg_table_size(%s)", [TABLE])[0][0])
        details = machine(donor)
        runs: list[Run] = []
        for number in range(args.runs):
            run = Run()
            order = list(RUNNERS)
            run.order = order[number % len(order):] + order[:number % len(order)]
            for method in run.order:
                target = create_nodes([f"target-{method.replace('_', '-')}"], settings=NODE_SETTINGS)[0]
                try:
                    RUNNERS[method](donor, target, run, args.tasks)
                    check_copy(donor, target, args.rows, method)
                finally:
                    target.destroy()
            runs.append(run)
            print(describe_run(number, run), file=sys.stderr)
    finally:
        donor.destroy()

    load_after = os.getloadavg()
    settings = ", ".join(f"{k}={v}" for k, v in NODE_SETTINGS.items())
    header = [
        f"pgmesh join bench: initial copy of 1 table, {args.rows:,} rows, {size / 2**20:.1f} MB"
        f" (pg_table_size), into an empty node; {args.runs} run(s); Spark {MASTER},"
        f" {'automatic' if not args.tasks else args.tasks} ctid ranges",
        details,
        f"node settings (all nodes): {settings}; plus router.testing.localnodes defaults (fsync=off,"
        " full_page_writes=off, wal_level=logical)",
        f"load average (1, 5, 15 min) before: {', '.join(f'{v:.2f}' for v in load_before)};"
        f" after: {', '.join(f'{v:.2f}' for v in load_after)} (other work shares this machine)",
    ]
    body = table(args.rows, size, runs, args.tasks)
    body += [describe_run(number, run) for number, run in enumerate(runs)]
    notes = [
        "vs native = native median seconds / this median seconds (higher is better).",
        "native copies text-format COPY through one walsender into a table that already has its primary",
        "key (each row also goes into the index); pg_dump | psql is one text COPY, key built after;",
        "pgmesh streams binary COPY over parallel ctid ranges into a bare heap, key built after (post-data).",
        "pgmesh total includes starting Spark (JVM + Python workers); no-start leaves that out.",
    ]
    text = "\n".join([*header, "", *body, "", *notes]) + "\n"
    print(text)
    if args.write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
