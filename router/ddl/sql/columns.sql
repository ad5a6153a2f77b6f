-- What each replicated table's columns were called (known_columns) and the renames and drops DDL made
-- to them (column_changes), so that rows sent before a change are fitted to the columns after it
-- (router/ddl/reconcile.py); the tables pgmesh made REPLICA IDENTITY FULL (auto_identity). Installed by router/ddl/capture.py (install_ddl_capture), which fills
-- {schema} with pgmesh's schema, quoted as an identifier.

CREATE TABLE IF NOT EXISTS {schema}.known_columns (
  relid oid NOT NULL, attnum int2 NOT NULL, name text NOT NULL, PRIMARY KEY (relid, attnum));

CREATE TABLE IF NOT EXISTS {schema}.column_changes (
  table_name text NOT NULL, old_name text NOT NULL, new_name text,
  at timestamptz NOT NULL DEFAULT clock_timestamp());

-- The tables (and partitions) whose REPLICA IDENTITY FULL pgmesh set itself, because they had no usable
-- key (router/ddl/sql/capture.sql, ddl_identity): reset to DEFAULT when a primary key arrives. A table
-- set FULL by its owner is not listed, and keeps FULL.
CREATE TABLE IF NOT EXISTS {schema}.auto_identity (relid oid PRIMARY KEY);

-- Bumped by every DDL command on a replicated object here, captured or replayed (ddl_changed): an applier
-- into this node reads the target's tables again when it moved (keys and unique constraints change).
CREATE SEQUENCE IF NOT EXISTS {schema}.schema_changes;
