-- Unique values given up (value and key: the text of a text[], each term or key column as text): a row's secondary unique value, held at the version of transaction xid, that the
-- row gave up since (deleted, or updated to another value or key), written by the given_up trigger
-- (given_up_ensure.sql) for every local and replicated write. A replicated claim on that value older
-- than the hold loses to it (docs/conflicts.md, "A unique value given up"). Pruned as tombstones are.
-- Created once, when the table is missing, by router/conflicts/catalog.py (install_conflict_catalog),
-- which fills {schema} with pgmesh's schema, quoted as an identifier.

CREATE TABLE {schema}.given_up (
  table_name text NOT NULL, unique_key text NOT NULL, value text NOT NULL, key text NOT NULL,
  xid xid8 NOT NULL);
-- (by digests: a value or a keyless table's key can be longer than an index entry may be)
CREATE UNIQUE INDEX given_up_value ON {schema}.given_up
  (table_name, unique_key, pg_catalog.md5(value), pg_catalog.md5(key));
