"""What one Spark task of `pgmesh compare` does: read its key ranges on every node and name the keys
whose rows differ.

Owns: the task's sessions (one per node, REPEATABLE READ READ ONLY, importing that node's exported
snapshot, with settings that make every node print a row alike), and the reads, each run on every node
at once: a range's count and XOR of its rows' hashes (`range_sql`, no grouping: per row as cheap as a hash
pass over the table); in a range that differs, per bucket (`bucket_sql`: 64 of them, consecutive keys of an
integer key, else by the key's hash) its count and XOR; a differing bucket of an integer key is cut into
64 again, read through the key index, until it holds at most LEAF_ROWS rows (a Merkle-style descent);
then `leaf_sql` reads each row's key and hash (as two arrays, loaded in C), the nodes' answers are
compared as sets, and `rows_sql` reads the differing keys' JSON (`differences`).
Each read runs on the table's nodes (`CompareJob.nodes_of`): the full nodes, or a partial node and its
reference full node, where the reference reads only the rows the partial node's filter keeps and both
hash only the columns it holds (`CompareTable.rows`, `.columns`: the SQL is per node). A table without
a key is one task, compared as a multiset of whole rows (`compare_multiset`, router.cluster.compare.multiset).

Must not: write anything, import pyspark at module level, or put a DSN in a message.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Final

import msgspec
import psycopg
from psycopg import sql

from router.cluster.compare import multiset
from router.cluster.compare.plan import (
    INTEGER_TYPES,
    CompareTable,
    RangeTask,
    bound_ranges,
    integer_ranges,
    sub_task,
)
from router.errors import PgmeshError, describe

__all__ = [
    "BUCKETS", "MAX_RANGES", "ROWS_PER_RANGE", "CompareJob", "Difference", "bucket_sql", "cut_ranges",
    "differences", "kept", "leaf_sql", "range_sql", "row_hash", "row_hashes_sql", "rows_sql", "run_partition",
]

# A table is cut into ranges of about this many rows (by its planner estimate), each read whole first
# without grouping (`range_sql`); only a range that differs is cut into buckets; at most MAX_RANGES ranges
ROWS_PER_RANGE: Final = 10_000
MAX_RANGES: Final = 4096
BUCKETS: Final = 64  # buckets of a range, by its keys' hash: the first read's granularity
# a range with this many differences had most of its buckets differ: the next range of its table is read
# row by row at once (`compare_range`, dense)
DENSE: Final = BUCKETS // 2
LEAF_ROWS: Final = 512  # a differing bucket with at most this many rows is read row by row, not cut again
# Every node prints a value alike: timestamps in UTC and ISO, intervals and floats as PostgreSQL's defaults.
SESSION_SQL: Final = (
    "SELECT pg_catalog.set_config('timezone', 'UTC', false),"
    " pg_catalog.set_config('datestyle', 'ISO', false),"
    " pg_catalog.set_config('intervalstyle', 'postgres', false),"
    " pg_catalog.set_config('extra_float_digits', '1', false),"
    " pg_catalog.set_config('bytea_output', 'hex', false),"
    # a range's query is short and there are many: compiling each (JIT) cost more than running it
    " pg_catalog.set_config('jit', 'off', false),"
    # the planner cannot count a bucket expression's groups (it takes the key's: millions) and sorts the
    # range to disk to group it; the 66 groups fit a hash table
    " pg_catalog.set_config('enable_sort', 'off', false)"
)


class CompareJob(msgspec.Struct, frozen=True):
    """What every task shares. Its repr never shows the DSNs."""

    nodes: tuple[str, ...]
    dsns: tuple[str, ...]
    snapshots: tuple[str, ...]  # one per node, exported by the driver ("": read without one)
    tables: tuple[CompareTable, ...]

    def __repr__(self) -> str:
        return f"CompareJob(nodes={self.nodes!r}, tables={len(self.tables)})"

    def nodes_of(self, table: CompareTable) -> tuple[int, ...]:
        """The nodes `table` is compared on (indexes into `nodes`)."""
        return table.nodes or tuple(range(len(self.nodes)))


class Difference(msgspec.Struct, frozen=True):
    """One key whose row is not the same on every node of its table (`CompareJob.nodes_of`): each one's
    row hash, in that order (None: no row there). In a table without a key: one row (its text) whose
    number of copies is not the same everywhere: each node's copies (None: none)."""

    table: int
    key: str  # the key as a row's text, e.g. (42) or (7,abc); without a key: the whole row's text
    key_json: str  # the key columns as a JSON object (reads the row back by its key); "" without a key
    hashes: tuple[int | None, ...]


