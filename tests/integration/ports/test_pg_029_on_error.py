"""PostgreSQL's 029_on_error.pl ported to a two-node pgmesh mesh with the router running (issue 17).

The original makes the apply fail (a unique violation on the subscriber), lets `disable_on_error` stop the
subscription, then skips the failed transaction (ALTER SUBSCRIPTION ... SKIP). pgmesh's equivalent: a
change the target refuses pauses only that link, with an error naming the node, the table and the
position; nothing is skipped, ever: the operator fixes the cause and runs `pgmesh resume`, and the same
transaction is applied. A unique key met by a replicated insert is a conflict pgmesh resolves, so the
failure here is a CHECK constraint that only b has (added with `pgmesh.ddl_local`), for a plain, a
prepared and a streamed (over logical_decoding_work_mem = 64kB) transaction.
"""

from __future__ import annotations

import pytest

from router.testing.mesh import NODE_SETTINGS, execute, fetch, running_router, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SETTINGS = {**NODE_SETTINGS, "max_prepared_transactions": "10", "logical_decoding_work_mem": "64kB"}
SCHEMA = "CREATE TABLE tbl (i INT PRIMARY KEY, t TEXT); INSERT INTO tbl VALUES (1, NULL);"
REFUSE = "SET pgmesh.ddl_local = on; ALTER TABLE tbl ADD CONSTRAINT only_on_b CHECK (t <> 'bad')"
ALLOW = "SET pgmesh.ddl_local = on; ALTER TABLE tbl DROP CONSTRAINT only_on_b"
CASES = {
    "plain": ["BEGIN", "INSERT INTO tbl VALUES (2, 'bad')", "COMMIT"],
    "prepared": ["BEGIN", "INSERT INTO tbl VALUES (2, 'bad')", "PREPARE TRANSACTION 'gtx'",
                 "COMMIT PREPARED 'gtx'"],
    "streamed": ["BEGIN", "INSERT INTO tbl SELECT i, 'bad' FROM generate_series(2, 10001) s(i)", "COMMIT"],
}


@pytest.mark.parametrize("case", list(CASES))
async def test_029_on_error(mesh: MeshFactory, case: str) -> None:
    m = await mesh(nodes=2, schema=SCHEMA, settings=SETTINGS)
    a, b = m.nodes
    async with running_router(m.config) as router:
        link = router.appliers[("a", "b")]
        await execute(b.dsn(), REFUSE)
        await execute(a.dsn(), *CASES[case])
        await wait_for(lambda: link.state.value == "error", "a's link to b to pause on the error")
        error = link.last_error or ""
        assert "node b" in error and "public.tbl" in error and "only_on_b" in error, error
        assert "23514" in error, error  # the SQL state of a check violation
        # the other link goes on, and so do a's later transactions once b is fixed
        await execute(b.dsn(), "INSERT INTO tbl VALUES (0, 'from b')")
        await rows_everywhere([a], "SELECT t FROM tbl WHERE i = 0", [("from b",)])
        await execute(a.dsn(), "INSERT INTO tbl VALUES (-1, 'after')")
        assert await fetch(b.dsn(), "SELECT count(*) FROM tbl WHERE i = -1") == [(0,)]
        await execute(b.dsn(), ALLOW)
        await router.resume("b")
        await converge(router, m.nodes, ["tbl"])
        expected = 10003 if case == "streamed" else 4
        assert await fetch(b.dsn(), "SELECT count(*) FROM tbl") == [(expected,)]
        assert await fetch(b.dsn(), "SELECT count(*) FROM pg_prepared_xacts") == [(0,)]
        healthy(router)
