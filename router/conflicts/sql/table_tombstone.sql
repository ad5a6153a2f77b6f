-- Record a TRUNCATE of `table_name` ("schema.name") by transaction `x` at version (t_ts, t_node) as the
-- table's tombstone, unless the one there is newer. Returns whether it was written.
-- Created, or replaced when its text changed (a fingerprint of it in the function's comment), by
-- router/conflicts/catalog.py (install_conflict_catalog), which fills {schema} with pgmesh's schema,
-- quoted as an identifier.

CREATE OR REPLACE FUNCTION {schema}.table_tombstone(table_name text, x xid8, t_ts timestamptz, t_node text)
RETURNS boolean LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  old xid8;
BEGIN
  SELECT t.xid INTO old FROM {schema}.table_tombstones AS t WHERE t.table_name = table_tombstone.table_name
     FOR UPDATE;
  IF NOT FOUND THEN
    INSERT INTO {schema}.table_tombstones AS t (table_name, xid) VALUES (table_tombstone.table_name, x)
    ON CONFLICT ON CONSTRAINT table_tombstones_pkey DO UPDATE SET xid = excluded.xid
     WHERE {schema}.truncated(pg_catalog.xid(t.xid), t_ts, t_node);
    RETURN true;
  END IF;
  IF old = x OR NOT {schema}.truncated(pg_catalog.xid(old), t_ts, t_node) THEN
    RETURN false;  -- the same TRUNCATE again (recorded twice), or a newer one is there
  END IF;
  UPDATE {schema}.table_tombstones AS t SET xid = x WHERE t.table_name = table_tombstone.table_name;
  RETURN true;
END
$body$;
