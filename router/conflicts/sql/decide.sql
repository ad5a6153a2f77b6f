-- Decide one conflict on this node and record it in conflict_history, in the applying transaction: the
-- SQL twin of router.conflicts.resolve.resolve for the built-in resolvers (tests/integration/
-- test_decide.py checks they agree). Called by the applier's decision functions (router.apply.decide)
-- only when a remote change did not fit the row it met. Returns whether the remote change wins.
--
-- `l_ts`, `l_origin`: the local version (the row's, or for update_deleted / insert_deleted the
-- tombstone's; NULL for update_missing / delete_missing); `l_row`, `r_row`: the rows as JSON text, each
-- column's text. The remote version and the source come from the session (router.apply.decide.GUC_*):
-- pgmesh.source, pgmesh.target, pgmesh.origin_prefix, and per transaction pgmesh.remote =
-- '<source LSN>|<source commit time>|<seen: JSON {node: commit time}>' (read by remote_version.sql).
--
-- A local version the source had already seen when it committed (its time is at most what `seen` says
-- the source had applied from that node, and earlier than the remote one) is not a conflict: the remote
-- change was made on top of it, and is applied without a record, as last_update_wins and node_priority
-- would decide (router.conflicts.causality; docs/conflicts.md "Only concurrent writes are conflicts").
-- `error` and custom resolvers are not decided here: SQLSTATE PGM01 sends the transaction to the careful
-- path (router.apply.careful.transaction), which decides them row by row in the router.
-- Each decision sets pgmesh.decided (undone with its transaction when that rolls back): the applier then
-- counts the new history rows (router.apply.link.count_conflicts).
-- Created, or replaced when its text changed (a fingerprint of it in the function's comment), by
-- router/conflicts/catalog.py (install_conflict_catalog), which fills {schema} with pgmesh's schema,
-- quoted as an identifier.

CREATE OR REPLACE FUNCTION {schema}.decide(conflict text, table_name text, key text, l_ts timestamptz,
  l_origin oid, l_row text, r_row text, resolver text, priority text[])
RETURNS boolean LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  remote text[] := string_to_array({schema}.remote_version(), '|');
  r_ts timestamptz := remote[2]::timestamptz;
  r_node text := current_setting('pgmesh.source');
  l_node text;
  seen timestamptz;
  won boolean;
  reason text;
  unrecorded boolean := false;
BEGIN
  IF resolver NOT IN ('last_update_wins', 'first_update_wins', 'node_priority', 'keep_local',
                      'apply_remote') THEN
    RAISE EXCEPTION 'pgmesh: % on % is decided by the careful path (resolver %)', conflict, table_name,
      resolver USING ERRCODE = 'PGM01';
  END IF;
  IF conflict IN ('update_missing', 'delete_missing') THEN
    l_ts := NULL;
  ELSE
    l_node := {schema}.origin_node(l_origin);
  END IF;
  IF l_node IS NOT NULL AND l_ts IS NOT NULL AND coalesce(remote[3], '') <> '' AND r_ts > l_ts
     AND resolver IN ('last_update_wins', 'node_priority') THEN
    seen := (remote[3]::jsonb ->> l_node)::timestamptz;
    IF seen IS NOT NULL AND l_ts <= seen THEN
      RETURN true;  -- sequential: the source wrote on top of this version
    END IF;
  END IF;
  IF conflict = 'delete_missing' THEN
    won := false;
    reason := 'nothing to delete: the row is already gone';
  ELSIF conflict = 'update_missing' THEN
    won := resolver <> 'keep_local';
    reason := CASE WHEN won THEN 'no local row and no record of a deletion: insert it'
                   ELSE 'no local row; keep_local leaves it absent' END;
  ELSE
    won := {schema}.remote_wins(resolver, priority, l_ts, l_node, r_ts, r_node);
    reason := CASE WHEN won THEN 'remote' ELSE 'local' END || CASE
      WHEN coalesce(l_ts, '-infinity') = r_ts AND resolver = 'last_update_wins' THEN
        ' wins: same commit time, node name '
        || quote_literal(CASE WHEN l_node COLLATE "C" > r_node COLLATE "C" THEN l_node ELSE r_node END)
        || ' breaks the tie'
      WHEN l_ts IS NULL THEN ' wins: the local commit time is unknown (frozen or older than pgmesh): oldest'
      ELSE ' wins by ' || resolver END;
  END IF;
  -- on a partial node (router.cluster.partial) a filtered table's missing rows and tombstones are mostly
  -- rows its filter keeps out, not conflicts: decided alike, not recorded
  IF l_row IS NULL AND pg_catalog.to_regclass('{schema}.part') IS NOT NULL THEN
    EXECUTE 'SELECT EXISTS (SELECT FROM {schema}.part WHERE table_name = $1 AND row_filter IS NOT NULL)'
      INTO unrecorded USING table_name;
  END IF;
  IF unrecorded THEN
    RETURN won;
  END IF;
  INSERT INTO {schema}.conflict_history (source, table_name, key, conflict_type, resolution, resolver,
    reason, local_origin, local_commit_time, remote_origin, remote_commit_time, remote_lsn, local_row,
    remote_row)
  VALUES (r_node, table_name, key, conflict, CASE WHEN won THEN 'apply_remote' ELSE 'keep_local' END,
    resolver, reason, l_node, l_ts, r_node, r_ts, remote[1]::pg_lsn, l_row::jsonb, r_row::jsonb);
  PERFORM set_config('pgmesh.decided', 'y', false);  -- the applier counts from the history then
  RETURN won;
END
$body$;
