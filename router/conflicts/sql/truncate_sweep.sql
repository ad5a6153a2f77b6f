-- Remove the rows of `table_name` ("schema.name"; `qualified`: the same quoted) older than its table
-- tombstone: rows a change older than the table's last TRUNCATE wrote after it, because that change reached
-- this node after the TRUNCATE (or the node's own TRUNCATE was not recorded yet when it was applied). Each
-- removed row is recorded in conflict_history (`write_truncated`: the change lost to the TRUNCATE). Run by
-- the tombstone recorder (router/apply/recorder.py), under its own replication origin (no echo),
-- after it records a TRUNCATE of the node's own and every few seconds while a table tombstone stays.
-- Returns the rows removed.
-- Created, or replaced when its text changed (a fingerprint of it in the function's comment), by
-- router/conflicts/catalog.py (install_conflict_catalog), which fills {schema} with pgmesh's schema,
-- quoted as an identifier.

CREATE OR REPLACE FUNCTION {schema}.truncate_sweep(table_name text, qualified text)
RETURNS bigint LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  x xid8;
  t_ts timestamptz;
  t_node text;
  key_sql text;
  removed bigint;
BEGIN
  SELECT t.xid INTO x FROM {schema}.table_tombstones AS t WHERE t.table_name = truncate_sweep.table_name;
  IF NOT FOUND OR pg_catalog.to_regclass(qualified) IS NULL THEN
    RETURN 0;
  END IF;
  SELECT v.timestamp, {schema}.origin_node(v.roident) INTO t_ts, t_node
    FROM pg_catalog.pg_xact_commit_timestamp_origin(pg_catalog.xid(x)) AS v;
  IF t_ts IS NULL THEN
    RETURN 0;  -- not committed yet, or too old to order anything still on its way (pruned soon)
  END IF;
  SELECT string_agg(format('r.%I::text', a.attname), ' || '','' || ' ORDER BY k.o) INTO key_sql
    FROM pg_catalog.pg_index AS i, unnest(i.indkey) WITH ORDINALITY AS k(attnum, o)
    JOIN pg_catalog.pg_attribute AS a ON a.attnum = k.attnum
   WHERE i.indrelid = qualified::regclass AND i.indisprimary AND a.attrelid = i.indrelid;
  EXECUTE format(
    'WITH d AS (DELETE FROM %s AS r WHERE coalesce(pg_catalog.pg_xact_commit_timestamp(r.xmin), ''-infinity'')'
    ' <= $1 AND {schema}.truncated(r.xmin, $1, $2) RETURNING r.xmin AS x, %s AS k, pg_catalog.to_jsonb(r) AS j)'
    ' INSERT INTO {schema}.conflict_history (source, table_name, key, conflict_type, resolution, resolver,'
    '   reason, local_origin, local_commit_time, remote_origin, remote_commit_time, remote_row)'
    ' SELECT o.node, $3, coalesce(d.k, ''''), ''write_truncated'', ''keep_local'', ''last_update_wins'','
    '   ''a change older than the TRUNCATE of its table (recorded here as the local version) reached this'
    ' node after it: its row removed'', $2, $1, o.node, coalesce(v.timestamp, ''-infinity''), d.j'
    '  FROM d, pg_catalog.pg_xact_commit_timestamp_origin(d.x) AS v,'
    '   LATERAL (SELECT {schema}.origin_node(v.roident) AS node) AS o',
    qualified, coalesce(key_sql, 'r::text')) USING t_ts, t_node, table_name;
  GET DIAGNOSTICS removed = ROW_COUNT;
  IF removed > 0 THEN
    PERFORM set_config('pgmesh.decided', 'y', false);
  END IF;
  RETURN removed;
END
$body$;
