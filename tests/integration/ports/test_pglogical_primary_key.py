"""pglogical's primary_key.sql, ported to a two-node pgmesh mesh with the router running (issue 17).

pglogical replaces a table's primary key while replicating (through replicate_ddl_command), drops it,
makes it deferrable, and shows what it then loses: an UPDATE without a replica identity never reaches
the subscriber, and a duplicate made on the subscriber stops its apply. In a pgmesh mesh every key change
is DDL replicated to every node at its place in the source's commit order:

- a key replaced by another (DROP CONSTRAINT, ADD ... PRIMARY KEY USING INDEX) re-keys the conflict
  tombstones on every node; later changes are matched by the new key;
- a table left without a usable key (its key dropped, or made DEFERRABLE, which cannot identify rows) is
  made REPLICA IDENTITY FULL on every node by the capture trigger, so its updates and deletes still
  replicate (matched by all columns); a non-deferrable key added again makes it DEFAULT again, and
  conflicts are decided by that key;
- a key that the rows violate (a duplicate written on the other node) fails where the DDL is issued,
  before anything is replicated: no link stops.

Writes run on both nodes, and both nodes end equal.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from router.ops.ddl import cmd_ddl
from router.testing.mesh import execute, fetch, free_port, running_router, wait_converged, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import has, healthy, same_rows

PK_USERS = """CREATE TABLE public.pk_users (
    id integer PRIMARY KEY,
    another_id integer unique not null,
    a_id integer,
    name text,
    address text
)"""
ROWS = "SELECT * FROM pk_users ORDER BY id, another_id"
# the primary key's columns, the replica identity and the tombstone trigger's key, as one row
SHAPE = """
SELECT (SELECT string_agg(a.attname, ',' ORDER BY k.o) FROM pg_index i
          CROSS JOIN unnest(i.indkey::int2[]) WITH ORDINALITY AS k(n, o)
          JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.n
         WHERE i.indrelid = to_regclass('public.pk_users') AND i.indisprimary),
       (SELECT relreplident::text FROM pg_class WHERE oid = to_regclass('public.pk_users')),
       (SELECT replace(encode(tgargs, 'escape'), '\\000', ',') FROM pg_trigger
         WHERE tgrelid = to_regclass('public.pk_users') AND tgname = 'pgmesh_tombstone')
