"""pglogical's huge_tx.sql and huge_tx_many_tables.sql, ported to a two-node pgmesh mesh (issue 17).

The originals replicate 20M rows in one transaction into one table, and 100k rows into each of 200
tables, each once with the tables created before the transaction and once inside it. Here the sizes are
scaled to what a 2-core CI runner takes while still crossing `replication.spill_mb` (8 MB by default):
the router then writes the transaction to its spool and hands it to the appliers at its first spill,
before its commit arrives (a plain transaction), or the server streams it in progress
(logical_decoding_work_mem = 64kB). Writes are added on the other node, during and after.

What failed before (issue 17): a transaction holding DDL (`CREATE TABLE` inside it) that crossed the
spill bound was handed out before its commit, then sent down the careful path, which needs the whole
transaction and found its spill file still being written: the link paused on "spill file ... is still
open". A large transaction now runs its DDL in place on the large path (router.apply.large), part by
part, whatever the DDL's position in it.

Found here and fixed: on PostgreSQL 15 the echo of a streamed transaction that opened with DDL (or with a
TRUNCATE) came back as the target's own (its first decoded change, an internal one, has no origin; the
applier now writes rows under the origin before each DDL command and each TRUNCATE:
router.apply.scripts.ORIGIN_MARK). A conflict over a TOASTed row whose winner left the TOASTed column
unchanged, once a strict xfail here, converges since the careful path reads such a value on the source
(router.apply.toast; `test_conflict_over_a_toasted_row`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from protocol.lsn import datetime_to_pg_us
from router.testing.mesh import NODE_SETTINGS, converged, execute, fetch, running_router, wait_for
from tests.fix_mesh import MeshFactory

ROWS = 200_000  # 100k stayed under the spill bound and worked; 200k crosses it
SPILL_BOUND = 8 << 20  # replication.spill_mb's default
STREAMED = {**NODE_SETTINGS, "logical_decoding_work_mem": "64kB"}  # the server streams in progress
PLAIN = {**NODE_SETTINGS, "logical_decoding_work_mem": "1GB"}  # decoded after the commit, whole


def huge_table(name: str) -> str:
    """The shape of pglogical's a_huge / b_huge / HUGE<i>."""
    return (f'CREATE TABLE "{name}" ("id" integer PRIMARY KEY, "id1" integer,'
            f" \"data\" text DEFAULT 'data', \"data1\" text DEFAULT 'data1')")


def fill(name: str, first: int, last: int) -> str:
    return f'INSERT INTO "{name}" VALUES (generate_series({first}, {last}), generate_series({first}, {last}))'


def no_link_error(router: Any) -> None:
    errors = {link: a.last_error for link, a in router.appliers.items() if a.last_error}
    assert not errors, errors


async def equal_everywhere(router: Any, nodes: Any, tables: list[str], limit: float = 240) -> None:
    """Wait until every node holds the same rows of `tables` (some may not exist yet on a node); a
    link that pauses on an error fails at once."""

    async def check() -> bool:
        no_link_error(router)
        try:
            return await converged(nodes, tables)
        except psycopg.errors.UndefinedTable:
            return False

    await wait_for(check, f"{', '.join(tables)} equal on every node", limit)


async def count(node: Any, table: str) -> int:
    (row,) = await fetch(node.dsn(), f'SELECT count(*) FROM "{table}"')
    return int(row[0])


async def gone(router: Any, nodes: Any, table: str) -> None:
    async def check() -> bool:
        no_link_error(router)
        for node in nodes:
            (row,) = await fetch(node.dsn(), "SELECT to_regclass(%s) IS NULL", (f'public."{table}"',))
            if not row[0]:
                return False
        return True

    await wait_for(check, f"{table} dropped on every node", 60)


async def streamed_from(mesh: MeshFactory, settings: dict[str, str]) -> Any:
    """A two-node mesh; with STREAMED, both servers stream their transactions in progress (B streams
    the transactions the router applies there too: their echoes must be recognised, see
    test_streamed_echo_of_a_transaction_that_opens_with_ddl)."""
    return await mesh(nodes=2, settings=settings)


async def spool_empty(router: Any) -> None:
    await wait_for(lambda: router.spool.files == 0, "the spool files to go", 60)


