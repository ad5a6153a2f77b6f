-- How far the node's tombstone recorder (router/apply/recorder.py) got in the node's own stream: the end
-- LSN of the last transaction whose deletes it recorded. One row, written in the recorder's transaction.
-- Created once, when the table is missing, by router/conflicts/catalog.py (install_conflict_catalog),
-- which fills {schema} with pgmesh's schema, quoted as an identifier.

CREATE TABLE {schema}.tombstones_recorded (position pg_lsn NOT NULL);
