-- The last deletion of each key of each replicated table (written by the tombstone trigger).
-- Created once, when the table is missing, by router/conflicts/catalog.py (install_conflict_catalog),
-- which fills {schema} with pgmesh's schema, quoted as an identifier.

CREATE TABLE {schema}.tombstones (
  table_name text NOT NULL, key text[] NOT NULL, xid xid8 NOT NULL, PRIMARY KEY (table_name, key));
