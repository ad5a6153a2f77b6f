"""Schema drift: the replicated tables' columns, and the enums and domains they use, compared across
nodes (`compare`, pure), and `DriftWatch`, which reads them, believes a difference only once it outlives
the DDL in flight, and tells the router which tables (and so which nodes) drifted.
The router holds the links into and out of those nodes.

Replicated DDL can leave nodes apart without any link failing: `ADD COLUMN z int` on a and `ADD COLUMN
z text` on b at about the same time stop both links (42701); after the obvious fix by hand (drop z
locally, `pgmesh resume`), a holds `z text` and b `z integer`, and both links would stream on. Rows can
be identical while answers differ too: `ALTER TYPE m ADD VALUE` on two nodes at once leaves the labels in
another order on each (`WHERE m > 'x'`, ORDER BY, CHECKs and indexes then differ), and a default,
identity or generation expression, or a domain's constraint, changed on one node fills or checks rows
differently there. So everything that makes rows or answers differ is read on every node in one catalog
query (`COLUMNS_SQL`) and compared as text: each published table's columns (name, `format_type`, NOT
NULL, default, identity, generation expression, collation; their order ignored), and each enum (its
labels in sort order) and domain (base type, NOT NULL, default, CHECKs) those columns use. It runs after
each DDL command the router replays, after `pgmesh resume`, when the router starts, and every
`recheck_s` while anything differs or is not yet decided, and every `idle_s` (a minute) otherwise: a
change made on one node alone (`pgmesh.ddl_local`) replays nothing that would ask for a look. Values
themselves are not compared (`pgmesh compare` does that): an ADD COLUMN whose default each node
evaluates itself shows here only if the default's text differs.

A difference seen once may be DDL still travelling (b has replayed a's ADD COLUMN, c not yet). It is
believed only if it is still there, the same, after a replication barrier: every node's slot confirmed
past that node's WAL position read after the first look, so everything committed anywhere before it has
been applied everywhere. A barrier not reached within `settle_s` (a link stopped or held) decides
nothing: the difference is looked at again later. A table that agrees again is released at once.

Which nodes differ: for each table (or type), the nodes are grouped by their columns; when one group is
larger than every other, the nodes outside it differ, else (two nodes, or no majority) all of them do.

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
from router.progress.positions import BARRIER_POSITION_SQL

__all__ = [
    "COLUMNS_SQL", "DriftWatch", "Query", "Shapes", "TableDrift", "compare", "drifted_nodes",
    "shapes_from_rows",
]

logger = logging.getLogger(__name__)

RECHECK_S: Final = 5.0  # while a table differs or is undecided: look again this often
IDLE_S: Final = 60.0  # else this often (a change made on one node alone replays nothing that pokes it)
SETTLE_S: Final = 10.0  # how long a barrier may take before the look decides nothing
_POLL_S: Final = 0.2
_MAX_COLUMNS: Final = 5  # differing columns named in one line

# A query on one node: (sql, params) -> rows (the router's monitoring connection).
Query = Callable[[str, Sequence[Any] | None], Awaitable[list[tuple[Any, ...]]]]

# name, format_type, NOT NULL[, what fills it: "DEFAULT now()", "GENERATED ALWAYS AS IDENTITY", ...]
Column = tuple[str, str, bool] | tuple[str, str, bool, str]
Shape = tuple[Column, ...]  # sorted by name
Shapes = Mapping[str, Mapping[str, Shape]]  # node -> "schema.table" (or "type x", "domain x") -> its items
_KINDS: Final = ("type", "domain")  # the objects besides tables, by the prefix of their key

# One catalog query per node, compared as text: every published table's columns (roots only: pgmesh
# publishes via the partition root) with type, NOT NULL, and what fills them (default, identity,
# generation expression, a collation other than the type's); and every enum and domain those columns
# use (directly, as an array's element, under a domain): an enum's labels in their sort order
# (pg_enum.enumsortorder), a domain's base type, NOT NULL, default and CHECK constraints. A type's key
# is "type <name>" / "domain <name>" (a table's is its bare name: %I quotes any space in a table's).
COLUMNS_SQL: Final = """
WITH RECURSIVE cols AS (
  SELECT pg_catalog.format('%%I.%%I', t.schemaname, t.tablename) AS obj, a.attname::text AS item,
    pg_catalog.format_type(a.atttypid, a.atttypmod) AS type, a.attnotnull AS not_null, a.atttypid,
    pg_catalog.concat_ws(' ',
      CASE WHEN a.attgenerated = 's' THEN 'GENERATED ALWAYS AS (' || pg_catalog.pg_get_expr(d.adbin,
          d.adrelid) || ') STORED'
        WHEN a.attgenerated = 'v' THEN 'GENERATED ALWAYS AS (' || pg_catalog.pg_get_expr(d.adbin,
          d.adrelid) || ') VIRTUAL'
        WHEN d.adbin IS NOT NULL THEN 'DEFAULT ' || pg_catalog.pg_get_expr(d.adbin, d.adrelid) END,
      CASE a.attidentity WHEN 'a' THEN 'GENERATED ALWAYS AS IDENTITY'
        WHEN 'd' THEN 'GENERATED BY DEFAULT AS IDENTITY' END,
      CASE WHEN a.attcollation <> y.typcollation THEN 'COLLATE ' || pg_catalog.quote_ident(o.collname) END
    ) AS extra
  FROM pg_catalog.pg_publication_tables t
  JOIN pg_catalog.pg_namespace n ON n.nspname = t.schemaname
  JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = t.tablename
  JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
  JOIN pg_catalog.pg_type y ON y.oid = a.atttypid
  LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
  LEFT JOIN pg_catalog.pg_collation o ON o.oid = a.attcollation
  WHERE t.pubname = %s
), used(oid) AS (
  SELECT atttypid FROM cols
  UNION
  SELECT CASE WHEN y.typtype = 'd' THEN y.typbasetype ELSE y.typelem END
  FROM used JOIN pg_catalog.pg_type y ON y.oid = used.oid
  WHERE y.typtype = 'd' OR (y.typcategory = 'A' AND y.typelem <> 0)
), types AS (
  SELECT y.*, pg_catalog.format('%%I.%%I', n.nspname, y.typname) AS name
  FROM used JOIN pg_catalog.pg_type y ON y.oid = used.oid
  JOIN pg_catalog.pg_namespace n ON n.oid = y.typnamespace
  WHERE y.typtype IN ('e', 'd')
)
SELECT obj, item, type, not_null, extra FROM cols
UNION ALL
SELECT 'type ' || name, 'labels', (SELECT pg_catalog.string_agg(pg_catalog.quote_literal(e.enumlabel),
    ', ' ORDER BY e.enumsortorder) FROM pg_catalog.pg_enum e WHERE e.enumtypid = types.oid), false, ''
