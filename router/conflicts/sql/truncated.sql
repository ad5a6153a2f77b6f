-- Whether a row last written by transaction `x` is older than a TRUNCATE at version (t_ts, t_node): the
-- version order of last_update_wins (commit time, then the node name, "C" collation, breaks a tie); an
-- unknown commit time (frozen, too old, or the applying transaction's own rows) is the oldest, and so is a
-- row this node wrote before pgmesh was installed on it (origin 0, before installed_at: the common
-- starting point, or a row a join copied here).
-- Created, or replaced when its text changed (a fingerprint of it in the function's comment), by
-- router/conflicts/catalog.py (install_conflict_catalog), which fills {schema} with pgmesh's schema,
-- quoted as an identifier.

CREATE OR REPLACE FUNCTION {schema}.truncated(x xid, t_ts timestamptz, t_node text)
RETURNS boolean LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $body$
  SELECT coalesce(v.timestamp, '-infinity') < t_ts
      OR (v.timestamp = t_ts AND {schema}.origin_node(v.roident) COLLATE "C" < t_node COLLATE "C")
      OR (v.roident = 0 AND v.timestamp < coalesce(
            nullif(pg_catalog.current_setting('pgmesh.installed_at', true), ''),
            (SELECT i.value FROM {schema}.node_info AS i WHERE i.key = 'installed_at'))::timestamptz)
    FROM pg_catalog.pg_xact_commit_timestamp_origin(x) AS v
$body$;