@pytest.mark.slow
async def test_huge_tx_ddl_outside(mesh: MeshFactory) -> None:
    """huge_tx, first half: the table made before the transaction; here B writes to it meanwhile (a huge
    transaction of its own, other keys) and afterwards (updates of A's rows, then deletes its own)."""
    m = await mesh(nodes=2, settings=PLAIN)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), huge_table("a_huge"))
        await equal_everywhere(router, m.nodes, ["a_huge"])
        await asyncio.gather(
            execute(a.dsn(), "BEGIN", fill("a_huge", 1, ROWS), "COMMIT"),
            execute(b.dsn(), "BEGIN", fill("a_huge", ROWS + 1, 2 * ROWS), "COMMIT"),
        )
        await equal_everywhere(router, m.nodes, ["a_huge"])
        assert await count(b, "a_huge") == 2 * ROWS
        assert router.pumps["a"].source.stats.spills > 0 and router.pumps["b"].source.stats.spills > 0
        assert router.pumps["a"].source.stats.spill_peak_bytes <= SPILL_BOUND + 64 * 1024
        await execute(b.dsn(), "UPDATE a_huge SET data = 'from b' WHERE id % 1000 = 0")
        await equal_everywhere(router, m.nodes, ["a_huge"])
        await execute(b.dsn(), f"DELETE FROM a_huge WHERE id > {ROWS}")  # its own rows, in one transaction
        await equal_everywhere(router, m.nodes, ["a_huge"])
        (row,) = await fetch(a.dsn(), "SELECT count(*), count(*) FILTER (WHERE data = 'from b') FROM a_huge")
        assert row == (ROWS, ROWS // 1000)
        await execute(b.dsn(), 'DROP TABLE "a_huge" CASCADE')
        await gone(router, m.nodes, "a_huge")
        await spool_empty(router)


@pytest.mark.parametrize("settings", [PLAIN, STREAMED], ids=["plain", "streamed"])
async def test_huge_tx_ddl_inside(mesh: MeshFactory, settings: dict[str, str]) -> None:
    """huge_tx, second half: CREATE TABLE and its 200k rows in one transaction (the link paused here,
    issue 17). Then B writes to the new table, and drops it."""
    m = await streamed_from(mesh, settings)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), "BEGIN", huge_table("b_huge"), fill("b_huge", 1, ROWS), "COMMIT")
        await equal_everywhere(router, m.nodes, ["b_huge"])
        assert await count(b, "b_huge") == ROWS
        assert router.pumps["a"].source.stats.spills > 0, (
            "nothing spilled: the test no longer crosses the bound")
        assert router.appliers[("a", "b")].stats.ddl_applied == 1
        await execute(b.dsn(), "UPDATE b_huge SET data1 = 'b' WHERE id <= 10",
                      f"INSERT INTO b_huge (id, id1) VALUES ({ROWS + 1}, 0)")
        await equal_everywhere(router, m.nodes, ["b_huge"])
        await execute(b.dsn(), 'DROP TABLE "b_huge" CASCADE')
        await gone(router, m.nodes, "b_huge")
        await spool_empty(router)


TABLES = 20  # pglogical: 200 tables of 100,000 rows; here 20 of 10,000 (200k rows, past the spill bound)
PER_TABLE = 10_000


def many(i: int) -> str:
    return f"huge{i}"


@pytest.mark.slow
async def test_huge_tx_many_tables_ddl_outside(mesh: MeshFactory) -> None:
    """huge_tx_many_tables, first half: the tables made (and replicated) first, then one transaction
    fills them all; B inserts into them meanwhile and updates them afterwards."""
    m = await mesh(nodes=2, settings=PLAIN)
    a, b = m.nodes
    names = [many(i) for i in range(1, TABLES + 1)]
    async with running_router(m.config) as router:
        await execute(a.dsn(), *(huge_table(n) for n in names))
        await equal_everywhere(router, m.nodes, names)
        await asyncio.gather(
            execute(a.dsn(), "BEGIN", *(fill(n, 1, PER_TABLE) for n in names), "COMMIT"),
            execute(b.dsn(), "BEGIN", *(fill(n, PER_TABLE + 1, PER_TABLE + 100) for n in names), "COMMIT"),
        )
        await equal_everywhere(router, m.nodes, names)
        assert await count(b, many(2)) == PER_TABLE + 100
        await execute(b.dsn(), *(f'UPDATE "{n}" SET data = \'b\' WHERE id % 100 = 0' for n in names))
        await equal_everywhere(router, m.nodes, names)
        await execute(a.dsn(), *(f'DROP TABLE "{n}" CASCADE' for n in names))
        for n in names:
            await gone(router, m.nodes, n)
        await spool_empty(router)