FROM types WHERE typtype = 'e'
UNION ALL
SELECT 'domain ' || name, 'definition', pg_catalog.format_type(typbasetype, typtypmod), typnotnull,
  pg_catalog.concat_ws(' ', 'DEFAULT ' || typdefault,
    (SELECT pg_catalog.string_agg(pg_catalog.pg_get_constraintdef(k.oid), ' ' ORDER BY k.conname)
     FROM pg_catalog.pg_constraint k WHERE k.contypid = types.oid AND k.contype = 'c'))
FROM types WHERE typtype = 'd'
"""
_SLOT_SQL: Final = (
    "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_catalog.pg_replication_slots WHERE slot_name = %s"
)


class TableDrift(msgspec.Struct, frozen=True):
    """One replicated table (or an enum or domain its columns use) that differs between nodes."""

    table: str  # schema.table (or schema.type), quoted where it needs quotes
    nodes: tuple[str, ...]  # the nodes that differ from the others (every node when none is a majority)
    columns: tuple[str, ...]  # the columns (items) that differ ("" when the object is missing somewhere)
    detail: str  # what differs, node by node: "column z: integer on a; text on b"
    kind: str = "table"  # "table", "type" (an enum: its labels in order) or "domain"

    def describe(self) -> str:
        return f"{self.kind} {self.table} differs on {', '.join(self.nodes)}: {self.detail}"


def _kind(key: str) -> tuple[str, str]:
    """A `Shapes` key as (kind, name): "type public.mood" -> ("type", "public.mood")."""
    head, _, rest = key.partition(" ")
    return (head, rest) if head in _KINDS and rest else ("table", key)


def shapes_from_rows(rows: Sequence[tuple[Any, ...]]) -> dict[str, Shape]:
    """`COLUMNS_SQL`'s rows as object -> its columns, sorted by name (attnum order does not matter)."""
    tables: dict[str, list[Column]] = {}
    for table, name, type_, not_null, *rest in rows:
        extra = str(rest[0] or "") if rest else ""
        column: Column = (str(name), str(type_ or ""), bool(not_null))
        tables.setdefault(str(table), []).append((*column, extra) if extra else column)
    return {table: tuple(sorted(columns)) for table, columns in tables.items()}


