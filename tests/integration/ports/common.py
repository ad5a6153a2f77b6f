"""Helpers shared by the ports of PostgreSQL's subscription tests (src/test/subscription/t/*.pl) to a
pgmesh mesh with the router running (issue 17).

Owns: waiting for rows to be equal on nodes, and checking that no link stopped on an error.
Must not: set up nodes or run a router (the `mesh` fixture and `running_router` do).
"""

from __future__ import annotations

from typing import Any

from router.testing.mesh import fetch, wait_for


async def same_rows(a: Any, b: Any, query: str, what: str) -> list[tuple[Any, ...]]:
    """Wait until `query` returns the same rows on both nodes; those rows."""
    async def check() -> bool:
        return await fetch(a.dsn(), query) == await fetch(b.dsn(), query)

    await wait_for(check, what, 60)
    return await fetch(a.dsn(), query)


async def has(dsn: str, query: str, expected: Any) -> bool:
    return await fetch(dsn, query) == expected


def healthy(router: Any) -> None:
    """Every link of `router` streams (none paused or held on an error) and every source is up."""
    ok, why = router.health()
    assert ok, why
    paused = [a.name for a in router.appliers.values() if a.state.value in ("paused", "error")]
    assert not paused, paused
