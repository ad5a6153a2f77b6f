"""Schema drift: the replicated tables' columns compared across nodes (`compare`, pure), and `DriftWatch`,
which reads them, believes a difference only once it outlives the DDL in flight, and tells the router
which tables (and so which nodes) drifted. The router holds the links into and out of those nodes.

Replicated DDL can leave nodes apart without any link failing: `ADD COLUMN z int` on a and `ADD COLUMN
z text` on b at about the same time stop both links (42701); after the obvious fix by hand (drop z
locally, `pgmesh resume`), a holds `z text` and b `z integer`, and both links would stream on. So the
columns of every published table (name, `format_type`, NOT NULL; their order ignored) are read on every
node and compared: after each DDL command the router replays, after `pgmesh resume`, when the router
starts, and every `recheck_s` while anything differs or is not yet decided.

A difference seen once may be DDL still travelling (b has replayed a's ADD COLUMN, c not yet). It is
believed only if it is still there, the same, after a replication barrier: every node's slot confirmed
past that node's WAL position read after the first look, so everything committed anywhere before it has
been applied everywhere. A barrier not reached within `settle_s` (a link stopped or held) decides
nothing: the difference is looked at again later. A table that agrees again is released at once.

Which nodes differ: for each table, the nodes are grouped by their columns; when one group is larger
than every other, the nodes outside it differ, else (two nodes, or no majority) all of them do.

Must not: change any node's schema (the operator fixes drift), hold or release a link itself (it hands
its findings to `on_change`), or log more than one line per drift found (and one when it is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final

import msgspec

from protocol.lsn import format_lsn
from router.progress import BARRIER_POSITION_SQL

__all__ = [
    "COLUMNS_SQL", "DriftWatch", "Query", "Shapes", "TableDrift", "compare", "drifted_nodes",
    "shapes_from_rows",
]

logger = logging.getLogger(__name__)

RECHECK_S: Final = 5.0  # while a table differs or is undecided: look again this often
SETTLE_S: Final = 10.0  # how long a barrier may take before the look decides nothing
_POLL_S: Final = 0.2
_MAX_COLUMNS: Final = 5  # differing columns named in one line

# A query on one node: (sql, params) -> rows (the router's monitoring connection).
Query = Callable[[str, Sequence[Any] | None], Awaitable[list[tuple[Any, ...]]]]

Column = tuple[str, str, bool]  # name, format_type, NOT NULL
Shape = tuple[Column, ...]  # sorted by name
Shapes = Mapping[str, Mapping[str, Shape]]  # node -> "schema.table" -> its columns

# The columns of every table in pgmesh's publication (roots only: it publishes via the partition root).
COLUMNS_SQL: Final = (
    "SELECT pg_catalog.format('%%I.%%I', t.schemaname, t.tablename), a.attname,"
    " pg_catalog.format_type(a.atttypid, a.atttypmod), a.attnotnull"
    " FROM pg_catalog.pg_publication_tables t"
    " JOIN pg_catalog.pg_namespace n ON n.nspname = t.schemaname"
    " JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = t.tablename"
    " JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped"
    " WHERE t.pubname = %s"
)
_SLOT_SQL: Final = (
    "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_catalog.pg_replication_slots WHERE slot_name = %s"
)


class TableDrift(msgspec.Struct, frozen=True):
    """One replicated table whose columns differ between nodes."""

    table: str  # schema.table, quoted where it needs quotes
    nodes: tuple[str, ...]  # the nodes that differ from the others (every node when none is a majority)
    columns: tuple[str, ...]  # the columns that differ ("" when the table is missing somewhere)
    detail: str  # what differs, node by node: "column z: integer on a; text on b"

    def describe(self) -> str:
        return f"table {self.table} differs on {', '.join(self.nodes)}: {self.detail}"


def shapes_from_rows(rows: Sequence[tuple[Any, ...]]) -> dict[str, Shape]:
    """`COLUMNS_SQL`'s rows as table -> its columns, sorted by name (attnum order does not matter)."""
    tables: dict[str, list[Column]] = {}
    for table, name, type_, not_null in rows:
        tables.setdefault(str(table), []).append((str(name), str(type_), bool(not_null)))
    return {table: tuple(sorted(columns)) for table, columns in tables.items()}


def _column_text(column: Column | None) -> str:
    if column is None:
        return "missing"
    return f"{column[1]} NOT NULL" if column[2] else column[1]


def _by_value(values: Mapping[str, str]) -> str:
    """node -> text as "text on a, c; other on b" (in the first node's order)."""
    groups: dict[str, list[str]] = {}
    for node, text in values.items():
        groups.setdefault(text, []).append(node)
    return "; ".join(f"{text} on {', '.join(nodes)}" for text, nodes in groups.items())


def _differing(shapes: Mapping[str, Shape | None]) -> tuple[tuple[str, ...], str]:
    """The columns that differ and what each is on each node."""
    missing = {node: "absent" if shape is None else "published" for node, shape in shapes.items()}
    if any(shape is None for shape in shapes.values()):
        return ("",), f"table {_by_value(missing)}"
    by_name = {node: {c[0]: c for c in shape or ()} for node, shape in shapes.items()}
    names = sorted({name for columns in by_name.values() for name in columns})
    found: list[str] = []
    parts: list[str] = []
    for name in names:
        texts = {node: _column_text(columns.get(name)) for node, columns in by_name.items()}
        if len(set(texts.values())) > 1:
            found.append(name)
            if len(parts) < _MAX_COLUMNS:
                parts.append(f"column {name}: {_by_value(texts)}")
    more = len(found) - len(parts)
    return tuple(found), "; ".join(parts) + (f" (and {more} more columns)" if more else "")


