"""`pgmesh compare`: every node against every other, as a PySpark job over exported snapshots (its tasks
run on the command's own threads until Spark pays for its start), then a recheck of what differed once
every link has applied past the first read.

Owns: exporting a snapshot on every node (held open for the job) and each node's WAL position then, the
compared tables (the publication's and every other table `[replication] tables` matches, or those named;
the reference's catalog, read under its snapshot: the first full node; one that matches but is not in a
node's publication is compared all the same and reported as not replicated there; one missing on a node
is reported as not compared; a table without a key is compared as a multiset of rows) and their key
ranges (router.cluster.compare.plan; the reference's), what is compared
where (`plan.compared_on`: the full nodes with each other, each partial node with the reference on the
tables it gets, through its filter and columns), running the tasks (router.cluster.compare.worker) on
its own threads and on Spark (router.ops.compare.lanes), and the recheck: a key that differed is
read again on its table's nodes once the router reports that every link has flushed past the positions of the
first read (`router.ops.barrier`); it is a difference only if it still differs and its rows are
the same as the read before (else it was still being written: read again, up to `ROUNDS` times, then
reported as unsettled, not as a difference).

Must not: write to a node, import pyspark at module level, or put a DSN in a message.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final

import msgspec
import psycopg
from psycopg import sql

from router.cluster.compare.multiset import counts_sql
from router.cluster.compare.plan import (
    CompareTable,
    RangeTask,
    compared_on,
    partitions,
)
from router.cluster.compare.worker import (
    SESSION_SQL,
    CompareJob,
    Difference,
    cut_ranges,
    keyless_where,
    row_hashes_sql,
    run_partition,
)
from router.cluster.copy.spark import local_parallelism, spark_session
from router.cluster.members import members_of
from router.cluster.partial import is_partial, reaches
from router.config.model import Config, NodeConfig
from router.errors import PgmeshError, describe
from router.ops.barrier import barrier
from router.ops.compare.lanes import SPARK_AFTER_LOCAL_S, SPARK_AFTER_S, run_shared
from router.progress.positions import BARRIER_POSITION_SQL
from router.service.admin import ask_router

__all__ = ["CompareReport", "Divergence", "FirstPass", "cmd_compare", "compare_cluster"]

ROUNDS: Final = 3

_TABLES_SQL: Final = "SELECT schemaname, tablename FROM pg_catalog.pg_publication_tables WHERE pubname = %s"
# Every table `[replication] tables` may match (as init picks them: partitioned ones by their root)
_CANDIDATES_SQL: Final = (
    "SELECT n.nspname, c.relname, c.relpersistence::text FROM pg_catalog.pg_class c"
    " JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
    " WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition AND c.relpersistence IN ('p', 'u')"
)
_MISSING_SQL: Final = (
    "SELECT x FROM unnest(%s::text[]) AS x WHERE pg_catalog.to_regclass(x) IS NULL"
)
_KEY_SQL: Final = (
    "SELECT a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod) FROM"
    " (SELECT i.indkey FROM pg_catalog.pg_index i WHERE i.indrelid = %s::regclass"
    "  AND (i.indisprimary OR i.indisreplident) ORDER BY i.indisprimary DESC LIMIT 1) AS x,"
    " unnest(x.indkey) WITH ORDINALITY AS k(attnum, ord)"
    " JOIN pg_catalog.pg_attribute a ON a.attrelid = %s::regclass AND a.attnum = k.attnum ORDER BY k.ord"
)


class Divergence(msgspec.Struct, frozen=True):
    """A key whose row differs: per node compared on it, its row's hash in hex, or None where the row is
    missing. The full nodes' (every one), or a partial node's and its reference's (the reference's row read
    through the partial node's filter; both hashed over its columns only). In a table without a key: a row
    (`key`: its text; `key_json` "") whose copies differ: `counts`, per node, and `rows` says them."""

    table: str
    key: str
    key_json: str
    rows: dict[str, str | None]
    counts: dict[str, int] | None = None


class CompareReport(msgspec.Struct, frozen=True):
    nodes: list[str]
    tables: list[str]
    skipped: list[str]  # tables not compared, with why
    differences: list[Divergence]
    unsettled: list[Divergence]  # still changing at every recheck: not decided
    rechecked: bool  # differences were read again after every link applied past the first read
    seconds: float
    spark: bool = False  # Spark ran part of the first pass (router.ops.compare.lanes)
    # tables `[replication] tables` matches that some node does not publish (compared all the same), with why
    unreplicated: list[str] = msgspec.field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """0: every node alike; 1: differences; 4: none, but some table was not compared or is not
        replicated; 3: none, but keys still being written."""
        if self.differences:
            return 1
        return 4 if self.skipped or self.unreplicated else 3 if self.unsettled else 0

    def render(self) -> str:
        lines = [
            f"compared {len(self.tables)} table(s) on {len(self.nodes)} nodes ({', '.join(self.nodes)})"
            f" in {self.seconds:.1f} s: {len(self.differences)} difference(s)"
            + (f"; {len(self.skipped)} table(s) NOT compared" if self.skipped else "")
            + (f"; {len(self.unreplicated)} table(s) not replicated" if self.unreplicated else "")
            + (
                ""
                if self.rechecked
                else " (not rechecked: the router is not running, some may be changes still on their way)"
            )
        ]
        lines += [f"not compared: {s}" for s in self.skipped]
        lines += [f"not replicated: {s}" for s in self.unreplicated]
        for title, items in (("differences", self.differences), ("still being written", self.unsettled)):
            if not items:
                continue
            lines.append(f"{title}:")
            head = ["table", "key (or row)", *self.nodes]
            rows = [[d.table, d.key, *(d.rows[n] or "missing" if n in d.rows else "-" for n in self.nodes)]
                    for d in items]
            widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
            for r in [head, *rows]:
                lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        return "\n".join(lines)


def _hex(h: int | None) -> str | None:
    return None if h is None else f"{h & 0xFFFFFFFFFFFFFFFF:016x}"


def _copies(count: int) -> str | None:
    return None if count == 0 else "1 copy" if count == 1 else f"{count} copies"


def task_error(exc: BaseException) -> str:
    """What a failed Spark task said: its PgmeshError's line (node, table) if it raised one, else the
    last line that names an error."""
    lines = str(exc).splitlines()
    ours = [line.split("PgmeshError: ", 1)[1] for line in lines if "PgmeshError: " in line]
    if ours:
        return ours[-1]
    last = [line for line in lines if "Error" in line]
    return last[-1] if last else describe(exc)


def _run_groups(job: CompareJob, groups: Iterable[list[RangeTask]]) -> Iterator[Difference]:
    return run_partition(job, itertools.chain.from_iterable(groups))


class _Holders:
    """A REPEATABLE READ transaction on every node that exported its snapshot, kept open for the job."""

    def __init__(self, nodes: Sequence[NodeConfig]) -> None:
        self.conns: list[psycopg.Connection[Any]] = []
        self.snapshots: list[str] = []
        self.positions: dict[str, int] = {}
        try:
            for node in nodes:
                try:
                    conn = psycopg.connect(node.dsn, application_name="pgmesh compare", connect_timeout=10)
                except psycopg.Error as exc:
                    raise PgmeshError(f"cannot connect: {describe(exc)}", node=node.name) from None
                self.conns.append(conn)
                conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                conn.read_only = True
                row = conn.execute("SELECT pg_catalog.pg_export_snapshot()").fetchone()
                assert row is not None
                self.snapshots.append(str(row[0]))
                with psycopg.connect(node.dsn, autocommit=True, connect_timeout=10) as mark:
                    position = mark.execute(BARRIER_POSITION_SQL).fetchone()  # after it: past all it sees
                assert position is not None
                self.positions[node.name] = int(position[0])
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


def _tables(
    holders: _Holders, nodes: Sequence[NodeConfig], reference: int, config: Config, names: Sequence[str]
) -> tuple[list[CompareTable], list[str], list[str]]:
    """The compared tables (the publication's and every other one `[replication] tables` matches, on the
    reference), the ones not compared (missing on a node) and the ones not replicated, each with why."""
    conn = holders.conns[reference]
    publication = config.publication_name
    published = {f"{s}.{t}" for s, t in conn.execute(_TABLES_SQL, [publication]).fetchall()}
    matching = {f"{s}.{t}": str(p) for s, t, p in conn.execute(_CANDIDATES_SQL).fetchall()
                if config.replicates(str(s), str(t))}
    labels = published | set(matching)
    if names:
        wanted = {n if "." in n else f"public.{n}" for n in names}
        unknown = wanted - labels
        if unknown:
            raise PgmeshError(
                f"not replicated (not in publication {publication}, and [replication] tables does not"
                f" match it on node {nodes[reference].name}): {', '.join(sorted(unknown))}"
            )
        labels = wanted
    senders = [i for i, n in enumerate(nodes) if not is_partial(n) and not n.receive_only]
    publishes = {i: published if i == reference else {
        f"{s}.{t}" for s, t in holders.conns[i].execute(_TABLES_SQL, [publication]).fetchall()
    } for i in senders}
    unreplicated = []
    for label in sorted(labels):
        apart = [nodes[i].name for i in senders if label not in publishes[i]]
        if apart:
            why = " (UNLOGGED: PostgreSQL publishes no unlogged table)" if matching.get(label) == "u" else ""
            unreplicated.append(
                f"{label}: matches [replication] tables but is not in publication {publication} on"
                f" {', '.join(apart)}{why}: writes to it there stay on the node that made them (compared all"
                " the same; `pgmesh init` adds it to the publication, or list it in [replication] exclude)")
    missing: dict[str, list[str]] = {}
    for i, node in enumerate(nodes):
        mine = [t for t in sorted(labels) if not is_partial(node) or reaches(node, t)]
        quoted = {sql.Identifier(*t.split(".", 1)).as_string(conn): t for t in mine}
        for (x,) in holders.conns[i].execute(_MISSING_SQL, [list(quoted)]).fetchall():
            missing.setdefault(quoted[str(x)], []).append(node.name)
    skipped = [f"{t} (missing on {', '.join(on)})" for t, on in sorted(missing.items())]
    tables = []
    for label in sorted(labels - set(missing)):
        schema, name = label.split(".", 1)
        rel = sql.Identifier(schema, name).as_string(conn)
        keys = conn.execute(_KEY_SQL, [rel, rel]).fetchall()
        first_type = str(keys[0][1]) if keys else ""
        tables.append(CompareTable(schema, name, tuple(str(k) for k, _ in keys), first_type))
    return tables, skipped, unreplicated


def _ranges(
    conn: psycopg.Connection[Any], index: int, table: CompareTable
) -> list[RangeTask]:
    rel = sql.Identifier(table.schema, table.name)
    row = conn.execute(
        "SELECT reltuples FROM pg_catalog.pg_class WHERE oid = %s::regclass", [rel.as_string(conn)]
    ).fetchone()
    return cut_ranges(conn, table, max(0, int((row[0] if row else 0) or 0)), index)


class FirstPass(msgspec.Struct, frozen=True):
    """What the first pass found."""

    job: CompareJob
    tables: list[str]  # compared
    skipped: list[str]  # not compared, with why
    unreplicated: list[str]  # matched by `[replication] tables` but not published everywhere, with why
    found: list[Difference]
    positions: dict[str, int]  # each node's WAL position when its snapshot was taken
    spark: bool


def first_pass(config: Config, names: Sequence[str], spark_after_s: float = SPARK_AFTER_S) -> FirstPass:
    """Blocking: every node read under a snapshot of its own, on the command's threads and on Spark once it
    pays (router.ops.compare.lanes; `spark_after_s` <= 0: on Spark only)."""
    nodes = list(config.nodes)
    reference = next((i for i, n in enumerate(nodes) if not is_partial(n)), None)
    if reference is None:
        raise PgmeshError("every node left holds part of the data: no full node to compare them with",
                          hint="see `pgmesh status`: join a full node back")
    holders = _Holders(nodes)
    try:
        conn = holders.conns[reference]
        tables, skipped, unreplicated = _tables(holders, nodes, reference, config, names)
        master = config.sync.spark_master
        parallelism = local_parallelism(master) or 2
        compared = compared_on(tables, nodes)
        ranges: dict[str, list[RangeTask]] = {}  # a table's, cut once for each of its comparisons
        tasks: list[RangeTask] = []
        for i, table in enumerate(compared):
            if table.label not in ranges:
                ranges[table.label] = _ranges(conn, i, table)
            tasks += [msgspec.structs.replace(r, table=i) for r in ranges[table.label]]
        job = CompareJob(tuple(n.name for n in nodes), tuple(n.dsn for n in nodes), tuple(holders.snapshots),
                         tuple(compared))
        labels = [t.label for t in tables]

        def on_spark(rest: Callable[[], list[RangeTask]]) -> list[Difference]:
            with spark_session(
                master, config.sync.spark_conf, worker_modules=(run_partition.__module__,)
            ) as spark:
                left = rest()  # Spark is up: the lanes take no more
                if not left:
                    return []
                groups = partitions(left, parallelism * 2)
                try:
                    rdd = spark.sparkContext.parallelize(groups, len(groups))
                    found: list[Difference] = rdd.mapPartitions(functools.partial(_run_groups, job)).collect()
                except Exception as exc:
                    raise PgmeshError(f"the comparison failed: {task_error(exc)}") from None
                return found

        def done(found: list[Difference], spark: bool) -> FirstPass:
            return FirstPass(job, labels, skipped, unreplicated, found, dict(holders.positions), spark)

        if not tasks:
            return done([], False)
        if spark_after_s <= 0:
            return done(on_spark(lambda: tasks), True)
        if local_parallelism(master) is not None:  # Spark adds no core on a local master (lanes.py)
            spark_after_s = max(spark_after_s, SPARK_AFTER_LOCAL_S)
        return done(*run_shared(job, tasks, parallelism, spark_after_s, on_spark))
    finally:
        holders.close()


async def _read_hashes(
    config: Config, job: CompareJob, keys: Sequence[Difference]
) -> dict[tuple[int, str], tuple[int | None, ...]]:
    """Each key's row hash on its table's nodes (`CompareJob.nodes_of`, filtered where the table says),
    read now."""
    by_table: dict[int, list[Difference]] = {}
    for d in keys:
        by_table.setdefault(d.table, []).append(d)
    found: dict[tuple[int, int, str], int] = {}  # (node, table, key) -> hash

    async def read(i: int, node: NodeConfig) -> None:
        mine = {index: items for index, items in by_table.items() if i in job.nodes_of(job.tables[index])}
        if not mine:
            return
        try:
            async with await psycopg.AsyncConnection.connect(
                node.dsn, autocommit=True, connect_timeout=10, application_name="pgmesh compare"
            ) as conn:
                await conn.execute(SESSION_SQL)
                for index, items in mine.items():
                    table = job.tables[index]
                    if table.keyless:  # each row's copies
                        query = counts_sql(table.schema, table.name, table.columns,
                                           keyless_where(table, table.filtered(i)))
                        cur = await conn.execute(query, [[d.key for d in items]])
                    else:
                        keys_json = "[" + ",".join(d.key_json for d in items) + "]"  # (each one JSON)
                        cur = await conn.execute(row_hashes_sql(table, table.filtered(i)), [keys_json])
                    for key, h in await cur.fetchall():
                        found[(i, index, str(key))] = int(h)
        except psycopg.Error as exc:
            raise PgmeshError(
                f"cannot read the keys that differed: {describe(exc)}", node=node.name
            ) from None

    await asyncio.gather(*(read(i, node) for i, node in enumerate(config.nodes)))  # the nodes at once
    return {
        (d.table, d.key): tuple(found.get((i, d.table, d.key)) for i in job.nodes_of(job.tables[d.table]))
        for d in keys
    }


async def compare_cluster(
    config: Config, names: Sequence[str] = (), *, limit: float = 300.0, router_running: bool = True,
    spark_after_s: float = SPARK_AFTER_S,
) -> CompareReport:
    """Compare every node's replicated tables (or `names`); see the module docstring. Parted nodes
    (router.ops.part) are left out. `spark_after_s`: see router.ops.compare.lanes."""
    started = time.monotonic()
    config = await members_of(config)
    first = await asyncio.to_thread(first_pass, config, names, spark_after_s)
    job, found, wanted = first.job, first.found, first.positions
    candidates = {(d.table, d.key): d for d in found}
    last = {(d.table, d.key): d.hashes for d in found}
    persistent: list[Difference] = []
    for _ in range(ROUNDS if router_running else 1):
        if not candidates:
            break
        if router_running:
            await barrier(config, limit, wanted=wanted)
            wanted = {}  # (the next rounds: past the positions when they start)
        now = await _read_hashes(config, job, list(candidates.values()))
        for ident, hashes in now.items():
            d = candidates[ident]
            if all(h == hashes[0] for h in hashes[1:]):
                del candidates[ident]  # it converged: was on its way
            elif hashes == last[ident]:
                persistent.append(msgspec.structs.replace(d, hashes=hashes))
                del candidates[ident]
            last[ident] = hashes
    unsettled = [msgspec.structs.replace(d, hashes=last[k]) for k, d in candidates.items()]

    def divergence(d: Difference) -> Divergence:
        table = job.tables[d.table]
        names = [job.nodes[i] for i in job.nodes_of(table)]
        if table.keyless:
            counts = {n: c or 0 for n, c in zip(names, d.hashes, strict=True)}
            copies = {n: _copies(c) for n, c in counts.items()}
            return Divergence(table.label, d.key, d.key_json, copies, counts)
        return Divergence(table.label, d.key, d.key_json,
                          {n: _hex(h) for n, h in zip(names, d.hashes, strict=True)})

    return CompareReport(
        list(job.nodes),
        first.tables,
        first.skipped,
        [divergence(d) for d in sorted(persistent, key=lambda d: (d.table, d.key))],
        [divergence(d) for d in sorted(unsettled, key=lambda d: (d.table, d.key))],
        router_running,
        round(time.monotonic() - started, 3),
        first.spark,
        first.unreplicated,
    )


async def cmd_compare(
    config: Config, names: Sequence[str], *, as_json: bool = False, limit: float = 300.0
) -> int:
    """`pgmesh compare`: print the report (a table, or JSON) and return its exit code."""
    running = await ask_router(config, "GET", "/status") is not None
    report = await compare_cluster(config, names, limit=limit, router_running=running)
    print(msgspec.json.encode(report).decode() if as_json else report.render())
    return report.exit_code
