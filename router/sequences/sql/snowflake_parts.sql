-- The (time, node id, counter) of a snowflake id; the same as router.sequences.ids.snowflake_parts.
-- Created, or replaced when its text changed (a fingerprint of it in the function's comment), by
-- router/sequences/ids.py (install_sequences), which fills {schema} with pgmesh's schema, quoted as an
-- identifier, and {epoch} with the snowflake epoch (2025-01-01 UTC in Unix milliseconds) as a literal.

CREATE OR REPLACE FUNCTION {schema}.snowflake_parts(
  id bigint, OUT ms timestamptz, OUT node_id integer, OUT seq integer)
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $body$
  SELECT to_timestamp((((id >> 24) & 1099511627775) + {epoch})::double precision / 1000),
         ((id >> 14) & 1023)::integer, (id & 16383)::integer
$body$;
