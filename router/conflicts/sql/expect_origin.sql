-- Guard the applier's statements call: raises PGM01 when a row was last written by another origin.
-- Created, or replaced when its text changed (a fingerprint of it in the function's comment), by
-- router/conflicts/catalog.py (install_conflict_catalog), which fills {schema} with pgmesh's schema,
-- quoted as an identifier.

CREATE OR REPLACE FUNCTION {schema}.expect_origin(row_xmin xid, expected oid)
RETURNS boolean LANGUAGE plpgsql VOLATILE PARALLEL RESTRICTED AS $body$
DECLARE
  origin oid := (pg_catalog.pg_xact_commit_timestamp_origin(row_xmin)).roident;
BEGIN
  IF origin = expected THEN
    RETURN true;
  END IF;
  -- Not committed yet: a row this very transaction wrote (under the origin it applies for) is no
  -- conflict. Rows written in a subtransaction (a savepoint) are not recognised.
  IF origin IS NULL AND row_xmin = pg_catalog.xid(pg_catalog.pg_current_xact_id_if_assigned()) THEN
    RETURN true;
  END IF;
  -- A row from before pgmesh (commit time unknown, or older than pgmesh's installation here, which the
  -- applier sets as pgmesh.installed_at): the common starting point of every node, no conflict.
  IF origin IS NULL OR origin = 0 THEN
    IF pg_catalog.pg_xact_commit_timestamp(row_xmin) IS NULL
       OR pg_catalog.pg_xact_commit_timestamp(row_xmin) < coalesce(
            nullif(pg_catalog.current_setting('pgmesh.installed_at', true), ''), '-infinity')::timestamptz
    THEN
      RETURN true;
    END IF;
  END IF;
  RAISE EXCEPTION 'pgmesh: conflict, row last written by another origin' USING ERRCODE = 'PGM01',
    DETAIL = pg_catalog.format('row xmin %s: origin %s, committed at %s; expected origin %s', row_xmin,
      coalesce(origin::text, 'unknown'),
      coalesce(pg_catalog.pg_xact_commit_timestamp(row_xmin)::text, 'unknown'), expected);
END
$body$;
