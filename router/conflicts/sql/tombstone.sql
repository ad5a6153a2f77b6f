-- Trigger function of pgmesh_tombstone (AFTER DELETE): records the deleted row's key in tombstones. Enabled
-- REPLICA where the node's own deletes are recorded from its decoded stream (router/apply/recorder.py:
-- the stream carries the key), so it fires for the router's replicated deletes only; ALWAYS where the
-- stream does not carry the key (a replica identity index other than the primary key). The recorder's own
-- sessions set pgmesh.recording = 'y': the trigger then records nothing (the recorder writes the key itself).
-- Created, or replaced when its text changed (a fingerprint of it in the function's comment), by
-- router/conflicts/catalog.py (install_conflict_catalog), which fills {schema} with pgmesh's schema,
-- quoted as an identifier.

CREATE OR REPLACE FUNCTION {schema}.tombstone() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET TimeZone = 'UTC' SET DateStyle = 'ISO, YMD' SET IntervalStyle = 'postgres' SET extra_float_digits = 3
SET bytea_output = 'hex' SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  root oid := pg_catalog.pg_partition_root(TG_RELID);
  qualified text := TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME;
  deleted_key text[];
BEGIN
  IF pg_catalog.current_setting('pgmesh.recording', true) = 'y' THEN
    RETURN NULL;
  END IF;
  IF root IS NOT NULL AND root <> TG_RELID THEN  -- a partition: record it under the root's name
    SELECT n.nspname || '.' || c.relname INTO qualified
      FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = root;
  END IF;
  EXECUTE (SELECT format('SELECT ARRAY[%s]::text[]', string_agg(format('($1).%I::text', a.col), ', '
                          ORDER BY a.ord))
             FROM unnest(TG_ARGV) WITH ORDINALITY AS a(col, ord))
     INTO deleted_key USING OLD;
  -- a key too long for the index (a keyless table's whole row): its md5 (router.apply.statements.tombstone_key)
  IF pg_catalog.octet_length(deleted_key::text) + 8 * pg_catalog.cardinality(deleted_key) > 2000 THEN
    deleted_key := ARRAY['pgmesh:md5:' || pg_catalog.md5(deleted_key::text)];
  END IF;
  INSERT INTO {schema}.tombstones AS t (table_name, key, xid)
  VALUES (qualified, deleted_key, pg_catalog.pg_current_xact_id())
  ON CONFLICT (table_name, key) DO UPDATE SET xid = excluded.xid;
  RETURN NULL;
END
$body$;
