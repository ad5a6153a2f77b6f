-- One row per conflict decided on this node (written by the applier), and its index by time.
-- Created once, when the table is missing, by router/conflicts/catalog.py (install_conflict_catalog),
-- which fills {schema} with pgmesh's schema, quoted as an identifier.

CREATE TABLE {schema}.conflict_history (
  id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp(),
  source text NOT NULL, table_name text NOT NULL, key text NOT NULL, conflict_type text NOT NULL,
  resolution text NOT NULL, resolver text NOT NULL, reason text,
  local_origin text, local_commit_time timestamptz, remote_origin text NOT NULL,
  remote_commit_time timestamptz NOT NULL, remote_lsn pg_lsn, local_row jsonb, remote_row jsonb);

CREATE INDEX conflict_history_at_idx ON {schema}.conflict_history (at);
