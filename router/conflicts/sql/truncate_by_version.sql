-- A replicated TRUNCATE, decided by version (router/apply/statements.py truncate_statement calls it in
-- the applying transaction, in place of a plain TRUNCATE): the rows of `schemas[i].names[i]` older than
-- the TRUNCATE's version (t_ts: the source's commit time; the source node from the session's
-- pgmesh.source) go, newer ones stay, and each table's tombstone (table_tombstones) records the TRUNCATE so
-- that a change older than it arriving later goes too (the recorder's sweep, truncate_sweep).
--
-- Every table is locked first, ACCESS EXCLUSIVE as TRUNCATE locks it. When no row of any of them is newer
-- than the TRUNCATE (the usual case; one read of each table's commit times, stopping at the first newer
-- row) it runs as the plain
-- `TRUNCATE ... [RESTART IDENTITY] [CASCADE]` it was on the source. Otherwise the older rows are deleted,
-- the tables in reverse order (tables a CASCADE reached come last in the list: referencing rows go first),
-- sequences are not restarted (the newer rows keep their values), and each table that kept rows gets one
-- row in conflict_history (`truncate_newer_rows`, how many stayed). Returns the rows kept.
-- Created, or replaced when its text changed (a fingerprint of it in the function's comment), by
-- router/conflicts/catalog.py (install_conflict_catalog), which fills {schema} with pgmesh's schema,
-- quoted as an identifier.

CREATE OR REPLACE FUNCTION {schema}.truncate_by_version(schemas text[], names text[], restart boolean,
  cascade boolean, t_ts timestamptz)
RETURNS bigint LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  t_node text := current_setting('pgmesh.source');
  n int := cardinality(names);
  newer boolean := false;
  found_newer boolean;
  kept bigint;
  total bigint := 0;
  i int;
BEGIN
  FOR i IN 1 .. n LOOP
    EXECUTE format('LOCK TABLE %I.%I IN ACCESS EXCLUSIVE MODE', schemas[i], names[i]);
  END LOOP;
  -- (not skipped when the node's last commit is older: an applied commit carries its source's time, which
  -- can be older than a local commit before it)
  FOR i IN 1 .. n LOOP
    EXECUTE format('SELECT EXISTS (SELECT FROM %I.%I AS r WHERE pg_catalog.pg_xact_commit_timestamp(r.xmin)'
                   ' >= $1 AND NOT {schema}.truncated(r.xmin, $1, $2))', schemas[i], names[i])
       INTO found_newer USING t_ts, t_node;
    newer := newer OR found_newer;
  END LOOP;
  IF NOT newer THEN
    EXECUTE 'TRUNCATE ' || (SELECT string_agg(format('%I.%I', s, t), ', ' ORDER BY o)
                              FROM unnest(schemas, names) WITH ORDINALITY AS u(s, t, o))
      || CASE WHEN restart THEN ' RESTART IDENTITY' ELSE '' END || CASE WHEN cascade THEN ' CASCADE' ELSE '' END;
  ELSE
    FOR i IN REVERSE n .. 1 LOOP
      EXECUTE format('DELETE FROM %I.%I AS r WHERE {schema}.truncated(r.xmin, $1, $2)', schemas[i], names[i])
        USING t_ts, t_node;
      EXECUTE format('SELECT count(*) FROM %I.%I', schemas[i], names[i]) INTO kept;
      IF kept > 0 THEN
        total := total + kept;
        INSERT INTO {schema}.conflict_history (source, table_name, key, conflict_type, resolution, resolver,
          reason, local_origin, local_commit_time, remote_origin, remote_commit_time)
        VALUES (t_node, schemas[i] || '.' || names[i], '', 'truncate_newer_rows', 'apply_remote',
          'last_update_wins', format('the TRUNCATE removed the rows older than it; %s newer row(s) stay', kept),
          NULL, NULL, t_node, t_ts);
        PERFORM set_config('pgmesh.decided', 'y', false);  -- the applier counts from the history then
      END IF;
    END LOOP;
  END IF;
  FOR i IN 1 .. n LOOP
    PERFORM {schema}.table_tombstone(schemas[i] || '.' || names[i], pg_catalog.pg_current_xact_id(), t_ts,
                                     t_node);
  END LOOP;
  RETURN total;
END
$body$;