def compare(shapes: Shapes) -> dict[str, TableDrift]:
    """The tables whose columns are not the same on every node in `shapes` (a table missing from some
    nodes' publication counts), with the nodes that differ."""
    nodes = sorted(shapes)
    tables = sorted({table for per_node in shapes.values() for table in per_node})
    found: dict[str, TableDrift] = {}
    for table in tables:
        per_node = {node: shapes[node].get(table) for node in nodes}
        groups: dict[Shape | None, list[str]] = {}
        for node, shape in per_node.items():
            groups.setdefault(shape, []).append(node)
        if len(groups) == 1:
            continue
        sizes = sorted((len(g) for g in groups.values()), reverse=True)
        majority = max(groups.values(), key=len) if sizes[0] > sizes[1] else []
        differ = tuple(node for node in nodes if node not in majority)
        columns, detail = _differing(per_node)
        found[table] = TableDrift(table, differ, columns, detail)
    return found


def drifted_nodes(drift: Mapping[str, TableDrift]) -> dict[str, list[TableDrift]]:
    """node -> the drifted tables it differs on."""
    out: dict[str, list[TableDrift]] = {}
    for item in drift.values():
        for node in item.nodes:
            out.setdefault(node, []).append(item)
    return out


class DriftWatch:
    """Compares the nodes' replicated tables when asked (`poke`) and while anything differs; hands every
    decided state to `on_change` (table -> drift; empty when the schemas agree)."""

    __slots__ = ("_clock", "_nodes", "_on_change", "_pending", "_publication", "_slot", "_synced", "_wanted",
                 "drifted", "recheck_s", "settle_s")

    def __init__(
        self,
        nodes: Mapping[str, Query],
        *,
        publication: str,
        slot: str,
        on_change: Callable[[Mapping[str, TableDrift]], None],
        recheck_s: float = RECHECK_S,
        settle_s: float = SETTLE_S,
        clock: Callable[[], float] = time.monotonic,
        synced: Callable[[str], int] | None = None,
    ) -> None:
        """`synced(node)`: the position of `node` up to which every other node has flushed everything
        (router.progress.SourceProgress.synced); without it, the node's slot's confirmed position (which
        the router's log may move past what the targets applied)."""
        self._nodes = dict(nodes)
        self._synced = synced
        self._publication = publication
        self._slot = slot
        self._on_change = on_change
        self.recheck_s = recheck_s
        self.settle_s = settle_s
        self._clock = clock
        self._wanted = asyncio.Event()
        self._pending = False  # a difference seen, not yet decided (its barrier was not reached)
        self.drifted: dict[str, TableDrift] = {}

    def poke(self) -> None:
        """Compare again soon (DDL was replayed, a link was resumed)."""
        self._wanted.set()

    async def run(self) -> None:
        """Compare at start, when poked, and every `recheck_s` while anything differs or is undecided."""
        self._wanted.set()
        while True:
            wait = self.recheck_s if self.drifted or self._pending else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wanted.wait(), wait)
            self._wanted.clear()
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a node down, a table dropped while read: look again later
                self._pending = True
                logger.debug("schema drift check: %s; looking again in %.0f s", exc, self.recheck_s)

    async def _shapes(self) -> dict[str, dict[str, Shape]]:
        return {
            node: shapes_from_rows(await query(COLUMNS_SQL, [self._publication]))
            for node, query in self._nodes.items()
        }

    async def check(self) -> dict[str, TableDrift]:
        """Look once; a new difference is decided behind a barrier. Returns what is drifted now."""
        seen = compare(await self._shapes())
        new = {t: d for t, d in seen.items() if t not in self.drifted}
        kept = {t: d for t, d in seen.items() if t in self.drifted}
        confirmed: dict[str, TableDrift] = {}
        self._pending = False
        if new:
            if await self._settled():
                again = compare(await self._shapes())
                confirmed = {t: d for t, d in new.items() if again.get(t) == d}
                kept = {t: again[t] for t in kept if t in again}
                self._pending = any(t in again and t not in confirmed for t in new)
            else:
                self._pending = True
        for table in self.drifted:
            if table not in kept:
                logger.info("schema drift over: table %s is the same on every node again", table)
        for drift in confirmed.values():
            logger.warning(
                "schema drift: %s; the links into and out of %s hold (nothing is lost) until the table is"
                " the same everywhere: fix it on the differing node with SET pgmesh.ddl_local = on"
                " (docs/ddl.md, Schema drift)", drift.describe(), ", ".join(drift.nodes),
            )
        self.drifted = {**kept, **confirmed}
        self._on_change(self.drifted)
        return self.drifted

    async def _settled(self) -> bool:
        """A barrier: every node's WAL position now flushed by every other node (all DDL then in flight
        has been replayed everywhere). False when not reached within `settle_s`."""
        wanted: dict[str, int] = {}
        for node, query in self._nodes.items():
            rows = await query(BARRIER_POSITION_SQL, None)
            wanted[node] = int(rows[0][0])
        deadline = self._clock() + self.settle_s
        while wanted:
            for node in list(wanted):
                if self._synced is not None:
                    if self._synced(node) >= wanted[node]:
                        del wanted[node]
                    continue
                rows = await self._nodes[node](_SLOT_SQL, [self._slot])
                if rows and rows[0][0] is not None and int(rows[0][0]) >= wanted[node]:
                    del wanted[node]
            if not wanted:
                return True
            if self._clock() > deadline:
                late = ", ".join(f"{n} (wants {format_lsn(lsn)})" for n, lsn in sorted(wanted.items()))
                logger.debug("schema drift check: barrier not reached in %.0f s: %s", self.settle_s, late)
                return False
            await asyncio.sleep(_POLL_S)
        return True