@pytest.mark.slow
@pytest.mark.parametrize("settings", [PLAIN, STREAMED], ids=["plain", "streamed"])
async def test_huge_tx_many_tables_ddl_inside(mesh: MeshFactory, settings: dict[str, str]) -> None:
    """huge_tx_many_tables, second half, and its interleaved variant: in one transaction, every table
    created and then filled (DDL before the first spill), then each created right before its rows (DDL
    after the first spill, while the transaction is already being applied), an ALTER TABLE and an
    UPDATE of rows inserted earlier in it. B writes to the new tables afterwards."""
    m = await streamed_from(mesh, settings)
    a, b = m.nodes
    first = [many(i) for i in range(1, TABLES + 1)]
    second = [f"late{i}" for i in range(1, TABLES + 1)]
    async with running_router(m.config) as router:
        await execute(a.dsn(), "BEGIN", *(huge_table(n) for n in first),
                      *(fill(n, 1, PER_TABLE) for n in first), "COMMIT")
        await equal_everywhere(router, m.nodes, first)
        interleaved = [s for n in second for s in (huge_table(n), fill(n, 1, PER_TABLE))]
        await execute(a.dsn(), "BEGIN", *interleaved,
                      f'ALTER TABLE "{first[0]}" ADD COLUMN "extra" integer DEFAULT 7',
                      f'UPDATE "{first[0]}" SET "extra" = "id" WHERE "id" <= 1000',
                      f'ALTER TABLE "{second[0]}" ADD COLUMN "extra" integer DEFAULT 7',
                      f'UPDATE "{second[0]}" SET "extra" = "id" WHERE "id" % 2 = 0',
                      "COMMIT")
        await equal_everywhere(router, m.nodes, [*first, *second])
        (row,) = await fetch(b.dsn(), f'SELECT count(*), sum("extra") FROM "{second[0]}"')
        assert row == (PER_TABLE, PER_TABLE // 2 * 7 + sum(range(2, PER_TABLE + 1, 2)))
        assert await count(b, second[-1]) == PER_TABLE
        await execute(b.dsn(), *(f'INSERT INTO "{n}" (id, id1) VALUES (0, 0)' for n in [*first, *second]))
        await equal_everywhere(router, m.nodes, [*first, *second])
        await spool_empty(router)


@pytest.mark.slow
async def test_one_million_narrow_rows(mesh: MeshFactory) -> None:
    """1M narrow rows in one transaction: spilled within the bound, applied, the spool emptied; B then
    changes some of them."""
    m = await mesh(nodes=2, schema='CREATE TABLE "narrow" ("id" integer PRIMARY KEY);', settings=PLAIN)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), 'INSERT INTO "narrow" SELECT generate_series(1, 1000000)')
        await equal_everywhere(router, m.nodes, ["narrow"], limit=480)
        assert await count(b, "narrow") == 1_000_000
        assert router.pumps["a"].source.stats.spill_peak_bytes <= SPILL_BOUND + 64 * 1024
        # (rows A wrote, changed on B: each is an origin_differs conflict, decided row by row)
        await execute(b.dsn(), 'DELETE FROM "narrow" WHERE "id" % 100000 = 0',
                      'UPDATE "narrow" SET "id" = -"id" WHERE "id" % 100000 = 1')
        await equal_everywhere(router, m.nodes, ["narrow"], limit=480)
        await spool_empty(router)


@pytest.mark.slow
@pytest.mark.parametrize("settings", [PLAIN, STREAMED], ids=["plain", "streamed"])
async def test_few_big_toasted_rows(mesh: MeshFactory, settings: dict[str, str]) -> None:
    """A few rows of several MB each (TOASTed, hardly compressible) in one transaction, past the spill
    bound; then a transaction that updates them without touching the TOASTed column (pgoutput sends it
    as unchanged) and adds more; B updates some of them afterwards, the TOASTed column too."""
    m = await streamed_from(mesh, settings)
    await execute(m.dsns[0], 'CREATE TABLE "toasty" ("id" integer PRIMARY KEY, "n" integer, "body" text)')
    a, b = m.nodes
    big = "(SELECT string_agg(md5(random()::text || g), '') FROM generate_series(1, 60000) AS g)"  # ~1.9 MB
    async with running_router(m.config) as router:
        await execute(a.dsn(), f'INSERT INTO "toasty" SELECT i, 0, {big} FROM generate_series(1, 6) AS i')
        await equal_everywhere(router, m.nodes, ["toasty"])
        assert router.pumps["a"].source.stats.spills > 0, "nothing spilled"
        await execute(a.dsn(), "BEGIN", 'UPDATE "toasty" SET "n" = "n" + 1',
                      f'INSERT INTO "toasty" SELECT i, 0, {big} FROM generate_series(7, 10) AS i', "COMMIT")
        await equal_everywhere(router, m.nodes, ["toasty"])
        await execute(b.dsn(), 'UPDATE "toasty" SET "body" = "body" || \'b\' WHERE "id" = 1',
                      'UPDATE "toasty" SET "n" = 100 WHERE "id" >= 9')
        await equal_everywhere(router, m.nodes, ["toasty"])
        (row,) = await fetch(b.dsn(), 'SELECT count(*), max(length("body")), sum("n") FROM "toasty"')
        assert row == (10, 60000 * 32 + 1, 6 + 200)
        await spool_empty(router)