"""


async def shape_everywhere(nodes: list[Any], router: Any, expected: tuple[Any, ...]) -> None:
    async def check() -> bool:
        errors = {name: a.last_error for name, a in router.appliers.items() if a.last_error}
        assert not errors, errors
        return all([await fetch(n.dsn(), SHAPE) == [expected] for n in nodes])

    await wait_for(check, f"pk_users keyed {expected} on every node")


async def test_primary_key(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, admin_port=free_port())  # (the barrier of `ddl --wait` asks the router)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), PK_USERS)
        await shape_everywhere(m.nodes, router, ("id", "d", "id,"))
        await execute(a.dsn(), "INSERT INTO pk_users VALUES(1,11,1,'User1', 'Address1')",
                      "INSERT INTO pk_users VALUES(2,12,1,'User2', 'Address2')",
                      "INSERT INTO pk_users VALUES(3,13,2,'User3', 'Address3')")
        await execute(b.dsn(), "INSERT INTO pk_users VALUES(4,14,2,'User4', 'Address4')")
        await execute(a.dsn(), "UPDATE pk_users SET address='UpdatedAddress1' WHERE id=1")
        rows = await same_rows(a, b, ROWS, "the inserts and the update")
        assert [r[4] for r in rows] == ["UpdatedAddress1", "Address2", "Address3", "Address4"], rows

        # the key replaced by another, in one transaction (pglogical's replicate_ddl_command)
        await execute(a.dsn(), "BEGIN",
                      "CREATE UNIQUE INDEX another_id_temp_idx ON public.pk_users (another_id)",
                      "ALTER TABLE public.pk_users DROP CONSTRAINT pk_users_pkey,"
                      " ADD CONSTRAINT pk_users_pkey PRIMARY KEY USING INDEX another_id_temp_idx",
                      "ALTER TABLE public.pk_users DROP CONSTRAINT pk_users_another_id_key", "COMMIT")
        await shape_everywhere(m.nodes, router, ("another_id", "d", "another_id,"))
        await execute(a.dsn(), "UPDATE pk_users SET address='UpdatedAddress2' WHERE id=2")
        await execute(b.dsn(), "UPDATE pk_users SET address='UpdatedAddress3' WHERE another_id=12")
        await same_rows(a, b, ROWS, "the updates by the new key")
        await execute(a.dsn(), "UPDATE pk_users SET address='UpdatedAddress4' WHERE a_id=2")
        # b writes a second row with id 4 (pglogical's subscriber-only duplicate): it replicates to a
        await execute(b.dsn(), "INSERT INTO pk_users VALUES(4,15,2,'User5', 'Address5')")
        rows = await same_rows(a, b, ROWS, "b's duplicate id on a")
        assert rows == [
            (1, 11, 1, "User1", "UpdatedAddress1"), (2, 12, 1, "User2", "UpdatedAddress3"),
            (3, 13, 2, "User3", "UpdatedAddress4"), (4, 14, 2, "User4", "UpdatedAddress4"),
            (4, 15, 2, "User5", "Address5"),
        ], rows

        # back to id: the rows violate it, so it fails where it is issued, and nothing is replicated
        with pytest.raises(psycopg.errors.UniqueViolation):
            await execute(a.dsn(), "BEGIN", "CREATE UNIQUE INDEX id_temp_idx ON public.pk_users (id)",
                          "ALTER TABLE public.pk_users DROP CONSTRAINT pk_users_pkey,"
                          " ADD CONSTRAINT pk_users_pkey PRIMARY KEY USING INDEX id_temp_idx", "COMMIT")
        healthy(router)
        await execute(b.dsn(), "DELETE FROM pk_users WHERE id = 4")  # remove the offending entries
        await wait_for(lambda: has(a.dsn(), "SELECT count(*) FROM pk_users WHERE id = 4", [(0,)]), "delete")
        # now through `pgmesh ddl`, behind a barrier
        await cmd_ddl(m.config, "CREATE UNIQUE INDEX id_temp_idx ON public.pk_users (id);"
                      " ALTER TABLE public.pk_users DROP CONSTRAINT pk_users_pkey,"
                      " ADD CONSTRAINT pk_users_pkey PRIMARY KEY USING INDEX id_temp_idx",
                      wait=True, limit=60)
        await shape_everywhere(m.nodes, router, ("id", "d", "id,"))
        await execute(a.dsn(), "UPDATE pk_users SET address='UpdatedAddress2' WHERE id=2")
        rows = await same_rows(a, b, ROWS, "the update by id")
        assert [r[4] for r in rows] == ["UpdatedAddress1", "UpdatedAddress2", "UpdatedAddress4"], rows

        # no key at all: REPLICA IDENTITY FULL on every node, and the update pglogical loses replicates
        await execute(a.dsn(), "ALTER TABLE public.pk_users DROP CONSTRAINT pk_users_pkey")
        await shape_everywhere(m.nodes, router, (None, "f", "id,another_id,a_id,name,address,"))
        await execute(a.dsn(), "INSERT INTO pk_users VALUES(90,0,0,'User90', 'Address90')")
        await execute(a.dsn(), "UPDATE pk_users SET id = 91 WHERE id = 90")
        await execute(b.dsn(), "INSERT INTO pk_users VALUES(92,0,0,'User92', 'Address92')",
                      "UPDATE pk_users SET name = 'User92b' WHERE id = 92",
                      "DELETE FROM pk_users WHERE id = 1")
        rows = await same_rows(a, b, ROWS, "the changes without a key")
        assert [r[0] for r in rows] == [2, 3, 91, 92], rows
        assert rows[3] == (92, 0, 0, "User92b", "Address92"), rows

        # the key again, non-deferrable: DEFAULT again
        await execute(b.dsn(), "ALTER TABLE public.pk_users ADD CONSTRAINT pk_users_pkey PRIMARY KEY (id)"
                               " NOT DEFERRABLE")
        await shape_everywhere(m.nodes, router, ("id", "d", "id,"))

        # a deferrable key cannot identify rows (not a replica identity): FULL on every node, and
        # conflicts are still decided by the key
        await execute(a.dsn(), "ALTER TABLE public.pk_users DROP CONSTRAINT pk_users_pkey,"
                               " ADD CONSTRAINT pk_users_pkey PRIMARY KEY (id) DEFERRABLE INITIALLY DEFERRED")
        await shape_everywhere(m.nodes, router, ("id", "f", "id,"))
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="non-immediate"):
            await execute(a.dsn(), "ALTER TABLE public.pk_users REPLICA IDENTITY USING INDEX pk_users_pkey")
        await execute(a.dsn(), "INSERT INTO pk_users VALUES(100,0,0,'User100', 'Address100')")
        await execute(a.dsn(), "UPDATE pk_users SET id = 101 WHERE id = 100")
        await execute(b.dsn(), "UPDATE pk_users SET address = 'b' WHERE id = 2")
        rows = await same_rows(a, b, "SELECT id FROM pk_users WHERE id IN (90, 91, 100, 101) ORDER BY id",
                               "the changes under a deferrable key")
        assert rows == [(91,), (101,)], rows

        # recovered by re-creating the key as non-deferrable
        await execute(b.dsn(), "ALTER TABLE public.pk_users DROP CONSTRAINT pk_users_pkey,"
                               " ADD CONSTRAINT pk_users_pkey PRIMARY KEY (id) NOT DEFERRABLE")
        await shape_everywhere(m.nodes, router, ("id", "d", "id,"))
        await wait_converged(m.nodes, ["pk_users"])
        healthy(router)

    # conflicts are decided by the key again: the later of two updates of one row wins on both nodes
    await execute(a.dsn(), "UPDATE pk_users SET name = 'from a' WHERE id = 2")
    await execute(b.dsn(), "UPDATE pk_users SET name = 'from b' WHERE id = 2")
    await execute(a.dsn(), "DELETE FROM pk_users WHERE id = 3")
    await execute(b.dsn(), "UPDATE pk_users SET name = 'User3b' WHERE id = 3")
    async with running_router(m.config) as router:
        await wait_converged(m.nodes, ["pk_users"])
        healthy(router)
        assert await fetch(a.dsn(), "SELECT name FROM pk_users WHERE id IN (2, 3) ORDER BY id") == [
            ("from b",), ("User3b",)
        ]
        for node in m.nodes:
            history = await fetch(node.dsn(), "SELECT key FROM pgmesh.conflict_history"
                                              " WHERE table_name = 'public.pk_users' AND key IN ('2', '3')")
            assert {k for (k,) in history} == {"2", "3"}, (node.name, history)
        await execute(a.dsn(), "DROP TABLE public.pk_users CASCADE")
        gone = "SELECT to_regclass('public.pk_users') IS NULL"
        await wait_for(lambda: has(b.dsn(), gone, [(True,)]), "pk_users dropped on b")
