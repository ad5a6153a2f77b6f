-- The last TRUNCATE of each replicated table (a table-level tombstone): the truncating transaction's xid,
-- whose commit time and origin are the TRUNCATE's version. Every row and every change of the table older
-- than it goes; newer ones stay (docs/conflicts.md, "TRUNCATE"). Written by the applier's
-- truncate_by_version (a replicated TRUNCATE, in the applying transaction) and by the tombstone recorder
-- (router/apply/recorder.py: the node's own TRUNCATEs, from its decoded stream); swept and dropped by
-- the recorder once the pruning horizon has passed it.
-- Created once, when the table is missing, by router/conflicts/catalog.py (install_conflict_catalog),
-- which fills {schema} with pgmesh's schema, quoted as an identifier.

CREATE TABLE {schema}.table_tombstones (table_name text PRIMARY KEY, xid xid8 NOT NULL);
