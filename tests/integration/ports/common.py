"""Helpers shared by the ports of PostgreSQL's subscription tests (src/test/subscription/t/*.pl) to a
pgmesh mesh with the router running (issue 17).

Owns: waiting for rows to be equal on nodes or to reach an expected value, and checking that no link
stopped on an error.
Must not: set up nodes or run a router (the `mesh` fixture and `running_router` do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from router.testing.mesh import fetch, wait_for


async def same_rows(a: Any, b: Any, query: str, what: str) -> list[tuple[Any, ...]]:
    """Wait until `query` returns the same rows on both nodes; those rows. A table or column the query
    names that a node does not have yet (its DDL is on its way) is waited for."""
    async def check() -> bool:
        try:
            return await fetch(a.dsn(), query) == await fetch(b.dsn(), query)
        except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn):
            return False

    await wait_for(check, what, 60)
    return await fetch(a.dsn(), query)


async def has(dsn: str, query: str, expected: Any) -> bool:
    return await fetch(dsn, query) == expected


async def rows_everywhere(nodes: Sequence[Any], query: str, expected: Any, limit: float = 60) -> None:
    """Wait until `query` returns `expected` on every node (a clear message names the node that lags);
    a table or column the query names that a node does not have yet (its DDL is on its way) is waited for."""
    for node in nodes:
        async def check(node: Any = node) -> bool:
            try:
                return await fetch(node.dsn(), query) == expected
            except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn):
                return False

        try:
            await wait_for(check, f"{query!r} = {expected!r} on node {node.name}", limit)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; it returns {await fetch(node.dsn(), query)!r}") from None


def healthy(router: Any) -> None:
    """Every link of `router` streams (none paused or held on an error) and every source is up."""
    ok, why = router.health()
    assert ok, why
    paused = [a.name for a in router.appliers.values() if a.state.value in ("paused", "error")]
    assert not paused, paused
    errors = {a.name: a.last_error for a in router.appliers.values() if a.last_error}
    assert not errors, errors


async def conflicts(nodes: Sequence[Any], table: str) -> list[str]:
    """The conflict types recorded for `table` on all nodes, sorted."""
    found: list[str] = []
    for node in nodes:
        query = "SELECT conflict_type FROM pgmesh.conflict_history WHERE table_name = %s"
        rows = await fetch(node.dsn(), query, [table])
        found += [r[0] for r in rows]
    return sorted(found)


async def converge(router: Any, nodes: Sequence[Any], tables: Sequence[str], limit: float = 60) -> None:
    """Wait until every table holds the same rows on every node; on timeout say which tables differ
    (their row counts per node) and the state of every link."""
    from router.testing.mesh import converged, fingerprint

    try:
        await wait_for(lambda: converged(nodes, tables), f"{', '.join(tables)} equal on every node", limit)
    except AssertionError as exc:
        prints = {node.name: await fingerprint(node.dsn(), tables) for node in nodes}
        differ = {t: {n: p.get(t) for n, p in prints.items()} for t in tables
                  if len({str(p.get(t)) for p in prints.values()}) > 1}
        links = {a.name: (a.state.value, a.last_error) for a in router.appliers.values()}
        raise AssertionError(f"{exc}; differing: {differ}; links: {links}") from None
