-- Guard the applier's statements call: raises PGM02 when a statement matched another number of rows.
-- Created, or replaced when its text changed (a fingerprint of it in the function's comment), by
-- router/conflicts/catalog.py (install_conflict_catalog), which fills {schema} with pgmesh's schema,
-- quoted as an identifier.

CREATE OR REPLACE FUNCTION {schema}.expect_rows(got bigint, wanted bigint) RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $body$
BEGIN
  IF got IS DISTINCT FROM wanted THEN
    RAISE EXCEPTION 'pgmesh: conflict, % of % rows matched', got, wanted USING ERRCODE = 'PGM02';
  END IF;
END
$body$;