WIDE = "(SELECT string_agg(md5(g::text || i), '') FROM generate_series(1, 100) AS g)"  # 3.2 kB, TOASTed


async def has_echoes(node: Any) -> bool:
    """Whether what the router applies on `node` comes back in its stream as echoes: PostgreSQL 15.
    On 16+ the router asks for `origin 'none'`: nothing of it is decoded, the applier's pgmesh.applied
    note stands for it (router.stream.seen)."""
    ((version,),) = await fetch(node.dsn(), "SELECT current_setting('server_version_num')::int")
    return bool(version < 160000)


async def seen_on_b(router: Any, a: Any, tables: list[str]) -> None:
    """16+: wait until B's seen vector holds A's newest commit of rows in `tables` (the applier's
    note of it came back in B's stream), and no echo came (none is decoded)."""
    union = " UNION ALL ".join(f'SELECT pg_xact_commit_timestamp(xmin) AS t FROM "{t}"' for t in tables)
    ((when,),) = await fetch(a.dsn(), f"SELECT max(t) FROM ({union}) AS c")
    pump = router.pumps["b"]
    await wait_for(lambda: dict(pump.seen.snapshot).get("a", 0) >= datetime_to_pg_us(when),
                   "B's seen vector to hold A's transaction", 60)
    assert pump.stats.echoes == 0, pump.stats.echoes


async def b_streamed(b: Any, echoes: bool) -> None:
    """15: B streamed the router's transaction in progress (else the test no longer tests what it
    names). 16+: B decoded nothing of it (origin 'none'), so streamed nothing."""
    (streamed,) = await fetch(b.dsn(), "SELECT coalesce(sum(stream_txns), 0) FROM pg_stat_replication_slots")
    if echoes:
        assert streamed[0] >= 1, "B did not stream the transaction: the test no longer tests what it names"
    else:
        assert streamed[0] == 0, "B streamed what it should not have decoded (origin 'none')"


@pytest.mark.parametrize("path", ["large", "careful", "truncate"])
async def test_streamed_echo_of_a_transaction_that_opens_with_ddl(mesh: MeshFactory, path: str) -> None:
    """Both servers stream in progress: A's CREATE TABLE and rows, applied on B by the router, must come
    back from B as an echo (invariant 3), not as B's own transaction. PostgreSQL 15 announces a streamed
    transaction with the origin of its first decoded change, and the first one of a DDL command has none:
    B streamed the router's transaction without an Origin. Through the large path (20k rows, COPY), the
    careful one (40 wide rows, few enough for it: router.apply.parts.is_large), each more than B's
    logical_decoding_work_mem so that B streams it, and a TRUNCATE in place of the DDL (the same: its
    first change is that of its catalog writes), then 20k rows. On 16+ (origin 'none') B decodes none of
    it: no echo, nothing streamed, and the applier's pgmesh.applied note reaches B's seen vector."""
    m = await mesh(nodes=2, settings=STREAMED)
    a, b = m.nodes
    rows = (f'INSERT INTO "s_huge" SELECT i, i, {WIDE} FROM generate_series(1, 40) AS i' if path == "careful"
            else fill("s_huge", 1, 20_000))
    async with running_router(m.config) as router:
        pump = router.pumps["b"]
        echoes = await has_echoes(b)
        if path == "truncate":
            await execute(a.dsn(), huge_table("s_huge"), fill("s_huge", 1, 10))
            await equal_everywhere(router, m.nodes, ["s_huge"])
            if echoes:
                # (the DDL's was empty)
                await wait_for(lambda: pump.stats.echoes >= 1, "B's echo of A's rows", 60)
            else:
                await seen_on_b(router, a, ["s_huge"])
            await execute(a.dsn(), "BEGIN", 'TRUNCATE "s_huge"', rows, "COMMIT")
        else:
            await execute(a.dsn(), "BEGIN", huge_table("s_huge"), rows, "COMMIT")
        await equal_everywhere(router, m.nodes, ["s_huge"])
        if echoes:
            expected = 2 if path == "truncate" else 1
            await wait_for(lambda: pump.stats.echoes + pump.stats.transactions >= expected,
                           "B's echo of A's transaction", 60)
        else:
            await seen_on_b(router, a, ["s_huge"])
        assert pump.stats.transactions == 0, "B's echo of A's transaction was taken for B's own"
        link = router.appliers[("a", "b")]
        assert link.stats.ddl_applied == 1
        assert (link.stats.copied_transactions > 0) == (path != "careful"), "not the path meant"
        await b_streamed(b, echoes)


