"""The verification's own sessions: one reading session per node (REPEATABLE READ READ ONLY, with the
compare sessions' settings, router.cluster.compare.worker `SESSION_SQL`, so every node prints a row alike)
and one autocommit session per node for its barrier position. Never an applier's session.

A range is read as `pgmesh compare` reads it (worker `compare_range`: the range's count and hash on every
node at once; where they differ, buckets, then rows), each node under the snapshot `pin` took (held for
several ranges; `end` lets it go). `positions` is each node's barrier position (router.progress.positions
`BARRIER_POSITION_SQL`), read after the reads it stands for: past everything they saw. `recheck` reads
some keys again, each node in a transaction of its own.

Blocking (psycopg's sync API, a thread per node): the verifier runs these methods off the event loop.
Must not: write anything but the barrier's logical message, or put a DSN in a message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar

import psycopg

from router.cluster.compare.multiset import counts_sql
from router.cluster.compare.plan import RangeTask
from router.cluster.compare.worker import (
    SESSION_SQL,
    CompareJob,
    Difference,
    compare_range,
    keyless_where,
    row_hashes_sql,
)
from router.config.model import NodeConfig
from router.errors import PgmeshError, describe
from router.progress.positions import BARRIER_POSITION_SQL

__all__ = ["APPLICATION_NAME", "NodeSessions"]

APPLICATION_NAME: Final = "pgmesh verify"
T = TypeVar("T")


class NodeSessions:
    """A reading and a marking session on every node of `nodes` (in order: a `CompareJob`'s node indexes)."""

    def __init__(self, nodes: Sequence[NodeConfig], timeout_s: float = 10.0) -> None:
        self.nodes = list(nodes)
        self.timeout_s = timeout_s
        self.reads: list[psycopg.Connection[Any]] = []
        self.marks: list[psycopg.Connection[Any]] = []
        self.pool = ThreadPoolExecutor(max(1, len(self.nodes)), thread_name_prefix="pgmesh-verify")

    def open(self) -> None:
        try:
            for node in self.nodes:
                self.reads.append(self._connect(node, autocommit=False))
                self.marks.append(self._connect(node, autocommit=True))
        except BaseException:
            self.close()
            raise

    def _connect(self, node: NodeConfig, *, autocommit: bool) -> psycopg.Connection[Any]:
        try:
            conn = psycopg.connect(node.dsn, autocommit=autocommit, application_name=APPLICATION_NAME,
                                   connect_timeout=max(1, round(self.timeout_s)))
        except psycopg.Error as exc:
            raise PgmeshError(f"verification cannot connect: {describe(exc)}", node=node.name) from None
        if not autocommit:
            try:
                conn.execute(SESSION_SQL)
                conn.commit()  # (the settings last the session: set_config(..., false), committed)
                conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                conn.read_only = True
            except psycopg.Error as exc:
                conn.close()
                raise PgmeshError(f"verification's session set-up failed: {describe(exc)}",
                                  node=node.name) from None
        return conn

    def close(self) -> None:
        for conn in [*self.reads, *self.marks]:
            conn.close()
        self.reads, self.marks = [], []
        self.pool.shutdown(wait=False)

    def end(self) -> None:
        """Let every reading session's snapshot go."""
        for conn in self.reads:
            conn.rollback()

    def _each(self, indexes: Sequence[int], work: Callable[[int], T]) -> list[T]:
        return list(self.pool.map(work, indexes))

    def pin(self, indexes: Sequence[int]) -> None:
        """Take a snapshot on those nodes' reading sessions now (each holds it until `end`)."""

        def take(i: int) -> None:
            try:
                self.reads[i].execute("SELECT 1")
            except psycopg.Error as exc:
                raise PgmeshError(f"verification cannot begin reading: {describe(exc)}",
                                  node=self.nodes[i].name) from None

        self._each(indexes, take)

    def read_range(self, job: CompareJob, task: RangeTask) -> list[Difference]:
        """The keys of `task` whose rows differ across its table's nodes, each node under its snapshot."""
        try:
            return compare_range(self.pool, self.reads, job, task)
        except BaseException:
            self.end()
            raise

    def positions(self, indexes: Sequence[int] | None = None) -> dict[str, int]:
        """Each node's (or those nodes') barrier position now (a logical message's: every commit before it
        comes before it)."""

        def mark(i: int) -> int:
            try:
                row = self.marks[i].execute(BARRIER_POSITION_SQL).fetchone()
            except psycopg.Error as exc:
                raise PgmeshError(f"verification cannot read the barrier position: {describe(exc)}",
                                  node=self.nodes[i].name) from None
            assert row is not None
            return int(row[0])

        which = range(len(self.nodes)) if indexes is None else indexes
        return dict(zip((self.nodes[i].name for i in which), self._each(which, mark), strict=True))

    def recheck(
        self, job: CompareJob, keys: Sequence[Difference]
    ) -> dict[tuple[int, str], tuple[int | None, ...]]:
        """Each key's value on its table's nodes now (a row's hash; a keyless row's copies): as `keys`'s
        `hashes` are."""
        by_table: dict[int, list[Difference]] = {}
        for d in keys:
            by_table.setdefault(d.table, []).append(d)

        def read(i: int) -> dict[tuple[int, str], int]:
            found: dict[tuple[int, str], int] = {}
            conn = self.reads[i]
            try:
                for index, items in by_table.items():
                    table = job.tables[index]
                    if i not in job.nodes_of(table):
                        continue
                    if table.keyless:
                        query = counts_sql(table.schema, table.name, table.columns,
                                           keyless_where(table, table.filtered(i)))
                        rows = conn.execute(query, [[d.key for d in items]]).fetchall()
                    else:
                        keys_json = json.dumps([json.loads(d.key_json) for d in items])
                        rows = conn.execute(row_hashes_sql(table, table.filtered(i)), [keys_json]).fetchall()
                    found.update({(index, str(key)): int(h) for key, h in rows})
            except psycopg.Error as exc:
                raise PgmeshError(f"verification cannot read the keys that differed: {describe(exc)}",
                                  node=self.nodes[i].name) from None
            finally:
                conn.rollback()
            return found

        per_node = self._each(range(len(self.nodes)), read)
        out = {}
        for d in keys:
            ident = (d.table, d.key)
            out[ident] = tuple(per_node[i].get(ident) for i in job.nodes_of(job.tables[d.table]))
        return out
