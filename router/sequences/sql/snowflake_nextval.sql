-- The next id of a converted column: 40 bits of milliseconds since the epoch, 10 of node id, 14 of
-- nextval(seq). It runs as its caller, so nextval() still checks the caller's right to the sequence.
-- Created, or replaced when its text changed (a fingerprint of it in the function's comment), by
-- router/sequences/ids.py (install_sequences), which fills {schema} with pgmesh's schema, quoted as an
-- identifier, and {epoch} with the snowflake epoch (2025-01-01 UTC in Unix milliseconds) as a literal.

CREATE OR REPLACE FUNCTION {schema}.snowflake_nextval(seq regclass) RETURNS bigint
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  node bigint := {schema}.node_id();
  ms bigint;
BEGIN
  IF node IS NULL OR node < 0 OR node > 1023 THEN
    RAISE EXCEPTION 'pgmesh: node id not assigned; run pgmesh init' USING ERRCODE = 'PGMS0';
  END IF;
  ms := floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint - {epoch};
  IF ms < 0 OR ms >= 1099511627776 THEN
    RAISE EXCEPTION 'pgmesh: clock % is outside the snowflake range (2025 to 2059)', clock_timestamp()
      USING ERRCODE = 'PGMS1';
  END IF;
  RETURN (ms << 24) | (node << 14) | (nextval(seq) % 16384);
END
$body$;
