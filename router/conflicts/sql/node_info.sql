-- Facts about this node as (key, value) rows, starting with when pgmesh was installed here: rows
-- committed before it are the common starting point of every node, so a change to them is no conflict.
-- Created once, when the table is missing, by router/conflicts/catalog.py (install_conflict_catalog),
-- which fills {schema} with pgmesh's schema, quoted as an identifier.

CREATE TABLE {schema}.node_info (key text PRIMARY KEY, value text NOT NULL);

-- (ISO 8601 in UTC whatever the session's DateStyle and TimeZone: every session reads it back)
INSERT INTO {schema}.node_info
VALUES ('installed_at', to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US') || '+00');
