"""pglogical's copy.sql, ported to a two-node pgmesh mesh with the router running (issue 17).

COPY into a table with a serial key and a default, with NULLs, a backslash-N that is data, and rows that
take their key from the sequence. Added for a mesh: COPY on b too. Each node's sequence counts on its own
(docs/sequences.md), so after a's COPYs the key is converted with `pgmesh sequences convert --mode step`,
pgmesh's answer to pglogical's sequence replication: then b's COPY without keys takes ids that no node has.
"""

from __future__ import annotations

import psycopg

from router.sequences.convert import convert_sequences
from router.testing.mesh import execute, fetch, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import has, healthy

X = """CREATE TABLE public.x (
    a serial primary key,
    b int,
    c text not null default 'stuff',
    d text,
    e text
)"""

ROWS = "SELECT a, b, c, d, e FROM x ORDER BY a"
EXPECTED = [
    *((i, i, "stuff", f"test_{i}", None) for i in range(1, 16)),
    (9999, None, "\\N", "NN", None),
    *((10000 + i, 21 + i, str(31 + i), str(41 + i), str(51 + i)) for i in range(6)),
]


async def copy_in(dsn: str, statement: str, data: str) -> None:
    """Run a COPY ... FROM STDIN of `data`, as psql does."""
    async with (
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn,
        conn.cursor().copy(statement) as copy,
    ):
        await copy.write(data)


async def test_copy(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), X)
        made = "SELECT to_regclass('public.x') IS NOT NULL"
        await wait_for(lambda: has(b.dsn(), made, [(True,)]), "x on b")

        # NULL, a backslash-N that is data, and "\NN" (N, escaped, then N)
        await copy_in(a.dsn(), "COPY x (a, b, c, d, e) FROM stdin",
                      "9999\t\\N\t\\\\N\t\\NN\t\\N\n10000\t21\t31\t41\t51\n")
        await copy_in(a.dsn(), "COPY x (b, d) FROM stdin", "1\ttest_1\n")
        await copy_in(a.dsn(), "COPY x (b, d) FROM stdin", "".join(f"{i}\ttest_{i}\n" for i in range(2, 16)))
        await copy_in(a.dsn(), "COPY x (a, b, c, d, e) FROM stdin",
                      "".join(f"{10001 + i}\t{22 + i}\t{32 + i}\t{42 + i}\t{52 + i}\n" for i in range(5)))
        assert await fetch(a.dsn(), ROWS) == EXPECTED
        await wait_converged(m.nodes, ["x"])
        assert await fetch(b.dsn(), ROWS) == EXPECTED

        # b's own COPY, with keys from its sequence once converted (b's would start at 1 otherwise)
        lines = await convert_sequences(m.config, "step", ["x"])
        assert len(lines) == 2, lines
        assert all("public.x.a: local (unconverted) -> step 100" in line for line in lines), lines
        await copy_in(b.dsn(), "COPY x (b, d) FROM stdin", "".join(f"{i}\tfrom b {i}\n" for i in range(3)))
        await copy_in(a.dsn(), "COPY x (b, d) FROM stdin", "".join(f"{i}\tfrom a {i}\n" for i in range(3)))
        await wait_converged(m.nodes, ["x"])
        rows = await fetch(b.dsn(), ROWS)
        assert rows[: len(EXPECTED)] == EXPECTED
        new = rows[len(EXPECTED):]
        assert sorted(r[3] for r in new) == [f"from {n} {i}" for n in "ab" for i in range(3)], new
        assert all(r[0] > 10005 for r in new), new

        await execute(a.dsn(), "DROP TABLE public.x CASCADE")
        await wait_for(lambda: has(b.dsn(), "SELECT to_regclass('public.x') IS NULL", [(True,)]), "x dropped")
        healthy(router)
