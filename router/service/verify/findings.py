"""What a verification pass found of one table: the keys (or, without a key, the rows) that still differ
after the recheck, and which nodes hold each apart.

A key's values (row hashes, or a keyless row's copies, per node) are grouped: a value held by more nodes
than any other is the cluster's, and the nodes without it hold the key apart; with no such value (two
nodes, or a tie) every node of the key counts. `TableFinding` keeps the count per node (what
pgmesh_divergent_rows publishes) and the first keys (what the log line names).

Must not: read a node, log, or keep anything between passes (router.service.verify.verifier does).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Final

import msgspec

__all__ = ["FIRST_KEYS", "TableFinding", "apart", "finding", "merged"]

FIRST_KEYS: Final = 5  # keys named in the log line of a table that differs


def apart(values: Sequence[int | None]) -> list[int]:
    """The positions (nodes) whose value is not the cluster's: the value more of them hold than any other;
    all of them when no value is held by more than every other."""
    counts = Counter(values).most_common()
    if len(counts) > 1 and counts[0][1] > counts[1][1]:
        return [i for i, v in enumerate(values) if v != counts[0][0]]
    return list(range(len(values)))


class TableFinding(msgspec.Struct, frozen=True):
    """One table as a pass left it: `rows[node]`, its rows held apart there (0 for every node compared on
    it: a table found identical again reads 0), `keys` the first divergent keys (a row's text without a
    key), `total` the divergent keys, `unsettled` the keys still being written at every recheck."""

    table: str
    rows: dict[str, int]
    keys: list[str]
    total: int
    unsettled: int = 0


def finding(
    table: str, nodes: Sequence[str], divergent: Sequence[tuple[str, Sequence[int | None]]],
    unsettled: int = 0,
) -> TableFinding:
    """`divergent`: each key (sorted) with its values on `nodes` (in that order)."""
    rows = dict.fromkeys(nodes, 0)
    for _, values in divergent:
        for i in apart(values):
            rows[nodes[i]] += 1
    return TableFinding(table, rows, [k for k, _ in divergent[:FIRST_KEYS]], len(divergent), unsettled)


def merged(before: TableFinding | None, more: TableFinding) -> TableFinding:
    """One table's findings of one pass put together (a table compared twice: on the full nodes, and on a
    partial node against its reference)."""
    if before is None:
        return more
    rows = dict(before.rows)
    for node, count in more.rows.items():
        rows[node] = rows.get(node, 0) + count
    return TableFinding(more.table, rows, (before.keys + more.keys)[:FIRST_KEYS], before.total + more.total,
                        before.unsettled + more.unsettled)