def _column_text(column: Column | None) -> str:
    if column is None:
        return "missing"
    text = f"{column[1]} NOT NULL" if column[2] else column[1]
    return f"{text} {column[3]}" if len(column) > 3 else text


def _by_value(values: Mapping[str, str]) -> str:
    """node -> text as "text on a, c; other on b" (in the first node's order)."""
    groups: dict[str, list[str]] = {}
    for node, text in values.items():
        groups.setdefault(text, []).append(node)
    return "; ".join(f"{text} on {', '.join(nodes)}" for text, nodes in groups.items())


def _differing(shapes: Mapping[str, Shape | None], kind: str) -> tuple[tuple[str, ...], str]:
    """The columns that differ and what each is on each node."""
    there = "published" if kind == "table" else "used"
    missing = {node: "absent" if shape is None else there for node, shape in shapes.items()}
    if any(shape is None for shape in shapes.values()):
        return ("",), f"{kind} {_by_value(missing)}"
    by_name = {node: {c[0]: c for c in shape or ()} for node, shape in shapes.items()}
    names = sorted({name for columns in by_name.values() for name in columns})
    found: list[str] = []
    parts: list[str] = []
    for name in names:
        texts = {node: _column_text(columns.get(name)) for node, columns in by_name.items()}
        if len(set(texts.values())) > 1:
            found.append(name)
            if len(parts) < _MAX_COLUMNS:
                parts.append(f"{'column ' if kind == 'table' else ''}{name}: {_by_value(texts)}")
    more = len(found) - len(parts)
    return tuple(found), "; ".join(parts) + (f" (and {more} more columns)" if more else "")


def compare(shapes: Shapes) -> dict[str, TableDrift]:
    """The tables whose columns (and the types whose labels or definition) are not the same on every node
    in `shapes` (a table missing from some nodes' publication counts), with the nodes that differ."""
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
        kind, name = _kind(table)
        columns, detail = _differing(per_node, kind)
        found[table] = TableDrift(name, differ, columns, detail, kind)
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

    __slots__ = ("_clock", "_failing", "_nodes", "_on_change", "_pending", "_publication", "_slot", "_synced",
                 "_wanted", "drifted", "idle_s", "recheck_s", "settle_s")

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
        (progress.positions.SourceProgress.synced); without it, the node's slot's confirmed position (which
        the router's log may move past what the targets applied)."""
        self._nodes = dict(nodes)
        self._synced = synced
        self._publication = publication
        self._slot = slot
        self._on_change = on_change
        self.recheck_s = recheck_s
        self.settle_s = settle_s
        self.idle_s = IDLE_S
        self._failing: str | None = None  # why the last look failed (logged once, not at every look)
        self._clock = clock
        self._wanted = asyncio.Event()
        self._pending = False  # a difference seen, not yet decided (its barrier was not reached)
        self.drifted: dict[str, TableDrift] = {}

    def poke(self) -> None:
        """Compare again soon (DDL was replayed, a link was resumed)."""
        self._wanted.set()

    async def run(self) -> None:
        """Compare at start, when poked, every `recheck_s` while anything differs or is undecided, and every
        `idle_s` otherwise."""
        self._wanted.set()
        while True:
            wait = self.recheck_s if self.drifted or self._pending else self.idle_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wanted.wait(), wait)
            self._wanted.clear()
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a node down, a table dropped while read: look again later
                self._pending = True
                failing, self._failing = self._failing, str(exc)
                (logger.debug if failing == self._failing else logger.warning)(
                    "schema drift check failed: %s; looking again every %.0f s", exc, self.recheck_s)
            else:
                if self._failing is not None:
                    logger.info("schema drift check works again")
                self._failing = None

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
                gone = self.drifted[table]
                logger.info("schema drift over: %s %s is the same on every node again", gone.kind, gone.table)
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
