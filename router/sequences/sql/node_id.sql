-- This node's id (0..1023), from {schema}.node_info. SECURITY DEFINER, so that a role inserting into a
-- converted table needs no privilege on node_info (only USAGE on the schema).
-- Created, or replaced when its text changed (a fingerprint of it in the function's comment), by
-- router/sequences/ids.py (install_sequences), which fills {schema} with pgmesh's schema, quoted as an
-- identifier.

CREATE OR REPLACE FUNCTION {schema}.node_id() RETURNS integer
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
  SELECT i.value::integer FROM {schema}.node_info i WHERE i.key = 'node_id'
$body$;
