"""PostgreSQL's 003_constraints.pl ported to a two-node pgmesh mesh with the router running (issue 17):
the same tables and statements, run as a user would, with writes added on the other node.
"""

from __future__ import annotations

import psycopg

from router.cluster.install import init_cluster
from router.testing.mesh import execute, fetch, running_router, wait_converged
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import healthy, rows_everywhere, same_rows

# 003_constraints: a trigger function in PL/pgSQL, whose body holds BEGIN / END and, here, words that
# look like transaction control in a string literal and in comments.
FILTER_FN = """
CREATE FUNCTION filter_basic_dml_fn() RETURNS TRIGGER AS $$
BEGIN
  -- a comment; COMMIT; ROLLBACK
  IF (TG_OP = 'INSERT') THEN
    IF (NEW.id < 10) THEN
      RETURN NEW;  /* ; end; begin */
    ELSE
      RAISE WARNING 'filtered: %; commit; begin', NEW.id;
      RETURN NULL;
    END IF;
  ELSIF (TG_OP = 'UPDATE') THEN
    NEW.junk := 'updated';
    RETURN NEW;
  END IF;
  RETURN NULL;
END;
$$ LANGUAGE plpgsql
"""

QUOTED_FNS = [
    # a body in a single-quoted literal, '' inside it, a comment between the statements' words
    "CREATE FUNCTION said() RETURNS text LANGUAGE sql AS 'SELECT ''a; begin; end; commit''' /* ; abort */",
    # a tagged dollar quote holding $$ and an unmatched quote
    "CREATE FUNCTION tagged() RETURNS text LANGUAGE sql AS $f$ SELECT $$it's; rollback$$::text $f$",
    # an SQL-standard body: its BEGIN ATOMIC ... END is not transaction control
    "CREATE FUNCTION atomic_inc(i int) RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT i + 1; END",
    # a quoted identifier with a semicolon and a keyword in it
    'CREATE TABLE "odd; commit" (id int PRIMARY KEY, "end" text)',
]


async def test_003_constraints(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema="CREATE TABLE tab_fk_ref (id int PRIMARY KEY, junk text, bid int);")
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), FILTER_FN)
        await execute(
            a.dsn(),
            "CREATE TRIGGER filter_basic_dml_trg BEFORE INSERT OR UPDATE ON tab_fk_ref"
            " FOR EACH ROW EXECUTE FUNCTION filter_basic_dml_fn()",
        )
        for fn in QUOTED_FNS:
            await execute(a.dsn(), fn)
        await execute(a.dsn(), "DO $$ BEGIN EXECUTE 'CREATE TABLE do_made (id int PRIMARY KEY)'; END $$")
        definition = "SELECT pg_get_functiondef(p.oid) FROM pg_proc p WHERE proname = %s"
        for name in ("filter_basic_dml_fn", "said", "tagged", "atomic_inc"):
            rows = await same_rows(a, b, definition.replace("%s", f"'{name}'"), f"function {name} on b")
            assert len(rows) == 1, (name, rows)
        for table in ("do_made", '"odd; commit"'):
            exists = f"SELECT to_regclass('{table}') IS NOT NULL"
            assert await same_rows(a, b, exists, f"table {table} on b") == [(True,)]
        trigger = "SELECT tgname, tgenabled FROM pg_trigger WHERE tgname = 'filter_basic_dml_trg'"
        assert await same_rows(a, b, trigger, "the trigger on b") == [("filter_basic_dml_trg", "O")]
        # the trigger works on both nodes: ids >= 10 are filtered where they are inserted
        await execute(a.dsn(), "INSERT INTO tab_fk_ref (id, bid) VALUES (1, 1), (11, 11), (2, 2)")
        await execute(b.dsn(), "INSERT INTO tab_fk_ref (id, bid) VALUES (3, 3), (12, 12)")
        # b updates a's row once it is there (as 003_constraints.pl waits for the catch-up): sent at once,
        # the update raced the row's arrival, which the first insert into a new table makes wait for its
        # decision functions to be created (about 10 ms)
        await rows_everywhere([b], "SELECT id FROM tab_fk_ref WHERE id = 1", [(1,)])
        await execute(b.dsn(), "UPDATE tab_fk_ref SET bid = 4 WHERE id = 1")
        await wait_converged(m.nodes, ["tab_fk_ref"])
        rows = await fetch(b.dsn(), "SELECT id, junk, bid FROM tab_fk_ref ORDER BY id")
        assert rows == [(1, "updated", 4), (2, None, 2), (3, None, 3)], rows
        for node in m.nodes:
            assert await fetch(node.dsn(), "SELECT atomic_inc(1), said(), tagged()") == [
                (2, "a; begin; end; commit", "it's; rollback")
            ]
        assert all(applier.last_error is None for applier in router.appliers.values())
    # transaction control at the top level of a query string is still refused, also after a comment
    async with await psycopg.AsyncConnection.connect(a.dsn(), autocommit=True) as conn:
        for text in (
            b"CREATE TABLE u1 (id int PRIMARY KEY); COMMIT",
            b"/* x; */ begin; CREATE TABLE u2 (id int PRIMARY KEY); end",
            b"CREATE TABLE u3 (id int PRIMARY KEY); -- ;\n SAVEPOINT s",
            b"START TRANSACTION; CREATE FUNCTION g() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; END;"
            b" COMMIT",
        ):
            result = conn.pgconn.exec_(text)
            assert b"transaction control is not replicated" in (result.error_message or b""), text
            conn.pgconn.exec_(b"ROLLBACK")  # a BEGIN before the refused command opened a transaction
        for name in ("u1", "u2", "u3", "g"):
            found = await fetch(a.dsn(), f"SELECT to_regclass('{name}'), to_regproc('{name}')")
            assert found == [(None, None)], name


