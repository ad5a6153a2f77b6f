-- Puts the given-up triggers on one replicated table, with the arguments its unique keys give now, or
-- takes them away from a table without a unique key besides `key` (its tombstone key); both re-created
-- when the arguments changed: pgmesh_given_up (BEFORE UPDATE OR DELETE, ALWAYS) and pgmesh_given_up_claim
-- (AFTER INSERT OR UPDATE, REPLICA). Both run pgmesh.give_up_<table oid>(), made here for this table from
-- those arguments (static SQL: no EXECUTE per row):
-- 1. before a DELETE, or an UPDATE that changes a secondary unique value (or the row's key), it records
--    each value the row gives up in given_up, with the transaction that wrote the row's old version (its
--    xmin, as xid8, read by key): the version that held it; not a value held only inside this transaction;
-- 2. after a replicated INSERT or UPDATE (an applier session: pgmesh.source set, not the careful path:
--    pgmesh.careful unset) that claims a value (past the unique index: a transaction giving the value up
--    meanwhile has committed), under the value's advisory lock (router.conflicts.given_up.VALUE_LOCK_SQL),
--    it raises PGM01 when another row gave the value up at a version not older than the claim's (at any
--    known version, when the transaction does not carry its remote version, pgmesh.remote): the careful
--    path decides it (router.apply.careful.transaction).
-- The arguments: the number n of key columns, the n key columns, then per secondary unique key its name
-- (the JSON text of its columns, a plain key, or of its terms and predicate, an index with a predicate or
-- on expressions: as router.conflicts.given_up names it from the applier's view of the table), its terms
-- each cast to text (SQL over the row's columns, unqualified) and its predicate ('true' for none). Values
-- are text under the tombstone settings, as the applier's sessions make them. Returns what it did (NULL:
-- nothing). Called by router/conflicts/catalog.py for every replicated table, by ddl_table
-- (router/ddl/sql/capture.sql) after DDL and by given_up_index.sql after index DDL.
-- Created, or replaced when its text changed, by router/conflicts/catalog.py (install_conflict_catalog),
-- which fills {schema} with pgmesh's schema, quoted as an identifier.

CREATE OR REPLACE FUNCTION {schema}.given_up_ensure(rel oid, key text[]) RETURNS text LANGUAGE plpgsql AS $body$
DECLARE
  nsp text;
  tab text;
  args text[] := ARRAY[pg_catalog.cardinality(key)::text] || key;
  uniques int := 0;
  had bytea;
  want bytea;
  ix record;
  n int := pg_catalog.cardinality(key);
  fn text := 'give_up_' || rel::text;  -- this table's trigger function (static SQL: no EXECUTE per row)
  src text;
  had_src text;
  blocks text := '';
  i int;
BEGIN
  IF (SELECT c.relispartition FROM pg_catalog.pg_class c WHERE c.oid = rel) THEN
    RETURN NULL;  -- a partition has its root's triggers (cloned), whose function names the root
  END IF;
  SELECT n.nspname, c.relname INTO nsp, tab
    FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = rel;
  FOR ix IN SELECT i.indexrelid, i.indrelid, i.indpred, i.indexprs, i.indnkeyatts,
                   ARRAY(SELECT a.attname::text
                           FROM pg_catalog.unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
                           JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                          ORDER BY k.ord) AS columns
              FROM pg_catalog.pg_index i
             WHERE i.indrelid = rel AND i.indisunique AND NOT i.indisprimary ORDER BY i.indexrelid LOOP
    IF ix.indpred IS NULL AND ix.indexprs IS NULL THEN
      CONTINUE WHEN ix.columns <@ key;  -- the tombstone key itself (a replica identity index)
      args := args || pg_catalog.to_jsonb(ix.columns)::text
                   || (SELECT pg_catalog.string_agg(pg_catalog.format('(%I)::text', c), ', ' ORDER BY o)
                         FROM pg_catalog.unnest(ix.columns) WITH ORDINALITY AS t(c, o))
                   || 'true'::text;
    ELSE
      args := args || pg_catalog.to_jsonb(ARRAY(
                        SELECT pg_catalog.pg_get_indexdef(ix.indexrelid, k, true)
                          FROM pg_catalog.generate_series(1, ix.indnkeyatts) AS k ORDER BY k)
                        || pg_catalog.pg_get_expr(ix.indpred, ix.indrelid, true))::text
                   || (SELECT pg_catalog.string_agg('(' || pg_catalog.pg_get_indexdef(ix.indexrelid, k, true)
                                                    || ')::text', ', ' ORDER BY k)
                         FROM pg_catalog.generate_series(1, ix.indnkeyatts) AS k)
                   || coalesce(pg_catalog.pg_get_expr(ix.indpred, ix.indrelid, true), 'true');
    END IF;
    uniques := uniques + 1;
  END LOOP;
  FOR i IN 0 .. uniques - 1 LOOP
    blocks := blocks || pg_catalog.format($b$
  old_value := NULL;
  new_value := NULL;
  IF TG_OP <> 'INSERT' THEN
    old_value := (SELECT ARRAY[%2$s]::text[] FROM (SELECT OLD.*) AS pgmesh_s WHERE (%3$s));
    IF pg_catalog.array_position(old_value, NULL) IS NOT NULL THEN old_value := NULL; END IF;
  END IF;
  IF TG_OP <> 'DELETE' THEN
    new_value := (SELECT ARRAY[%2$s]::text[] FROM (SELECT NEW.*) AS pgmesh_s WHERE (%3$s));
    IF pg_catalog.array_position(new_value, NULL) IS NOT NULL THEN new_value := NULL; END IF;
  END IF;
  IF TG_WHEN = 'BEFORE' AND old_value IS NOT NULL
     AND (TG_OP = 'DELETE' OR old_value IS DISTINCT FROM new_value OR old_key IS DISTINCT FROM new_key) THEN
    IF held IS NULL THEN
      held := (SELECT (pg_catalog.pg_current_xact_id()::text::int8 - ((pg_catalog.pg_current_xact_id()::text::int8
                 %% 4294967296) - pgmesh_o.xmin::text::int8 + 4294967296) %% 4294967296)::text::xid8
                 FROM %4$s AS pgmesh_o WHERE (%5$s) = (%6$s));
    END IF;
    IF held IS NOT NULL AND held <> pg_catalog.pg_current_xact_id() THEN
      INSERT INTO {schema}.given_up AS g (table_name, unique_key, value, key, xid)
      VALUES (%7$L, %1$L, old_value::text, old_key::text, held)
      ON CONFLICT (table_name, unique_key, pg_catalog.md5(value), pg_catalog.md5(key)) DO UPDATE SET xid = excluded.xid;
    END IF;
  END IF;
  IF claiming AND new_value IS NOT NULL
     AND (TG_OP = 'INSERT' OR new_value IS DISTINCT FROM old_value OR old_key IS DISTINCT FROM new_key) THEN
    PERFORM pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended(
      'pgmesh given up:' || %7$L || ':' || %1$L || ':' || new_value::text, 0));
    held_at := (SELECT max(pg_catalog.pg_xact_commit_timestamp(pg_catalog.xid(g.xid))) FROM {schema}.given_up AS g
                 WHERE g.table_name = %7$L AND g.unique_key = %1$L
                   AND pg_catalog.md5(g.value) = pg_catalog.md5(new_value::text) AND g.value = new_value::text
                   AND g.key <> new_key::text);
    IF held_at IS NOT NULL AND held_at >= coalesce(pg_catalog.split_part(
         nullif(pg_catalog.current_setting('pgmesh.remote', true), ''), '|', 2)::timestamptz, '-infinity') THEN
      RAISE EXCEPTION 'pgmesh: %% claims a unique value another row gave up at a later version', %7$L
        USING ERRCODE = 'PGM01';
    END IF;
  END IF;
$b$, args[n + 2 + 3 * i], args[n + 3 + 3 * i], args[n + 4 + 3 * i],
      pg_catalog.format('%I.%I', nsp, tab),
      (SELECT pg_catalog.string_agg(pg_catalog.format('pgmesh_o.%I', c), ', ' ORDER BY o)
         FROM pg_catalog.unnest(key) WITH ORDINALITY AS k(c, o)),
      (SELECT pg_catalog.string_agg(pg_catalog.format('OLD.%I', c), ', ' ORDER BY o)
         FROM pg_catalog.unnest(key) WITH ORDINALITY AS k(c, o)),
      nsp || '.' || tab);
  END LOOP;
  src := pg_catalog.format($f$
#variable_conflict use_column
DECLARE
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
BEGIN
  IF TG_WHEN = 'AFTER' AND NOT claiming THEN
    RETURN NULL;
  END IF;
  IF TG_OP <> 'INSERT' THEN
    old_key := ARRAY[%1$s]::text[];
  END IF;
  IF TG_OP <> 'DELETE' THEN
    new_key := ARRAY[%2$s]::text[];
  END IF;
%3$s
  RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
END
$f$, (SELECT pg_catalog.string_agg(pg_catalog.format('(OLD.%I)::text', c), ', ' ORDER BY o)
        FROM pg_catalog.unnest(key) WITH ORDINALITY AS k(c, o)),
     (SELECT pg_catalog.string_agg(pg_catalog.format('(NEW.%I)::text', c), ', ' ORDER BY o)
        FROM pg_catalog.unnest(key) WITH ORDINALITY AS k(c, o)), blocks);
  SELECT p.prosrc INTO had_src FROM pg_catalog.pg_proc p
   WHERE p.oid = pg_catalog.to_regprocedure('{schema}.' || pg_catalog.quote_ident(fn) || '()');
  IF uniques > 0 AND had_src IS DISTINCT FROM src THEN
    EXECUTE pg_catalog.format('CREATE OR REPLACE FUNCTION {schema}.%I() RETURNS trigger LANGUAGE plpgsql'
      ' SECURITY DEFINER SET TimeZone = %L SET DateStyle = %L SET IntervalStyle = %L SET extra_float_digits = 3'
      ' SET bytea_output = %L SET search_path = pg_catalog, pg_temp AS %L',
      fn, 'UTC', 'ISO, YMD', 'postgres', 'hex', src);
    had := NULL;  -- the triggers are made again below
  END IF;
  SELECT t.tgargs INTO had FROM pg_catalog.pg_trigger t
   WHERE had_src IS NOT DISTINCT FROM src
     AND t.tgrelid = rel AND t.tgname = 'pgmesh_given_up' AND t.tgparentid = 0
     AND EXISTS (SELECT 1 FROM pg_catalog.pg_trigger c WHERE c.tgrelid = rel AND c.tgparentid = 0
                    AND c.tgname = 'pgmesh_given_up_claim' AND c.tgargs = t.tgargs);
  IF uniques = 0 THEN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t WHERE t.tgrelid = rel AND t.tgparentid = 0
                    AND t.tgname IN ('pgmesh_given_up', 'pgmesh_given_up_claim')) THEN
      RETURN NULL;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t WHERE t.tgrelid = rel AND t.tgparentid = 0
                AND t.tgname = 'pgmesh_given_up') THEN
      EXECUTE pg_catalog.format('DROP TRIGGER pgmesh_given_up ON %I.%I', nsp, tab);
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t WHERE t.tgrelid = rel AND t.tgparentid = 0
                AND t.tgname = 'pgmesh_given_up_claim') THEN
      EXECUTE pg_catalog.format('DROP TRIGGER pgmesh_given_up_claim ON %I.%I', nsp, tab);
    END IF;
    RETURN pg_catalog.format('dropped given-up triggers from %s.%s (no unique key besides its key)', nsp, tab);
  END IF;
  SELECT pg_catalog.string_agg(pg_catalog.convert_to(a, 'UTF8') || '\x00'::bytea, ''::bytea ORDER BY o)
    INTO want FROM pg_catalog.unnest(args) WITH ORDINALITY AS t(a, o);
  IF had IS NOT DISTINCT FROM want THEN
    RETURN NULL;
  END IF;
  IF EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t WHERE t.tgrelid = rel AND t.tgparentid = 0
              AND t.tgname = 'pgmesh_given_up') THEN
    EXECUTE pg_catalog.format('DROP TRIGGER pgmesh_given_up ON %I.%I', nsp, tab);
  END IF;
  IF EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t WHERE t.tgrelid = rel AND t.tgparentid = 0
              AND t.tgname = 'pgmesh_given_up_claim') THEN
    EXECUTE pg_catalog.format('DROP TRIGGER pgmesh_given_up_claim ON %I.%I', nsp, tab);
  END IF;
  EXECUTE pg_catalog.format('CREATE TRIGGER pgmesh_given_up BEFORE UPDATE OR DELETE ON %I.%I'
                            ' FOR EACH ROW EXECUTE FUNCTION {schema}.%I(%s)', nsp, tab, fn,
                            (SELECT pg_catalog.string_agg(pg_catalog.quote_literal(a), ', ' ORDER BY o)
                               FROM pg_catalog.unnest(args) WITH ORDINALITY AS t(a, o)));
  EXECUTE pg_catalog.format('ALTER TABLE %I.%I ENABLE ALWAYS TRIGGER pgmesh_given_up', nsp, tab);
  EXECUTE pg_catalog.format('CREATE TRIGGER pgmesh_given_up_claim AFTER INSERT OR UPDATE ON %I.%I'
                            ' FOR EACH ROW EXECUTE FUNCTION {schema}.%I(%s)', nsp, tab, fn,
                            (SELECT pg_catalog.string_agg(pg_catalog.quote_literal(a), ', ' ORDER BY o)
                               FROM pg_catalog.unnest(args) WITH ORDINALITY AS t(a, o)));
  EXECUTE pg_catalog.format('ALTER TABLE %I.%I ENABLE REPLICA TRIGGER pgmesh_given_up_claim', nsp, tab);
  RETURN pg_catalog.format('%s given-up trigger on %s.%s (%s unique keys)',
                           CASE WHEN had IS NULL THEN 'created' ELSE 're-created' END, nsp, tab, uniques);
END
$body$;
