"""What a verification pass compares: the tables in the cluster's publication (or those of them `[verify]
tables` names), read on the first full node, each with its key columns, as compared on the nodes
(router.cluster.compare.plan `compared_on`: the full nodes with each other, a partial node with the
reference through its part), cut into key ranges of about `ROWS_PER_RANGE` rows as `pgmesh compare` cuts
them (router.cluster.compare.worker `cut_ranges`), each with its estimated rows (what the rate bound
counts). A table without a key is one range, compared as a multiset (router.cluster.compare.multiset).
A table missing on some node, or named in `[verify] tables` but not published, is left out with why.

Must not: write anything, or keep a session (router.service.verify.sessions owns them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import msgspec
import psycopg
from psycopg import sql

from router.cluster.compare.plan import CompareTable, RangeTask, compared_on
from router.cluster.compare.worker import cut_ranges
from router.cluster.partial import is_partial, reaches
from router.config.model import Config, NodeConfig, split_table_name

__all__ = ["Scope", "read_scope"]


_PUBLISHED_SQL: Final = (
    "SELECT schemaname, tablename FROM pg_catalog.pg_publication_tables WHERE pubname = %s"
)
_MISSING_SQL: Final = "SELECT x FROM unnest(%s::text[]) AS x WHERE pg_catalog.to_regclass(x) IS NULL"
# the primary key's (else the replica identity index's) columns in index order, with the first one's type
_KEY_SQL: Final = (
    "SELECT a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod) FROM"
    " (SELECT i.indkey FROM pg_catalog.pg_index i WHERE i.indrelid = %s::regclass"
    "  AND (i.indisprimary OR i.indisreplident) ORDER BY i.indisprimary DESC LIMIT 1) AS x,"
    " unnest(x.indkey) WITH ORDINALITY AS k(attnum, ord)"
    " JOIN pg_catalog.pg_attribute a ON a.attrelid = %s::regclass AND a.attnum = k.attnum ORDER BY k.ord"
)
_ESTIMATE_SQL: Final = "SELECT reltuples FROM pg_catalog.pg_class WHERE oid = %s::regclass"


class Scope(msgspec.Struct, frozen=True):
    """A pass's work: `tables` as compared (a `RangeTask.table` indexes them), `ranges` table after table,
    each with its estimated rows, and the tables left out, each with why."""

    tables: tuple[CompareTable, ...]
    ranges: tuple[tuple[RangeTask, int], ...]
    skipped: tuple[str, ...]


def read_scope(
    conns: Sequence[psycopg.Connection[Any]], nodes: Sequence[NodeConfig], config: Config
) -> Scope:
    """Read on `conns` (one per node of `nodes`, in order; the first full node's is the reference)."""
    reference = next(i for i, n in enumerate(nodes) if not is_partial(n))
    conn = conns[reference]
    published = {f"{s}.{t}" for s, t in conn.execute(_PUBLISHED_SQL, [config.publication_name]).fetchall()}
    named = [".".join(split_table_name(n)) for n in (config.verify.tables if config.verify else [])]
    skipped = [f"{n} (named in [verify] tables, not in publication {config.publication_name})"
               for n in named if n not in published]
    labels = sorted(set(named) & published) if named else sorted(published)
    missing: dict[str, list[str]] = {}
    for i, node in enumerate(nodes):
        mine = [t for t in labels if not is_partial(node) or reaches(node, t)]
        quoted = {sql.Identifier(*split_table_name(t)).as_string(conn): t for t in mine}
        for (x,) in conns[i].execute(_MISSING_SQL, [list(quoted)]).fetchall():
            missing.setdefault(quoted[str(x)], []).append(node.name)
    skipped += [f"{t} (missing on {', '.join(on)})" for t, on in sorted(missing.items())]
    tables = []
    for label in labels:
        if label in missing:
            continue
        schema, name = split_table_name(label)
        rel = sql.Identifier(schema, name).as_string(conn)
        keys = conn.execute(_KEY_SQL, [rel, rel]).fetchall()
        first_type = str(keys[0][1]) if keys else ""
        tables.append(CompareTable(schema, name, tuple(str(k) for k, _ in keys), first_type))
    compared = compared_on(tables, nodes)
    cut: dict[str, list[tuple[RangeTask, int]]] = {}  # a table's, once for each of its comparisons
    ranges: list[tuple[RangeTask, int]] = []
    for i, table in enumerate(compared):
        if table.label not in cut:
            cut[table.label] = _ranges(conn, table)
        ranges += [(msgspec.structs.replace(r, table=i), rows) for r, rows in cut[table.label]]
    return Scope(tuple(compared), tuple(ranges), tuple(skipped))


def _estimate(conn: psycopg.Connection[Any], rel: sql.Identifier) -> int:
    """The table's rows as its statistics say; counted when it has none yet (never analyzed)."""
    row = conn.execute(_ESTIMATE_SQL, [rel.as_string(conn)]).fetchone()
    estimate = float(row[0]) if row and row[0] is not None else -1.0
    if estimate < 0:
        counted = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(rel)).fetchone()
        return int(counted[0]) if counted else 0
    return int(estimate)


def _ranges(conn: psycopg.Connection[Any], table: CompareTable) -> list[tuple[RangeTask, int]]:
    """The table's key ranges (as `pgmesh compare` cuts them), each with its share of the estimated rows."""
    rel = sql.Identifier(table.schema, table.name)
    estimate = _estimate(conn, rel)
    tasks = cut_ranges(conn, table, estimate)
    share = max(1, estimate // len(tasks))
    return [(task, share) for task in tasks]
