-- Trigger function of pgmesh_given_up (BEFORE UPDATE OR DELETE, enabled ALWAYS) and pgmesh_given_up_claim
-- (AFTER INSERT OR UPDATE, enabled REPLICA), FOR EACH ROW, on every replicated table with a unique key
-- besides its tombstone key (given_up_ensure.sql, router/conflicts/given_up.py):
-- 1. before a DELETE, or an UPDATE that changes a secondary unique value (or the row's key), it records
--    each value the row gives up in given_up, with the transaction that wrote the row's old version (its
--    xmin, as xid8): the version that held it;
-- 2. after a replicated INSERT or UPDATE (an applier session: pgmesh.source set, not the careful path:
--    pgmesh.careful unset) that claims a value (past the unique index: a transaction giving the value up
--    meanwhile has committed), under the value's advisory lock, it raises PGM01 when another row gave the
--    value up at a version not older than the claim's (or at any known version, when the transaction does
--    not carry its remote version, pgmesh.remote): the careful path decides it
--    (router.apply.careful.transaction).
-- TG_ARGV: the number n of key columns, the n key columns (the tombstone key), then per secondary unique
-- key three arguments: its name (router.conflicts.given_up.unique_name), its terms each cast to text (SQL
-- over the row's columns, unqualified) and its predicate (SQL, 'true' for none). Values are text under the
-- tombstone settings, as the applier's sessions make them.
-- Created, or replaced when its text changed, by router/conflicts/catalog.py (install_conflict_catalog),
-- which fills {schema} with pgmesh's schema, quoted as an identifier.

CREATE OR REPLACE FUNCTION {schema}.give_up() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET TimeZone = 'UTC' SET DateStyle = 'ISO, YMD' SET IntervalStyle = 'postgres' SET extra_float_digits = 3
SET bytea_output = 'hex' SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  root oid := pg_catalog.pg_partition_root(TG_RELID);
  qualified text := TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME;
  n int := TG_ARGV[0]::int;
  keys text := (SELECT pg_catalog.string_agg(pg_catalog.format('($1).%I::text', TG_ARGV[i]), ', ' ORDER BY i)
                  FROM pg_catalog.generate_series(1, n) AS i);
  recording boolean := TG_WHEN = 'BEFORE' AND TG_OP <> 'INSERT';
  claiming boolean := TG_WHEN = 'AFTER' AND TG_OP <> 'DELETE'
    AND pg_catalog.current_setting('session_replication_role') = 'replica'
    AND coalesce(pg_catalog.current_setting('pgmesh.source', true), '') <> ''
    AND coalesce(pg_catalog.current_setting('pgmesh.careful', true), '') <> 'y';
  old_key text[];
  new_key text[];
  old_value text[];
  new_value text[];
  held xid8;
  held_at timestamptz;
  i int;
BEGIN
  IF NOT recording AND NOT claiming THEN
    RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
  END IF;
  IF root IS NOT NULL AND root <> TG_RELID THEN  -- a partition: under the root's name, as tombstones
    SELECT nm.nspname || '.' || c.relname INTO qualified
      FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace nm ON nm.oid = c.relnamespace
     WHERE c.oid = root;
  END IF;
  IF TG_OP <> 'INSERT' THEN
    EXECUTE 'SELECT ARRAY[' || keys || ']::text[]' INTO old_key USING OLD;
  END IF;
  IF TG_OP <> 'DELETE' THEN
    EXECUTE 'SELECT ARRAY[' || keys || ']::text[]' INTO new_key USING NEW;
  END IF;
  FOR i IN 0 .. (pg_catalog.array_length(TG_ARGV, 1) - 1 - n) / 3 - 1 LOOP
    old_value := NULL;
    new_value := NULL;
    IF TG_OP <> 'INSERT' THEN
      EXECUTE pg_catalog.format('SELECT ARRAY[%s]::text[] FROM (SELECT ($1).*) AS pgmesh_s WHERE (%s)',
                                TG_ARGV[n + 2 + 3 * i], TG_ARGV[n + 3 + 3 * i])
         INTO old_value USING OLD;
      IF pg_catalog.array_position(old_value, NULL) IS NOT NULL THEN
        old_value := NULL;  -- a NULL term: no unique value held
      END IF;
    END IF;
    IF TG_OP <> 'DELETE' THEN
      EXECUTE pg_catalog.format('SELECT ARRAY[%s]::text[] FROM (SELECT ($1).*) AS pgmesh_s WHERE (%s)',
                                TG_ARGV[n + 2 + 3 * i], TG_ARGV[n + 3 + 3 * i])
         INTO new_value USING NEW;
      IF pg_catalog.array_position(new_value, NULL) IS NOT NULL THEN
        new_value := NULL;
      END IF;
    END IF;
    IF recording AND old_value IS NOT NULL AND (TG_OP = 'DELETE' OR old_value IS DISTINCT FROM new_value
                                  OR old_key IS DISTINCT FROM new_key) THEN
      IF held IS NULL THEN  -- the old version's transaction: the row as this statement found it
        EXECUTE pg_catalog.format('SELECT (pg_catalog.pg_current_xact_id()::text::int8'
            ' - ((pg_catalog.pg_current_xact_id()::text::int8 %% 4294967296) - t.xmin::text::int8'
            ' + 4294967296) %% 4294967296)::text::xid8 FROM ONLY %I.%I AS t WHERE (%s) = (%s)',
            TG_TABLE_SCHEMA, TG_TABLE_NAME,
            (SELECT pg_catalog.string_agg(pg_catalog.format('t.%I', TG_ARGV[k]), ', ' ORDER BY k)
               FROM pg_catalog.generate_series(1, n) AS k),
            (SELECT pg_catalog.string_agg(pg_catalog.format('($1).%I', TG_ARGV[k]), ', ' ORDER BY k)
               FROM pg_catalog.generate_series(1, n) AS k))
          INTO held USING OLD;
      END IF;
      -- (written by this very transaction: the value was never held outside it)
      IF held IS NOT NULL AND held <> pg_catalog.pg_current_xact_id() THEN
        INSERT INTO {schema}.given_up AS g (table_name, unique_key, value, key, xid)
        VALUES (qualified, TG_ARGV[n + 1 + 3 * i], old_value::text, old_key::text, held)
        ON CONFLICT (table_name, unique_key, pg_catalog.md5(value), pg_catalog.md5(key))
        DO UPDATE SET xid = excluded.xid;
      END IF;
    END IF;
    IF claiming AND new_value IS NOT NULL AND (TG_OP = 'INSERT' OR new_value IS DISTINCT FROM old_value
                                                OR old_key IS DISTINCT FROM new_key) THEN
      -- one claim or record of a value at a time (the careful path takes the same lock,
      -- router.conflicts.given_up.VALUE_LOCK_SQL): a record written meanwhile is seen here, or this row
      -- there
      PERFORM pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended(
        'pgmesh given up:' || qualified || ':' || TG_ARGV[n + 1 + 3 * i] || ':' || new_value::text, 0));
      SELECT max(pg_catalog.pg_xact_commit_timestamp(pg_catalog.xid(g.xid))) INTO held_at
        FROM {schema}.given_up AS g
       WHERE g.table_name = qualified AND g.unique_key = TG_ARGV[n + 1 + 3 * i]
         AND pg_catalog.md5(g.value) = pg_catalog.md5(new_value::text) AND g.value = new_value::text
         AND g.key <> new_key::text;
      -- (the remote version, when the transaction carries it: an older hold is no matter; without it, the
      -- careful path decides)
      IF held_at IS NOT NULL AND held_at >= coalesce(pg_catalog.split_part(
           nullif(pg_catalog.current_setting('pgmesh.remote', true), ''), '|', 2)::timestamptz, '-infinity')
      THEN
        RAISE EXCEPTION 'pgmesh: % claims a unique value another row gave up at a later version', qualified
          USING ERRCODE = 'PGM01';
      END IF;
    END IF;
  END LOOP;
  RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
END
$body$;
