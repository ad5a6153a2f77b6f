-- Whether a remote version beats a local one under a built-in resolver: the SQL twin of
-- router.conflicts.resolve._remote_wins (tests/integration/test_decide.py checks they agree). Versions
-- are (commit time, node name); an unknown time (NULL) is older than every known one; node names compare
-- bytewise (COLLATE "C", as Python compares them). `priority`: node_priority's order, first = highest.
-- Created, or replaced when its text changed (a fingerprint of it in the function's comment), by
-- router/conflicts/catalog.py (install_conflict_catalog), which fills {schema} with pgmesh's schema,
-- quoted as an identifier.

CREATE OR REPLACE FUNCTION {schema}.remote_wins(resolver text, priority text[], l_ts timestamptz,
  l_node text, r_ts timestamptz, r_node text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  lt timestamptz := coalesce(l_ts, '-infinity');
  rt timestamptz := coalesce(r_ts, '-infinity');
  l_rank int;
  r_rank int;
BEGIN
  IF resolver = 'last_update_wins' THEN
    RETURN rt > lt OR (rt = lt AND r_node COLLATE "C" > l_node COLLATE "C");
  ELSIF resolver = 'first_update_wins' THEN
    RETURN rt < lt OR (rt = lt AND r_node COLLATE "C" < l_node COLLATE "C");
  ELSIF resolver = 'node_priority' THEN
    IF rt <> lt THEN
      RETURN rt > lt;
    END IF;
    l_rank := coalesce(cardinality(priority) + 1 - array_position(priority, l_node), 0);
    r_rank := coalesce(cardinality(priority) + 1 - array_position(priority, r_node), 0);
    IF l_rank <> r_rank THEN
      RETURN r_rank > l_rank;
    END IF;
    RETURN r_node COLLATE "C" > l_node COLLATE "C";
  END IF;
  RETURN resolver = 'apply_remote';
END
$body$;