def _key_text(table: CompareTable) -> sql.Composable:
    columns = sql.SQL(", ").join(sql.SQL("t.") + sql.Identifier(k) for k in table.keys)
    return sql.SQL("ROW({})::text").format(columns)


def _key_json(table: CompareTable) -> sql.Composable:
    return sql.SQL("pg_catalog.jsonb_build_object({})::text").format(sql.SQL(", ").join(
        sql.SQL("{}, t.{}").format(sql.Literal(k), sql.Identifier(k)) for k in table.keys
    ))


def kept(rows: str) -> sql.Composable:
    """A row filter as a condition, NULL counting as false (as a publication's row filter). Its column
    names are unqualified: the table's row must be the only one in scope."""
    return sql.SQL("coalesce(({}), false)").format(sql.SQL(rows))  # the user's text, checked at init


def _where(table: CompareTable, task: RangeTask, filtered: bool = False) -> tuple[sql.Composable, list[str]]:
    first = sql.SQL("t.") + sql.Identifier(table.keys[0])
    parts: list[sql.Composable] = []
    params: list[str] = []
    if filtered and table.rows is not None:
        parts.append(kept(table.rows))
    cast = sql.SQL(table.first_type)  # (format_type's output: a type name, quoted where it needs it)
    if task.lo is not None:
        parts.append(sql.SQL("{} >= %s::{}").format(first, cast))
        params.append(task.lo)
    if task.hi is not None:
        parts.append(sql.SQL("{} < %s::{}").format(first, cast))
        params.append(task.hi)
    return (sql.SQL(" AND ").join(parts) if parts else sql.SQL("true")), params


def row_hash(columns: Sequence[str] | None = None) -> sql.Composable:
    """Row `t`'s hash: of the whole row, or of `columns` only (a partial node's, on both sides)."""
    if columns is None:
        return sql.SQL("pg_catalog.hashtextextended((t.*)::text, 1)")
    return sql.SQL("pg_catalog.hashtextextended(ROW({})::text, 1)").format(
        sql.SQL(", ").join(sql.SQL("t.") + sql.Identifier(c) for c in columns))


def _bucket(table: CompareTable, task: RangeTask) -> sql.Composable:
    """A row's bucket: consecutive keys of an integer span (-1 and BUCKETS beyond its ends), else the
    key's hash."""
    if task.span is None:
        return sql.SQL("pg_catalog.hashtextextended({key}, 0) & {mask}").format(
            key=_key_text(table), mask=sql.Literal(BUCKETS - 1))
    first = sql.SQL("t.") + sql.Identifier(table.keys[0])
    start, end = task.span
    return sql.SQL(
        "CASE WHEN {k} < {start} THEN -1 WHEN {k} >= {end} THEN {n} ELSE ({k} - {start}) / {step} END"
    ).format(k=first, start=sql.Literal(start), end=sql.Literal(end), n=sql.Literal(BUCKETS),
             step=sql.Literal(task.step(BUCKETS)))


def range_sql(table: CompareTable, task: RangeTask, filtered: bool = False) -> tuple[sql.Composed, list[Any]]:
    """The whole range's count and XOR of its rows' hashes: the first look (no grouping: as cheap per row
    as a hash pass over the table). `filtered`: only the rows the table's filter keeps
    (`CompareTable.filtered`), in every read below too."""
    where, params = _where(table, task, filtered)
    query = sql.SQL("SELECT count(*), bit_xor({row}) FROM {table} AS t WHERE {where}").format(
        row=row_hash(table.columns), table=sql.Identifier(table.schema, table.name), where=where)
    return query, params


def bucket_sql(
    table: CompareTable, task: RangeTask, filtered: bool = False
) -> tuple[sql.Composed, list[Any]]:
    where, params = _where(table, task, filtered)
    query = sql.SQL(
        "SELECT {bucket} AS b, count(*), bit_xor({row}) FROM {table} AS t WHERE {where} GROUP BY 1"
    ).format(bucket=_bucket(table, task), row=row_hash(table.columns),
             table=sql.Identifier(table.schema, table.name), where=where)
    return query, params


