-- DDL made by a superuser, replayed on this node by a router that runs as a role without superuser
-- (docs/security.md): such a role can never SET ROLE to a superuser, so the applier calls this function,
-- owned by the superuser that installed pgmesh here, and the command runs as that superuser: what it
-- creates is owned by it, as on the source. Installed by router/cluster/install.py with {schema} filled
-- (quoted); EXECUTE is revoked from PUBLIC and granted only to the router's role (router/cluster/grants.py).
-- Only inside an applied transaction (a replication origin set up), only for the role that owns it: DDL
-- of another superuser would come out owned by the wrong role, so it is refused, loudly.
-- Runs under the caller's search_path (the source's, set by the applier), as the replayed command must.
CREATE OR REPLACE FUNCTION {schema}.ddl_as_owner(author name, command text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER AS $body$
BEGIN
  IF NOT pg_catalog.pg_replication_origin_session_is_setup() THEN
    RAISE EXCEPTION 'pgmesh: ddl_as_owner runs only DDL replayed by the router (no replication origin is set up)'
      USING ERRCODE = '42501';
  END IF;
  IF author IS DISTINCT FROM CURRENT_USER THEN
    RAISE EXCEPTION 'pgmesh: DDL made by superuser % cannot be replayed as % on this node: the router''s role '
                    'is not a superuser, and pgmesh replays superusers'' DDL only as %, the owner of '
                    'pgmesh.ddl_as_owner', author, author, CURRENT_USER
      USING ERRCODE = '42501',
            HINT = pg_catalog.format('make such changes as %I (or as an application role), or run the router '
                                     'as a superuser; then pgmesh resume', CURRENT_USER);
  END IF;
  EXECUTE command;
END
$body$;

REVOKE ALL ON FUNCTION {schema}.ddl_as_owner(name, text) FROM PUBLIC;

-- The router replays pgmesh.ddl messages (router/ddl/messages.py) as the role they name; any session could
-- write one with pg_logical_emit_message, naming any role (a superuser: the command would run as one on
-- every other node). So on a pgmesh node only superusers, pgmesh's ddl_emit (which names only a role
-- its session may be) and the roles granted it (the router's: router/cluster/grants.py) may write messages.
DO $body$
DECLARE
  f regprocedure;
BEGIN
  FOR f IN SELECT oid::regprocedure FROM pg_catalog.pg_proc
            WHERE pronamespace = 'pg_catalog'::regnamespace AND proname = 'pg_logical_emit_message' LOOP
    EXECUTE pg_catalog.format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
  END LOOP;
END
$body$;
