-- The node a replication origin id stands for on this node (0 or NULL: this node itself, the session's
-- pgmesh.target), as the careful path names it (router.apply.careful.transaction: `_node`).
-- Created, or replaced when its text changed (a fingerprint of it in the function's comment), by
-- router/conflicts/catalog.py (install_conflict_catalog), which fills {schema} with pgmesh's schema,
-- quoted as an identifier.

CREATE OR REPLACE FUNCTION {schema}.origin_node(origin oid)
RETURNS text LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  node text;
BEGIN
  IF origin IS NULL OR origin = 0 THEN
    RETURN current_setting('pgmesh.target');
  END IF;
  -- (a row `pgmesh repair` wrote is the winner's: its origin is pgmeshrepair_<cluster>_<winner>)
  SELECT CASE WHEN starts_with(o.roname, 'pgmeshrepair' || substr(current_setting('pgmesh.origin_prefix'), 7))
              THEN substr(o.roname, length(current_setting('pgmesh.origin_prefix')) + 7)
              ELSE substr(o.roname, length(current_setting('pgmesh.origin_prefix')) + 1) END INTO node
    FROM pg_replication_origin AS o WHERE o.roident = origin;
  RETURN coalesce(node, 'origin ' || origin);
END
$body$;
