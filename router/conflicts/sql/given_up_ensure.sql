-- Puts the given-up triggers (give_up.sql) on one replicated table, with the arguments its unique keys
-- give now, or takes them away from a table without a unique key besides `key` (its tombstone key); both
-- re-created when the arguments changed: pgmesh_given_up (BEFORE UPDATE OR DELETE, ALWAYS: the
-- application's deletes and updates record what they give up) and pgmesh_given_up_claim (AFTER INSERT OR
-- UPDATE, REPLICA: the appliers' claims are checked). A unique key is named by the JSON text of its
-- columns (a plain key) or of its terms and predicate (an index with a predicate or on expressions), as
-- router.conflicts.given_up names it from the applier's view of the table. Returns what it did (NULL:
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
BEGIN
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
  SELECT t.tgargs INTO had FROM pg_catalog.pg_trigger t
   WHERE t.tgrelid = rel AND t.tgname = 'pgmesh_given_up' AND t.tgparentid = 0
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
                            ' FOR EACH ROW EXECUTE FUNCTION {schema}.give_up(%s)', nsp, tab,
                            (SELECT pg_catalog.string_agg(pg_catalog.quote_literal(a), ', ' ORDER BY o)
                               FROM pg_catalog.unnest(args) WITH ORDINALITY AS t(a, o)));
  EXECUTE pg_catalog.format('ALTER TABLE %I.%I ENABLE ALWAYS TRIGGER pgmesh_given_up', nsp, tab);
  EXECUTE pg_catalog.format('CREATE TRIGGER pgmesh_given_up_claim AFTER INSERT OR UPDATE ON %I.%I'
                            ' FOR EACH ROW EXECUTE FUNCTION {schema}.give_up(%s)', nsp, tab,
                            (SELECT pg_catalog.string_agg(pg_catalog.quote_literal(a), ', ' ORDER BY o)
                               FROM pg_catalog.unnest(args) WITH ORDINALITY AS t(a, o)));
  EXECUTE pg_catalog.format('ALTER TABLE %I.%I ENABLE REPLICA TRIGGER pgmesh_given_up_claim', nsp, tab);
  RETURN pg_catalog.format('%s given-up trigger on %s.%s (%s unique keys)',
                           CASE WHEN had IS NULL THEN 'created' ELSE 're-created' END, nsp, tab, uniques);
END
$body$;
