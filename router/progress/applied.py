"""The applied mark: a target's own word, committed with each applied transaction, on how far it applied a
source; and the SQL that reads a link's position from it and the origin.

On PostgreSQL 16+ a transaction that rolls back after `pg_replication_origin_xact_setup` still moves the
origin's progress to the LSN it was given (xact.c's RecordTransactionAbort advances a session origin, for
parallel apply's sake), and the set-up can never be the very last thing before the commit record: a backend
rolls back there when its client is gone (the router killed while a batch is in the server's hands: the
failed send of a result ends the session at the next interrupt check), on SIGTERM (a fast shutdown,
`pg_terminate_backend`), or on an error at COMMIT. The origin then names a transaction that was never
applied, and whoever reads it (the applier reconnecting, the router starting, the monitor confirming a
source's slot) skips that transaction for ever (invariant 1).

So on 16+ every set-up statement first sets `pgmesh.links.applied` of its source to the same LSN
(`mark_cte`, the session knowing its source by the `pgmesh.source` setting, `SOURCE_SETTING`): the row
changes only if the transaction commits. A link's position is the origin's progress, but never past the
mark (`position_sql`). PostgreSQL 15, where a rollback leaves the origin alone, keeps no mark (a mark left
there would go stale, and wrong after an upgrade to 16+): its origin's word holds. An empty mark (a new
installation, a node that just joined, one upgraded from 15 or from a pgmesh without the mark) is started
from the origin by the applier's first connection on 16+ (`MARK_START`), before it applies anything: what
the origin says then was written by commits (or by a rollback on 15, which leaves it alone).

Must not: connect, or decide what a position is used for.
"""

from __future__ import annotations

from typing import Final

from router.config.model import PGMESH_SCHEMA

__all__ = ["FLUSHED_SQL", "MARK_START", "SOURCE_SETTING", "mark_cte", "position_sql"]

SOURCE_SETTING: Final = "pgmesh.source"  # an applier session's source node (router.apply.sessions)
_LINKS: Final = f'"{PGMESH_SCHEMA}"."links"'


def mark_cte(lsn: str) -> str:
    """The start of a set-up statement that marks `lsn` (an SQL expression) applied: the statement goes on
    with `SELECT <set-up> FROM pgmesh_marked`, which runs the UPDATE before the set-up (an error in it
    then rolls back before the origin was given the LSN). An unset `pgmesh.source` is an error."""
    return (
        f"WITH pgmesh_mark AS (UPDATE {_LINKS} SET applied = {lsn}"
        f" WHERE source = pg_catalog.current_setting('{SOURCE_SETTING}') RETURNING 1),"
        " pgmesh_marked AS (SELECT pg_catalog.count(*) FROM pgmesh_mark) "
    )


def position_sql(origin: str, source: str, flush: bool) -> str:
    """A scalar SQL expression: the position of the source named by `source` (an SQL expression) on this
    node, from its origin named by `origin`: the origin's progress (flushed first with `flush`, as
    `pg_replication_origin_progress(origin, true)`), never past the applied mark. The mark is read in the
    statement's snapshot, before the progress call flushes: with `flush` the mark's commit is flushed too."""
    flag = "true" if flush else "false"
    return (
        f"(SELECT CASE WHEN m.applied IS NULL OR p.lsn IS NULL"
        " OR pg_catalog.current_setting('server_version_num')::int < 160000 THEN p.lsn"
        f" ELSE LEAST(p.lsn, m.applied) END"
        f" FROM (SELECT pg_catalog.pg_replication_origin_progress({origin}, {flag})) p(lsn)"
        f" LEFT JOIN {_LINKS} m ON m.source = {source})"
    )


# On a target: each origin whose name starts with the cluster's prefix (psycopg parameters: the prefix,
# twice), and its flushed position (`position_sql`): the monitor's and the tombstone pruner's reading.
FLUSHED_SQL: Final = (
    f"SELECT roname, {position_sql('roname', 'substr(roname, length(%s) + 1)', True)}::text"
    " FROM pg_catalog.pg_replication_origin WHERE starts_with(roname, %s)"
)

# On an applier's connection to a 16+ target (parameters: the source's origin name, the source): an empty
# mark starts from the origin's progress.
MARK_START: Final = (
    f"UPDATE {_LINKS} SET applied = coalesce(pg_catalog.pg_replication_origin_progress($1, false), '0/0')"
    " WHERE source = $2 AND applied IS NULL"
)