def _buckets_where(table: CompareTable, task: RangeTask, buckets: Sequence[int] | None) -> tuple[
    sql.Composable, list[Any]
]:
    """Rows of those buckets (None: every row of the range): by key ranges (the index reads them) for an
    integer span."""
    if buckets is None:
        return sql.SQL("true"), []
    if task.span is None:
        return sql.SQL("({} = ANY(%s::int8[]))").format(_bucket(table, task)), [list(buckets)]
    first = sql.SQL("t.") + sql.Identifier(table.keys[0])
    start, end = task.span
    step = task.step(BUCKETS)
    parts: list[sql.Composable] = []
    for b in buckets:
        if b < 0:
            parts.append(sql.SQL("{} < {}").format(first, sql.Literal(start)))
        elif b >= BUCKETS:
            parts.append(sql.SQL("{} >= {}").format(first, sql.Literal(end)))
        else:
            parts.append(sql.SQL("({k} >= {a} AND {k} < {b})").format(
                k=first, a=sql.Literal(start + b * step), b=sql.Literal(min(start + (b + 1) * step, end))))
    return sql.SQL("({})").format(sql.SQL(" OR ").join(parts)), []


def rows_sql(
    table: CompareTable, task: RangeTask, buckets: Sequence[int] | None, filtered: bool = False,
    keys: Sequence[str] | None = None,
) -> tuple[sql.Composed, list[Any]]:
    """The rows of some buckets (of `keys` only, by their text, if given): key text, key JSON, hash."""
    where, params = _where(table, task, filtered)
    which, more = _buckets_where(table, task, buckets)
    named: sql.Composable = sql.SQL("")
    if keys is not None:
        # (a semi-join on the keys: hashed, where `= ANY` of a parameter would scan the array per row)
        named = sql.SQL(" AND {} IN (SELECT pg_catalog.unnest(%s::text[]))").format(_key_text(table))
        more = [*more, list(keys)]
    query = sql.SQL(
        "SELECT {key}, {json}, {row} FROM {table} AS t WHERE {where} AND {which}{named}"
    ).format(key=_key_text(table), json=_key_json(table), row=row_hash(table.columns), which=which,
             table=sql.Identifier(table.schema, table.name), where=where, named=named)
    return query, [*params, *more]


def leaf_sql(
    table: CompareTable, task: RangeTask, buckets: Sequence[int] | None, filtered: bool = False
) -> tuple[sql.Composed, list[Any]]:
    """The rows of some buckets as one row of two arrays: their keys' text and their hashes."""
    where, params = _where(table, task, filtered)
    which, more = _buckets_where(table, task, buckets)
    query = sql.SQL(
        "SELECT pg_catalog.array_agg({key}), pg_catalog.array_agg({row}) FROM {table} AS t"
        " WHERE {where} AND {which}"
    ).format(key=_key_text(table), row=row_hash(table.columns), which=which,
             table=sql.Identifier(table.schema, table.name), where=where)
    return query, [*params, *more]


def row_hashes_sql(table: CompareTable, filtered: bool = False) -> sql.Composed:
    """Rows by their keys (parameter: a JSON array of key objects): each found row's key and hash (only
    the table's row in scope at the top: a filter's names are its columns)."""
    ours = sql.SQL(", ").join(sql.SQL("t.") + sql.Identifier(k) for k in table.keys)
    theirs = sql.SQL(", ").join(sql.SQL("r.") + sql.Identifier(k) for k in table.keys)
    rel = sql.Identifier(table.schema, table.name)
    return sql.SQL(
        "SELECT {key}, {row} FROM {table} AS t WHERE ({ours}) IN"
        " (SELECT {theirs} FROM pg_catalog.jsonb_populate_recordset(NULL::{table}, %s::jsonb) AS r)"
        " AND {kept}"
    ).format(key=_key_text(table), row=row_hash(table.columns), table=rel, ours=ours, theirs=theirs,
             kept=kept(table.rows) if filtered and table.rows is not None else sql.SQL("true"))


def differences(
    table: int, per_node: Sequence[dict[str, tuple[str, int]]]
) -> list[Difference]:
    """`per_node`: for each node, key text -> (key JSON, row hash). Keys not alike everywhere."""
    keys: dict[str, str] = {}
    for rows in per_node:
        for key, (key_json, _) in rows.items():
            keys.setdefault(key, key_json)
    out = []
    for key in sorted(keys):
        hashes = tuple(rows[key][1] if key in rows else None for rows in per_node)
        if any(h != hashes[0] for h in hashes[1:]):
            out.append(Difference(table, key, keys[key], hashes))
    return out


def _connect(job: CompareJob, i: int) -> psycopg.Connection[Any]:
    try:
        conn = psycopg.connect(job.dsns[i], application_name="pgmesh compare", connect_timeout=10)
    except psycopg.Error as exc:
        raise PgmeshError(f"a compare task cannot connect: {describe(exc)}", node=job.nodes[i]) from None
    try:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        if job.snapshots[i]:
            conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(job.snapshots[i])))
        conn.execute(SESSION_SQL)
    except psycopg.Error as exc:
        conn.close()
        raise PgmeshError(
            f"a compare task cannot import the snapshot: {describe(exc)}", node=job.nodes[i],
            sqlstate=exc.sqlstate,
        ) from None
    return conn