async def test_streamed_echo_of_a_truncate_applied_the_careful_way(mesh: MeshFactory) -> None:
    """The TRUNCATE variant above, with a conflict in the same transaction (a row of another table B
    changed while the links were held): the whole transaction is applied on the careful path, which
    writes the origin mark before its TRUNCATE too; B streams it and its echo is recognised (15; on 16+
    B decodes none of it and the careful path's note reaches B's seen vector)."""
    m = await mesh(nodes=2, settings=STREAMED)
    a, b = m.nodes
    rows = f'INSERT INTO "s_huge" SELECT i, i, {WIDE} FROM generate_series(1, 40) AS i'
    async with running_router(m.config) as router:
        pump = router.pumps["b"]
        echoes = await has_echoes(b)
        await execute(a.dsn(), huge_table("s_huge"), fill("s_huge", 1, 10),
                      'CREATE TABLE "u" ("id" integer PRIMARY KEY, "v" text)',
                      "INSERT INTO \"u\" VALUES (1, 'a')")
        await equal_everywhere(router, m.nodes, ["s_huge", "u"])
        if echoes:
            await wait_for(lambda: pump.stats.echoes >= 2, "B's echoes of A's rows", 60)
        else:
            await seen_on_b(router, a, ["s_huge", "u"])
        before = pump.stats.echoes
        await router.pause(None)
        await execute(b.dsn(), "UPDATE \"u\" SET \"v\" = 'b' WHERE \"id\" = 1")
        await execute(a.dsn(), "BEGIN", 'TRUNCATE "s_huge"', rows,
                      "UPDATE \"u\" SET \"v\" = 'a, later' WHERE \"id\" = 1", "COMMIT")
        await router.resume(None)
        await equal_everywhere(router, m.nodes, ["s_huge", "u"])
        if echoes:
            await wait_for(lambda: pump.stats.echoes > before, "B's echo of A's transaction", 60)
        else:
            await seen_on_b(router, a, ["s_huge", "u"])
        assert pump.stats.transactions == 1, "B's echo of A's transaction was taken for B's own"  # B's update
        await b_streamed(b, echoes)
        assert await fetch(b.dsn(), 'SELECT v FROM "u"') == [("a, later",)]


async def test_conflict_over_a_toasted_row(mesh: MeshFactory) -> None:
    """Found with the TOASTed rows above: B changes the TOASTed column of a row, then A (later) changes
    another column of it (pgoutput sends the TOASTed one as unchanged), both before either is applied.
    A's update wins on both nodes; A keeps its whole row, while B takes A's `n` and keeps its own body."""
    schema = 'CREATE TABLE "toasty" ("id" integer PRIMARY KEY, "n" integer, "body" text);'
    m = await mesh(nodes=2, schema=schema)
    a, b = m.nodes
    big = "(SELECT string_agg(md5(g::text), '') FROM generate_series(1, 1000) AS g)"  # 32 kB, TOASTed
    async with running_router(m.config) as router:
        await execute(a.dsn(), f'INSERT INTO "toasty" VALUES (1, 0, {big})')
        await equal_everywhere(router, m.nodes, ["toasty"])
    await execute(b.dsn(), 'UPDATE "toasty" SET "body" = "body" || \'b\'')
    await execute(a.dsn(), 'UPDATE "toasty" SET "n" = 1')
    async with running_router(m.config) as router:
        links = router.appliers.values()
        await wait_for(lambda: all(link.stats.conflicts >= 1 for link in links), "each link to decide it", 60)
        assert await converged(m.nodes, ["toasty"])