FK_SCHEMA_A = """
CREATE TABLE tab_fk (bid int PRIMARY KEY);
CREATE TABLE tab_fk_ref (id int PRIMARY KEY, junk text, bid int REFERENCES tab_fk (bid));
"""
FK_SCHEMA_B = """
CREATE TABLE tab_fk (bid int PRIMARY KEY);
CREATE TABLE tab_fk_ref (id int PRIMARY KEY, bid int REFERENCES tab_fk (bid), junk text);
"""


async def test_003_foreign_keys(mesh: MeshFactory) -> None:
    """Rows with a foreign key (b's columns in another order, a TOASTed value), the referenced table
    dropped with CASCADE (replicated), and a child inserted on b for a parent a deletes meanwhile: as in
    PostgreSQL's own apply, the foreign key is not checked on apply, so both nodes keep the child."""
    m = await mesh(nodes=2, init=False)
    a, b = m.nodes
    await execute(a.dsn(), FK_SCHEMA_A)
    await execute(b.dsn(), FK_SCHEMA_B)
    report, _ = await init_cluster(m.config)
    assert report.ok, report.render()
    summary = "SELECT count(*), min(bid), max(bid) FROM {}"
    async with running_router(m.config) as router:
        await execute(a.dsn(), "INSERT INTO tab_fk (bid) VALUES (1), (3)")
        toasted = "INSERT INTO tab_fk_ref (id, bid, junk) VALUES (1, 1, repeat(pi()::text, 20000))"
        await execute(a.dsn(), toasted)
        await rows_everywhere(m.nodes, summary.format("tab_fk_ref"), [(1, 1, 1)])
        await execute(b.dsn(), "INSERT INTO tab_fk_ref (id, bid) VALUES (3, 3)")
        await rows_everywhere(m.nodes, summary.format("tab_fk_ref"), [(2, 1, 3)])
        # a deletes parent 3's child and the parent; b meanwhile adds another child of 3
        await execute(a.dsn(), "DELETE FROM tab_fk_ref WHERE id = 3")
        await rows_everywhere(m.nodes, summary.format("tab_fk_ref"), [(1, 1, 1)])
        await router.pause(None)
        await execute(a.dsn(), "DELETE FROM tab_fk WHERE bid = 3")
        await execute(b.dsn(), "INSERT INTO tab_fk_ref (id, bid) VALUES (4, 3)")
        await router.resume(None)
        await rows_everywhere(m.nodes, summary.format("tab_fk_ref"), [(2, 1, 3)])
        await rows_everywhere(m.nodes, summary.format("tab_fk"), [(1, 1, 1)])
        orphans = "SELECT count(*) FROM tab_fk_ref r WHERE NOT EXISTS"
        orphans += " (SELECT 1 FROM tab_fk f WHERE f.bid = r.bid)"
        await rows_everywhere(m.nodes, orphans, [(1,)])
        # the referenced table dropped (its foreign key goes with it, on every node)
        await execute(a.dsn(), "DROP TABLE tab_fk CASCADE")
        await rows_everywhere(m.nodes, "SELECT to_regclass('tab_fk') IS NULL", [(True,)])
        await execute(a.dsn(), "INSERT INTO tab_fk_ref (id, bid) VALUES (2, 2)")
        await execute(b.dsn(), "INSERT INTO tab_fk_ref (id, bid) VALUES (5, 5)")
        await rows_everywhere(m.nodes, summary.format("tab_fk_ref"), [(4, 1, 5)])
        # (compared by column name: the column order differs)
        await same_rows(a, b, "SELECT id, bid, md5(junk) FROM tab_fk_ref ORDER BY id", "tab_fk_ref equal")
        healthy(router)
