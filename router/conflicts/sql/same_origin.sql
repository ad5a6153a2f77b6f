-- The fast path's test of a row a remote UPDATE or DELETE meets: true when the row was last written by
-- the source (`expected`, its origin id here), by this very transaction, or before pgmesh (the common
-- starting point of every node). False otherwise: the statement then leaves the row and the applier's
-- decision function for its shape takes it (router.apply.decide), in the same round trip.
-- Created, or replaced when its text changed (a fingerprint of it in the function's comment), by
-- router/conflicts/catalog.py (install_conflict_catalog), which fills {schema} with pgmesh's schema,
-- quoted as an identifier.

CREATE OR REPLACE FUNCTION {schema}.same_origin(row_xmin xid, expected oid)
RETURNS boolean LANGUAGE plpgsql VOLATILE PARALLEL RESTRICTED AS $body$
DECLARE
  origin oid := (pg_catalog.pg_xact_commit_timestamp_origin(row_xmin)).roident;
  committed timestamptz;
BEGIN
  IF origin = expected THEN
    RETURN true;
  END IF;
  IF origin IS NULL AND row_xmin = pg_catalog.xid(pg_catalog.pg_current_xact_id_if_assigned()) THEN
    RETURN true;
  END IF;
  IF origin IS NULL OR origin = 0 THEN
    committed := pg_catalog.pg_xact_commit_timestamp(row_xmin);
    RETURN committed IS NULL OR committed < coalesce(
      nullif(pg_catalog.current_setting('pgmesh.installed_at', true), ''), '-infinity')::timestamptz;
  END IF;
  RETURN false;
END
$body$;
