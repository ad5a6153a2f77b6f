"""Quick convergence checks: a fingerprint (row count and md5 of the sorted rows) per table per node.

Good for the demo, tests and small tables; it reads each whole table through one connection. Large
tables are compared by the PySpark job (`router/cluster/copy/`), not here. Never writes anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import psycopg
from psycopg import sql

__all__ = ["Fingerprint", "fingerprints", "same_everywhere"]

Fingerprint = tuple[int, str]


async def fingerprints(dsn: str, tables: Sequence[str]) -> dict[str, Fingerprint]:
    """`tables` are `schema.table` or bare names (search_path). Rows are read as `(t.*)::text`: a bare `t`
    would mean a user column named t, not the row."""
    out: dict[str, Fingerprint] = {}
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for table in tables:
            name = sql.Identifier(*table.split(".", 1))
            query = sql.SQL(
                "SELECT count(*), md5(coalesce(string_agg((t.*)::text, '|' ORDER BY (t.*)::text), ''))"
                " FROM {} t"
            ).format(name)
            cur = await conn.execute(query)
            row = await cur.fetchone()
            assert row is not None
            out[table] = (int(row[0]), str(row[1]))
    return out


async def same_everywhere(dsns: Sequence[str], tables: Sequence[str]) -> bool:
    prints = [await fingerprints(dsn, tables) for dsn in dsns]
    return all(p == prints[0] for p in prints[1:])
