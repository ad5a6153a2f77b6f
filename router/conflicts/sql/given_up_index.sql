-- After CREATE [UNIQUE] INDEX or ALTER INDEX on a replicated table (one carrying pgmesh_tombstone): the
-- given-up trigger again, with the table's unique keys as they are now (given_up_ensure.sql; its key: the
-- tombstone trigger's). Called by the DDL capture (router/ddl/sql/capture.sql) for each index it reports.
-- Created, or replaced when its text changed, by router/conflicts/catalog.py (install_conflict_catalog),
-- which fills {schema} with pgmesh's schema, quoted as an identifier.

CREATE OR REPLACE FUNCTION {schema}.given_up_index(idx oid) RETURNS void LANGUAGE plpgsql AS $body$
DECLARE
  rel oid;
  args bytea;
BEGIN
  SELECT i.indrelid INTO rel FROM pg_catalog.pg_index i WHERE i.indexrelid = idx;
  SELECT t.tgargs INTO args FROM pg_catalog.pg_trigger t
   WHERE t.tgrelid = rel AND t.tgname = 'pgmesh_tombstone' AND t.tgparentid = 0;
  IF args IS NULL THEN
    RETURN;  -- not a replicated table (or a partition: its root's trigger is cloned to it)
  END IF;
  PERFORM {schema}.given_up_ensure(rel, ARRAY(
    SELECT pg_catalog.convert_from(pg_catalog.substr(args, s + 1, e - s - 1), 'UTF8')
      FROM (SELECT lag(p, 1, 0) OVER (ORDER BY p) AS s, p AS e
              FROM pg_catalog.generate_series(1, pg_catalog.length(args)) AS p
             WHERE pg_catalog.get_byte(args, p - 1) = 0) AS parts ORDER BY e));
END
$body$;
