"""Planning the initial copy: relation sizes in, ctid block ranges (one per Spark task) out.

Owns: how many tasks a relation gets (from its size, the cluster's parallelism or an explicit count),
how its heap blocks [0, nblocks) are cut into ranges, the open-ended last range, and the order in
which tasks are handed to Spark (largest first, so small tables fill in behind the big ones).

Must not: touch a database, Spark or a clock. Sizes, and each table's COPY format (binary unless a column
type cannot take it: `Leaf.binary`), are read by `router.cluster.copy.initial` on the donor under the
exported snapshot and passed in; everything here is a pure function of its arguments.

Why an open-ended last range: a relation's size is read after the snapshot was taken. Every row version
the snapshot can see lies in a block that existed when it was taken, so the sizes are enough; the last
range still carries no upper bound (`ctid >= '(a,0)'` only), so no block is ever left out whatever the
size read says.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import msgspec

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "SMALL_TABLE_BYTES",
    "TASKS_PER_CORE",
    "TASK_BYTES",
    "BlockRange",
    "CopyTask",
    "Leaf",
    "block_ranges",
    "plan_tasks",
    "task_count",
]

DEFAULT_BLOCK_SIZE: Final = 8192
SMALL_TABLE_BYTES: Final = 8 * 1024 * 1024
"""Relations smaller than this get one task: a task's connections and snapshot import cost more."""
TASK_BYTES: Final = 256 * 1024 * 1024
"""When choosing automatically, no task covers more than about this much heap."""
TASKS_PER_CORE: Final = 1
"""A large relation gets at least this many tasks per core (if each is still >= SMALL_TABLE_BYTES)."""


class BlockRange(msgspec.Struct, frozen=True):
    """Heap blocks [first, end) of one relation; `end` None means no upper bound."""

    first: int
    end: int | None

    def blocks(self, nblocks: int) -> int:
        """How many of the relation's `nblocks` (as read when planning) this range covers."""
        end = nblocks if self.end is None else self.end
        return max(0, end - self.first)


class Leaf(msgspec.Struct, frozen=True):
    """One relation that holds rows (a plain table or a leaf partition), with its size in blocks."""

    table: int  # index of the table it belongs to, in the caller's list
    schema: str
    name: str
    nblocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    binary: bool = True  # False: a column's type cannot round-trip binary COPY; the table copies as text

    @property
    def nbytes(self) -> int:
        return self.nblocks * self.block_size


class CopyTask(msgspec.Struct, frozen=True):
    """One Spark task: copy one block range of one relation (same schema and name on both sides)."""

    table: int
    schema: str
    name: str
    columns: tuple[str, ...]
    range: BlockRange
    blocks: int  # estimated size in blocks (the open-ended range counts up to the size read)
    binary: bool = True  # COPY format: binary, or text for a table with a type binary COPY cannot take
    # `pgmesh push` (router.cluster.copy.push): the donor's rows are this query's instead of the range's
    query: str | None = None
    # `pgmesh push`: the target's key columns; the rows are upserted by them, not appended
    keys: tuple[str, ...] = ()

    @property
    def relation(self) -> str:
        return f"{self.schema}.{self.name}"


def task_count(nbytes: int, *, requested: int = 0, parallelism: int = 1) -> int:
    """How many tasks a relation of `nbytes` gets.

    `requested` > 0 is taken as is (the caller asked for it). Otherwise: one task below
    SMALL_TABLE_BYTES; above, enough tasks that none exceeds TASK_BYTES, and at least TASKS_PER_CORE
    per core of `parallelism` as long as each task keeps at least SMALL_TABLE_BYTES.
    """
    if requested > 0:
        return requested
    if nbytes < SMALL_TABLE_BYTES:
        return 1
    by_size = math.ceil(nbytes / TASK_BYTES)
    by_cores = min(max(1, parallelism) * TASKS_PER_CORE, nbytes // SMALL_TABLE_BYTES)
    return max(1, by_size, by_cores)


def block_ranges(nblocks: int, count: int) -> list[BlockRange]:
    """Cut blocks [0, nblocks) into `count` contiguous ranges of near-equal size; the last is open-ended.

    Never more ranges than blocks; an empty relation gets one open range.
    """
    if nblocks < 0:
        raise ValueError(f"nblocks must be >= 0, not {nblocks}")
    count = max(1, min(count, nblocks))
    starts = [nblocks * i // count for i in range(count)]
    ends: list[int | None] = [*starts[1:], None]
    return [BlockRange(first, end) for first, end in zip(starts, ends, strict=True)]


def plan_tasks(
    leaves: Sequence[Leaf],
    columns: Sequence[tuple[str, ...]],
    *,
    requested: int = 0,
    parallelism: int = 1,
) -> list[CopyTask]:
    """Every task for `leaves`, largest first. `columns[leaf.table]` are the columns to copy.

    `requested` (> 0) is the number of tasks per relation (a leaf partition counts as a relation);
    0 chooses from each relation's size (`task_count`).
    """
    tasks: list[CopyTask] = []
    for leaf in leaves:
        count = task_count(leaf.nbytes, requested=requested, parallelism=parallelism)
        for block_range in block_ranges(leaf.nblocks, count):
            tasks.append(
                CopyTask(
                    table=leaf.table,
                    schema=leaf.schema,
                    name=leaf.name,
                    columns=columns[leaf.table],
                    range=block_range,
                    blocks=block_range.blocks(leaf.nblocks),
                    binary=leaf.binary,
                )
            )
    # Stable sort: equal sizes keep the caller's table order and the ranges' block order.
    tasks.sort(key=lambda task: -task.blocks)
    return tasks