Read = Callable[[bool], tuple[sql.Composed, list[Any]]]  # filtered -> a query and its parameters


def _on_nodes(
    pool: ThreadPoolExecutor, conns: Sequence[psycopg.Connection[Any]], job: CompareJob, table: CompareTable,
    read: Read, *, binary: bool = False,
) -> list[list[tuple[Any, ...]]]:
    """`read`'s query run on each of the table's nodes at once (a thread each: psycopg lets the GIL go
    while it waits), filtered where `CompareTable.filtered` says; the answers in the table's node order.
    `binary`: results in binary (arrays are loaded in C)."""

    nodes = job.nodes_of(table)
    built = {f: read(f) for f in {table.filtered(i) for i in nodes}}  # (once each: ~80 µs to compose)

    def run(i: int) -> list[tuple[Any, ...]]:
        query, params = built[table.filtered(i)]
        try:
            return conns[i].execute(query, params, binary=binary).fetchall()
        except psycopg.Error as exc:
            raise PgmeshError(f"reading a key range failed: {describe(exc)}", node=job.nodes[i],
                              relation=table.label, sqlstate=exc.sqlstate) from None

    return list(pool.map(run, nodes))


def compare_range(
    pool: ThreadPoolExecutor, conns: Sequence[psycopg.Connection[Any]], job: CompareJob, task: RangeTask,
    *, dense: bool = False,
) -> list[Difference]:
    """The range's count and hash on each of its table's nodes (`range_sql`); where they differ, `descend`.
    A table without a key: `compare_multiset`. `dense`: differences are expected all over the range (the
    last range of its table had many): its rows are read at once (`_leaves`), one pass instead of the
    three of a descent that ends reading them all anyway."""
    table = job.tables[task.table]
    if table.keyless:
        return compare_multiset(pool, conns, job, task)
    if dense:
        return _leaves(pool, conns, job, task, None)
    read: Read = functools.partial(range_sql, table, task)
    whole = {tuple(rows[0]) for rows in _on_nodes(pool, conns, job, table, read)}
    return descend(pool, conns, job, task) if len(whole) > 1 else []


def descend(
    pool: ThreadPoolExecutor, conns: Sequence[psycopg.Connection[Any]], job: CompareJob, task: RangeTask
) -> list[Difference]:
    """The range's buckets on each of its table's nodes; a differing bucket of an integer span with more
    than LEAF_ROWS rows is cut into buckets again (`sub_task`: read by the key index), the others are read
    row by row."""
    table = job.tables[task.table]
    sums = [
        {int(b): (int(n), int(x)) for b, n, x in rows}
        for rows in _on_nodes(pool, conns, job, table, functools.partial(bucket_sql, table, task))
    ]
    buckets = sorted({b for s in sums for b in s if any(o.get(b) != s.get(b) for o in sums)})
    found: list[Difference] = []
    leaves: list[int] = []
    for bucket in buckets:
        inner = sub_task(task, bucket, BUCKETS)
        if inner is None or max(s.get(bucket, (0, 0))[0] for s in sums) <= LEAF_ROWS:
            leaves.append(bucket)
        else:
            found += descend(pool, conns, job, inner)
    if leaves:
        found += _leaves(pool, conns, job, task, leaves)
    return found


def _leaves(
    pool: ThreadPoolExecutor, conns: Sequence[psycopg.Connection[Any]], job: CompareJob, task: RangeTask,
    leaves: Sequence[int] | None,
) -> list[Difference]:
    """The rows of some buckets (None: of the whole range) on each node, as two arrays (keys, hashes:
    loaded in C, in binary: where most buckets differ every row is read), compared as sets of (key, hash)
    pairs; the differing keys' JSON then read by key (`rows_sql`)."""
    table = job.tables[task.table]
    read_leaves: Read = functools.partial(leaf_sql, table, task, leaves)
    hashes = [dict(zip(rows[0][0] or (), rows[0][1] or (), strict=True))
              for rows in _on_nodes(pool, conns, job, table, read_leaves, binary=True)]
    pairs = [set(h.items()) for h in hashes]
    common = set.intersection(*pairs)
    differing = sorted({k for p in pairs for k, _ in p - common})
    if not differing:
        return []
    read_rows: Read = functools.partial(rows_sql, table, task, leaves, keys=differing)
    key_json = {str(k): str(j) for rows in _on_nodes(pool, conns, job, table, read_rows) for k, j, _ in rows}
    # (a key no node holds by then, on sessions without a snapshot, is left to the recheck)
    per_node = [{k: (key_json[k], int(h[k])) for k in differing if k in h and k in key_json} for h in hashes]
    return differences(task.table, per_node)


