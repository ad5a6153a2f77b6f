-- The remote version of the transaction being applied, for the decision functions (decide.sql and
-- router.apply.decide's per-table functions): '<source LSN>|<source commit time>|<seen JSON>', set with
-- the transaction's origin set-up (router.apply.statements.setup_args). A link whose transactions have
-- met no conflict lately leaves it out (a transaction-local setting costs every commit a pass over the
-- server's settings on PostgreSQL 15): then it is empty here, this raises PGM03, and the applier sends
-- the batch again with it (router.apply.applier, router.errors.remote_version_missing). Never a decision
-- without it.
-- Created, or replaced when its text changed (a fingerprint of it in the function's comment), by
-- router/conflicts/catalog.py (install_conflict_catalog), which fills {schema} with pgmesh's schema,
-- quoted as an identifier.

CREATE OR REPLACE FUNCTION {schema}.remote_version() RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  remote text := pg_catalog.current_setting('pgmesh.remote', true);
BEGIN
  IF coalesce(remote, '') = '' THEN
    RAISE EXCEPTION 'pgmesh: a conflict needs the remote version, which this transaction did not set'
      USING ERRCODE = 'PGM03';
  END IF;
  RETURN remote;
END
$body$;
