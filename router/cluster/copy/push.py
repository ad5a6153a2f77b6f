"""`pgmesh push TABLE --from A --to B [--query SQL]`: a one-shot copy of a table's rows, or of a query's,
from one node into another that is live, through the join's Spark copy (router.cluster.copy.initial).

The source is read under a snapshot it exports (one consistent view however many tasks read it): a table
in ctid ranges, as the join copies it; a query as one task, in text COPY (its column types need not be the
table's, only readable as them). Every row is written on the target by the target's primary key: inserted,
or updated where the row there differs (an identical row is left alone). The target writes them as its own
sessions would (constraints checked, triggers fired, not `session_replication_role = replica`), so the
router replicates them from there like any other write and every node converges on them. Rows only on the
target are left alone: to make a table the same everywhere as it is on one node, `pgmesh repair --from`.
Into a node that only receives (router.cluster.receive), whose own writes reach no one and are refused,
the rows are written as the appliers write (`session_replication_role = replica`).

A query names its columns as the table's (`SELECT id, upper(v) AS v FROM t WHERE ...`); a column of the
table it does not return takes its default where a row is inserted and is left as it is where one is
updated; it must return the key. Its rows are read as it returns them: a key twice is an error (nothing
of that task is written).

Must not: write to the source, touch replication state, or put a DSN in a message.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final

import msgspec
import psycopg
from psycopg import sql

from router.cluster.copy.initial import CopyReport, CopyTable, plan_leaves, report, run_job
from router.cluster.copy.plan import BlockRange, CopyTask, plan_tasks
from router.cluster.copy.spark import local_parallelism, spark_session
from router.cluster.copy.worker import CopyJob, run_partition
from router.config.model import Config, NodeConfig
from router.errors import PgmeshError, describe

__all__ = ["cmd_push", "push"]

# A table's columns that a push writes (not generated ones), in order, and whether each is in the key.
_COLUMNS_SQL: Final = """
SELECT a.attname, coalesce(a.attnum = ANY(i.indkey::int2[]), false)
FROM pg_catalog.pg_attribute a
LEFT JOIN pg_catalog.pg_index i ON i.indrelid = a.attrelid AND i.indisprimary
WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
ORDER BY a.attnum
"""


def _split(table: str) -> tuple[str, str]:
    schema, _, name = table.rpartition(".")
    return (schema or "public"), name


def _connect(node: NodeConfig, *, read_only: bool = False) -> psycopg.Connection[Any]:
    try:
        conn = psycopg.connect(node.dsn, application_name="pgmesh push", connect_timeout=10)
    except psycopg.Error as exc:
        raise PgmeshError(f"cannot connect: {describe(exc)}", node=node.name) from None
    if read_only:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
    return conn


def _columns(conn: psycopg.Connection[Any], node: str, label: str) -> list[tuple[str, bool]]:
    rel = sql.Identifier(*_split(label)).as_string(conn)
    try:
        return [(str(n), bool(k)) for n, k in conn.execute(_COLUMNS_SQL, [rel]).fetchall()]
    except psycopg.Error as exc:
        raise PgmeshError(f"cannot read the table: {describe(exc)}", node=node, relation=label,
                          sqlstate=exc.sqlstate) from None


def _query_columns(conn: psycopg.Connection[Any], node: str, label: str, query: str) -> list[str]:
    try:
        probe = sql.Composed([sql.SQL("SELECT * FROM ("), sql.SQL(query), sql.SQL("\n) AS q LIMIT 0")])
        cur = conn.execute(probe)
    except psycopg.Error as exc:
        raise PgmeshError(f"the query fails: {describe(exc)}", node=node, relation=label,
                          sqlstate=exc.sqlstate) from None
    return [d.name for d in cur.description or []]


def push(config: Config, table: str, source: str, target: str, query: str | None = None) -> CopyReport:
    """Blocking: push `table`'s rows (or `query`'s) from `source` into `target`; see the module docstring."""
    donor, into = config.node(source), config.node(target)
    if donor.name == into.name:
        raise PgmeshError(f"--from and --to name the same node ({source}): nothing to push")
    schema, name = _split(table)
    label = f"{schema}.{name}"
    query = query.strip().rstrip(";").strip() if query is not None else None
    started = time.monotonic()
    with _connect(into) as conn:
        columns = _columns(conn, into.name, label)
    keys = tuple(c for c, key in columns if key)
    if not keys:
        raise PgmeshError("no primary key: a push writes each row by its key", node=into.name, relation=label)
    holder = _connect(donor, read_only=True)
    try:
        row = holder.execute("SELECT pg_catalog.pg_export_snapshot()").fetchone()
        assert row is not None
        snapshot = str(row[0])
        if query is None:
            theirs = {c for c, _ in _columns(holder, donor.name, label)}
            names = tuple(c for c, _ in columns if c in theirs)
        else:
            names = tuple(_query_columns(holder, donor.name, label, query))
            unknown = [c for c in names if c not in {c for c, _ in columns}]
            if unknown:
                raise PgmeshError(f"the query returns columns the table does not have (or generates): "
                                  f"{', '.join(unknown)}", node=into.name, relation=label)
        missing = [k for k in keys if k not in names]
        if missing:
            raise PgmeshError(f"the key column(s) {', '.join(missing)} are not in what is pushed",
                              node=donor.name, relation=label)
        copied = CopyTable(schema, name, names)
        if query is None:
            tasks = plan_tasks(plan_leaves(holder, [copied], node=donor.name), [names],
                               parallelism=local_parallelism(config.sync.spark_master) or 2)
            tasks = [_with_keys(t, keys) for t in tasks]
        else:
            tasks = [CopyTask(0, schema, name, names, BlockRange(0, None), 0, binary=False, query=query,
                              keys=keys)]
        job = CopyJob(donor.dsn, into.dsn, snapshot, f"pgmesh push {label}"[:63], 1,
                      own_writes=not into.receive_only)  # (a receive-only node replicates nothing anyway)
        with spark_session(config.sync.spark_master, config.sync.spark_conf,
                           worker_modules=(run_partition.__module__,)) as spark:
            outcomes = run_job(spark.sparkContext, job, tasks, 1, None, started, 4)
    except PgmeshError as exc:  # the copy's errors say "donor" / "target": name the nodes
        node = {"donor": donor.name, "target": into.name}.get(exc.node or "", exc.node)
        raise PgmeshError(exc.message.replace("initial copy failed", "push failed"), node=node,
                          relation=exc.relation or label, sqlstate=exc.sqlstate, hint=exc.hint) from None
    finally:
        holder.close()
    return report([copied], tasks, outcomes, time.monotonic() - started)


def _with_keys(task: CopyTask, keys: tuple[str, ...]) -> CopyTask:
    return msgspec.structs.replace(task, keys=keys)


async def cmd_push(config: Config, table: str, source: str, target: str, query: str | None = None) -> int:
    """`pgmesh push`: print what was written."""
    done = await asyncio.to_thread(push, config, table, source, target, query)
    what = "the query's rows" if query else "its rows"
    print(f"pushed {done.tables[0].schema}.{done.tables[0].name} ({what}) from {source} to {target}:"
          f" {done.rows} row(s) inserted or changed, {done.bytes / 1e6:.1f} MB read, {done.tasks} task(s),"
          f" {done.seconds:.1f} s")
    return 0