def keyless_where(table: CompareTable, filtered: bool) -> sql.Composable:
    """A table without a key is read whole: only a partial node's filter, where `filtered`."""
    return kept(table.rows) if filtered and table.rows is not None else sql.SQL("true")


def compare_multiset(
    pool: ThreadPoolExecutor, conns: Sequence[psycopg.Connection[Any]], job: CompareJob, task: RangeTask
) -> list[Difference]:
    """A table without a key as a multiset of rows (router.cluster.compare.multiset): its count and sum of
    row hashes; where they differ, per bucket; the differing buckets' rows with their copies. Each row
    whose copies differ is a `Difference` named by the row's text, its `hashes` being its copies per node
    (None: none)."""
    table = job.tables[task.table]
    schema, name, columns = table.schema, table.name, table.columns

    def read(build: Callable[[sql.Composable], sql.Composed], *params: Any) -> list[list[tuple[Any, ...]]]:
        return _on_nodes(pool, conns, job, table, lambda f: (build(keyless_where(table, f)), list(params)))

    whole = {tuple(rows[0]) for rows in read(lambda w: multiset.whole_sql(schema, name, columns, w))}
    if len(whole) <= 1:
        return []
    buckets = multiset.buckets_for(max(int(n) for n, _ in whole))  # about LEAF_ROWS_KEYLESS rows each
    sums = [multiset.parse_sums(rows) for rows in read(
        lambda w: multiset.bucket_sql(schema, name, columns, w, buckets))]
    differing = sorted({b for s in sums for b in s if any(o.get(b) != s.get(b) for o in sums)})
    if not differing:
        return []
    per_node = [{str(text): int(n) for text, n in rows} for rows in read(
        lambda w: multiset.rows_sql(schema, name, columns, w, buckets), differing)]
    found = multiset.multiset_differences(per_node)
    return [Difference(task.table, text, "", counts) for text, counts in found]


def run_partition(job: CompareJob, tasks: Iterable[RangeTask]) -> Iterator[Difference]:
    """One Spark partition: its ranges, with one session per node for all of them, each range read on its
    table's nodes at once."""
    with ThreadPoolExecutor(len(job.dsns), thread_name_prefix="pgmesh-compare") as pool:
        opening = [pool.submit(_connect, job, i) for i in range(len(job.dsns))]
        wait(opening)
        conns = [f.result() for f in opening if f.exception() is None]
        try:
            for f in opening:
                f.result()  # the first that failed
            dense: set[int] = set()  # tables whose last range had DENSE differences or more
            for task in tasks:
                found = compare_range(pool, conns, job, task, dense=task.table in dense)
                (dense.add if len(found) >= DENSE else dense.discard)(task.table)
                yield from found
        finally:
            for conn in conns:
                conn.close()


def cut_ranges(
    conn: psycopg.Connection[Any], table: CompareTable, estimate: int, index: int = 0
) -> list[RangeTask]:
    """`table`'s key ranges, as every node reads them alike: an integer first key cut from its min and max
    here, another from the planner's histogram of it here; a keyless table whole. `estimate`: its rows
    (ROWS_PER_RANGE a range, at most MAX_RANGES); `index`: the tasks' table index."""
    if table.keyless:  # read whole in one task (router.cluster.compare.multiset)
        return [RangeTask(index, None, None)]
    parts = max(1, min(MAX_RANGES, estimate // ROWS_PER_RANGE))
    rel = sql.Identifier(table.schema, table.name)
    cuts: list[tuple[str | None, str | None]] = [(None, None)]
    if table.first_type in INTEGER_TYPES:
        first = sql.Identifier(table.keys[0])
        query = sql.SQL("SELECT min({k}), max({k}) FROM {t}").format(k=first, t=rel)
        low_high = conn.execute(query).fetchone()
        if low_high is not None and low_high[0] is not None:
            return integer_ranges(index, int(low_high[0]), int(low_high[1]), parts)
    elif parts > 1:
        bounds = conn.execute(
            "SELECT histogram_bounds::text::text[] FROM pg_catalog.pg_stats"
            " WHERE schemaname = %s AND tablename = %s AND attname = %s",
            [table.schema, table.name, table.keys[0]],
        ).fetchone()
        if bounds is not None and bounds[0]:
            cuts = bound_ranges(list(bounds[0]), parts)
    return [RangeTask(index, lo, hi) for lo, hi in cuts]
