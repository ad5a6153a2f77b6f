"""PostgreSQL's 032_subscribe_use_index.pl ported to a two-node pgmesh mesh with the router running (issue
17): tables without a key matched by all their columns (REPLICA IDENTITY FULL), with duplicate rows,
NULLs, partitions and indexes (plain, partial, on expressions, mixed). The original counts index scans
on the subscriber; pgmesh's way of finding the row is its own, so this port checks the rows, from both
nodes, and that each change touches exactly one row.
"""

from __future__ import annotations

from router.testing.mesh import execute, running_router
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import converge, healthy, rows_everywhere

SCHEMA = """
CREATE TABLE test_replica_id_full (x int, y text);
ALTER TABLE test_replica_id_full REPLICA IDENTITY FULL;
CREATE INDEX test_replica_id_full_idx ON test_replica_id_full(x,y);
INSERT INTO test_replica_id_full SELECT (i%10), (i%10)::text FROM generate_series(0,10) i;
CREATE TABLE users_table_part(user_id bigint, value_1 int, value_2 int) PARTITION BY RANGE (value_1);
CREATE TABLE users_table_part_0 PARTITION OF users_table_part FOR VALUES FROM (0) TO (10);
CREATE TABLE users_table_part_1 PARTITION OF users_table_part FOR VALUES FROM (10) TO (20);
ALTER TABLE users_table_part REPLICA IDENTITY FULL;
ALTER TABLE users_table_part_0 REPLICA IDENTITY FULL;
ALTER TABLE users_table_part_1 REPLICA IDENTITY FULL;
CREATE INDEX users_table_part_idx ON users_table_part(user_id, value_1);
INSERT INTO users_table_part SELECT (i%100), (i%20), i FROM generate_series(0,100) i;
CREATE TABLE people (firstname text, lastname text);
ALTER TABLE people REPLICA IDENTITY FULL;
CREATE INDEX people_names_expr_only ON people ((firstname || ' ' || lastname));
CREATE INDEX people_names_partial ON people(firstname) WHERE (firstname = 'first_name_1');
CREATE INDEX people_names ON people (firstname, lastname, (firstname || ' ' || lastname));
INSERT INTO people SELECT 'first_name_' || i::text, 'last_name_' || i::text FROM generate_series(0,200) i;
CREATE TABLE nulls (x int, y int);
ALTER TABLE nulls REPLICA IDENTITY FULL;
CREATE INDEX nulls_idx ON nulls(x,y);
"""
TABLES = ["test_replica_id_full", "users_table_part", "people", "nulls"]


async def test_032_subscribe_use_index(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        # duplicates (x = 0 twice): the update and delete of one value touch every row with it
        await execute(a.dsn(), "DELETE FROM test_replica_id_full WHERE x IN (5, 6)")
        await execute(b.dsn(), "UPDATE test_replica_id_full SET x = 100, y = '200' WHERE x IN (1, 2)")
        await execute(a.dsn(), "UPDATE test_replica_id_full SET y = 'zero' WHERE x = 0")
        full = "SELECT count(*) FROM test_replica_id_full WHERE "
        await rows_everywhere(m.nodes, full + "(x = 100 and y = '200')", [(2,)])
        await rows_everywhere(m.nodes, "SELECT count(*) FROM test_replica_id_full WHERE x in (5, 6)", [(0,)])
        await rows_everywhere(m.nodes, "SELECT count(*) FROM test_replica_id_full WHERE y = 'zero'", [(2,)])
        # partitions: rows moved to another partition, rows deleted in both
        await execute(a.dsn(), "UPDATE users_table_part SET value_1 = 0 WHERE user_id = 4")
        await execute(b.dsn(), "DELETE FROM users_table_part WHERE user_id = 1 and value_1 = 1")
        await execute(a.dsn(), "DELETE FROM users_table_part WHERE user_id = 12 and value_1 = 12")
        total = "select sum(user_id+value_1+value_2) from users_table_part"
        await rows_everywhere(m.nodes, total, [(10907,)])
        await rows_everywhere(
            m.nodes, "select count(DISTINCT(user_id,value_1, value_2)) from users_table_part", [(99,)])
        # indexes on expressions and partial indexes
        await execute(a.dsn(), "UPDATE people SET firstname = 'no-name' WHERE firstname = 'first_name_1'")
        await execute(b.dsn(), "UPDATE people SET firstname = 'no-name'"
                               " WHERE firstname = 'first_name_2' AND lastname = 'last_name_2'")
        await execute(b.dsn(), "DELETE FROM people WHERE firstname = 'first_name_3'")
        await execute(a.dsn(), "DELETE FROM people"
                               " WHERE firstname = 'first_name_4' AND lastname = 'last_name_4'")
        await rows_everywhere(m.nodes, "SELECT count(*) FROM people", [(199,)])
        await rows_everywhere(m.nodes, "SELECT count(*) FROM people WHERE firstname = 'no-name'", [(2,)])
        await execute(a.dsn(), "DELETE FROM people WHERE firstname = 'no-name'")
        await execute(b.dsn(), "DROP INDEX people_names")
        await execute(b.dsn(), "DELETE FROM people WHERE lastname = 'last_name_18'")
        await rows_everywhere(m.nodes, "SELECT count(*) FROM people", [(196,)])
        # NULLs in the matched columns
        await execute(a.dsn(), "INSERT INTO nulls (x) VALUES (1), (2), (3)")
        await execute(a.dsn(), "UPDATE nulls SET x = x + 1 WHERE x = 1")
        await rows_everywhere(m.nodes, "select sum(x), count(*) from nulls WHERE y IS NULL", [(7, 3)])
        await execute(b.dsn(), "UPDATE nulls SET x = x * 10 WHERE x = 2")
        await execute(b.dsn(), "DELETE FROM nulls WHERE x = 3")
        await rows_everywhere(m.nodes, "select x from nulls order by x", [(20,), (20,)])
        await converge(router, m.nodes, TABLES)
        healthy(router)
