"""Planning a comparison: the tables compared, and key ranges (one per Spark task) over them.

Owns: what a compared table is (`CompareTable`: its name, key columns and the first key column's type,
and the nodes compared on it: the full nodes, or a partial node and its reference, with the part that
node holds), what is compared where (`compared_on`: each table on the full nodes, and on each partial
node, router.cluster.partial, the tables it gets, against its reference: the first full node), cutting a
table's first key column into ranges that every node reads alike (`integer_ranges` from the reference's
min and max, `bound_ranges` from its planner statistics' histogram), and grouping the ranges into Spark
partitions. The first and the last range are open-ended: keys another node has beyond the reference's
min or max are read too, whatever the statistics say.

Must not: touch a database, Spark or a clock; everything here is a pure function of its arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import msgspec

from router.cluster.partial import is_partial, reaches, table_part
from router.config.model import NodeConfig

__all__ = [
    "INTEGER_TYPES", "CompareTable", "RangeTask", "bound_ranges", "compared_on", "integer_ranges",
    "partitions",
]

INTEGER_TYPES: Final = frozenset({"smallint", "integer", "bigint"})
Bound = str | None  # a key value as text (cast to the column's type by the reader); None: open


class CompareTable(msgspec.Struct, frozen=True):
    """A table, as compared on some of the job's nodes."""

    schema: str
    name: str
    # the primary key's (or replica identity index's) columns, in index order; (): a table without a key,
    # compared as a multiset of whole rows (router.cluster.compare.multiset)
    keys: tuple[str, ...]
    first_type: str  # format_type() of the first key column: ranges cut over it ("": no key)
    nodes: tuple[int, ...] = ()  # the job's nodes compared on it (indexes, in order); (): every node
    # A partial node's part (router.cluster.partial), `nodes` being (its reference full node, the partial
    # node): the reference reads only the rows `rows` keeps (NULL: not kept); both hash only `columns`
    rows: str | None = None
    columns: tuple[str, ...] | None = None

    @property
    def label(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def keyless(self) -> bool:
        return not self.keys

    def filtered(self, node: int) -> bool:
        """Whether node `node` (an index into the job's nodes) reads only the rows the filter keeps: the
        reference of a partial node's part (the partial node holds only those: any other is a difference)."""
        return self.rows is not None and node == self.nodes[0]


def compared_on(tables: Sequence[CompareTable], nodes: Sequence[NodeConfig]) -> list[CompareTable]:
    """Each table as compared on the full nodes (if there are two or more: all of them, in order), then,
    for each partial node in order, each table it gets as compared on (the first full node, it), with the
    part of it that node holds. At least one of `nodes` is full (only a receive-only node is partial)."""
    full = tuple(i for i, node in enumerate(nodes) if not is_partial(node))
    out = [msgspec.structs.replace(t, nodes=full) for t in tables] if len(full) > 1 else []
    for i, node in enumerate(nodes):
        if not is_partial(node):
            continue
        for t in tables:
            if reaches(node, t.label):
                part = table_part(node, t.label)
                rows, columns = (part.rows, part.columns) if part is not None else (None, None)
                out.append(msgspec.structs.replace(t, nodes=(full[0], i), rows=rows, columns=columns))
    return out


class RangeTask(msgspec.Struct, frozen=True):
    """Rows of table `table` (an index into the job's tables) whose first key column is >= lo and < hi.

    `span`, for an integer first key: the range's values [start, end) cut into buckets of consecutive
    keys (a bucket that differs is read again by the key index; keys beyond either end get a bucket of
    their own). None: buckets by the key's hash. A table without a key is one task (lo and hi None): the
    whole table (router.cluster.compare.multiset)."""

    table: int
    lo: Bound
    hi: Bound
    span: tuple[int, int] | None = None

    def step(self, buckets: int) -> int:
        """Keys per bucket of an integer span."""
        assert self.span is not None
        return max(1, -(-(self.span[1] - self.span[0]) // buckets))


def sub_task(task: RangeTask, bucket: int, buckets: int) -> RangeTask | None:
    """Bucket `bucket` of an integer span as a range of its own, to be cut into `buckets` again (the next
    step of the descent); None where there is nothing to cut: a hash bucket, a bucket beyond the span's
    ends (-1, `buckets`), or one key."""
    if task.span is None or not 0 <= bucket < buckets:
        return None
    start, end = task.span
    step = task.step(buckets)
    low, high = start + bucket * step, min(start + (bucket + 1) * step, end)
    if high - low <= 1:
        return None
    return RangeTask(task.table, str(low), str(high), (low, high))


def integer_ranges(table: int, low: int, high: int, parts: int) -> list[RangeTask]:
    """[low, high] cut into `parts` ranges of equal width, the first and the last open-ended, each with
    its span of values (the open ends' from `low` and `high`)."""
    cuts = [] if parts <= 1 or high - low < parts else sorted(
        {low + round((high - low + 1) / parts * i) for i in range(1, parts)}
    )
    edges = [low, *cuts, high + 1]
    bounds = _from_cuts([str(c) for c in cuts])
    return [RangeTask(table, lo, hi, (edges[i], edges[i + 1])) for i, (lo, hi) in enumerate(bounds)]


def bound_ranges(bounds: Sequence[str], parts: int) -> list[tuple[Bound, Bound]]:
    """Ranges between evenly spaced values of a sorted histogram (pg_stats.histogram_bounds)."""
    if parts <= 1 or len(bounds) < 3:
        return [(None, None)]
    inner = list(bounds[1:-1])
    take = min(parts - 1, len(inner))
    cuts = [inner[round(i * (len(inner) - 1) / max(take - 1, 1))] for i in range(take)]
    return _from_cuts(list(dict.fromkeys(cuts)))


def _from_cuts(cuts: list[str]) -> list[tuple[Bound, Bound]]:
    edges: list[Bound] = [None, *cuts, None]
    return [(edges[i], edges[i + 1]) for i in range(len(edges) - 1)]


def partitions(tasks: Sequence[RangeTask], count: int) -> list[list[RangeTask]]:
    """Deal the tasks round-robin into at most `count` non-empty partitions."""
    count = max(1, min(count, len(tasks)))
    out: list[list[RangeTask]] = [[] for _ in range(count)]
    for i, task in enumerate(tasks):
        out[i % count].append(task)
    return [p for p in out if p]
