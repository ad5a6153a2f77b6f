-- DDL capture, reading SQL text: ddl_split cuts a query string into its top-level statements as the server
-- does (quotes, dollar quotes, comments and BEGIN ATOMIC bodies respected); ddl_statements gives their
-- leading words, ddl_writes what in a string holding DDL writes rows, ddl_unstable the first function a
-- piece of SQL calls that is not immutable. Used by the event triggers' functions (capture.sql), installed
-- before them by router/ddl/capture.py (install_ddl_capture), which fills {schema} with pgmesh's schema,
-- quoted as an identifier. Statements end with a ';' at the end of a line outside $body$ quotes.

-- Each top-level statement of a query string, as the server splits it: `words`, its leading words (lower
-- case, at most four, joined by a space); `code`, its text with comments left out, each quoted string
-- written '' and each dollar-quoted one $$; `bodies`, what its dollar quotes held (a DO block's or a
-- function's body), one after the other. What stands in quotes, dollar quotes, quoted identifiers and
-- comments is skipped, and a ';' inside parentheses or inside the BEGIN ATOMIC ... END body of a CREATE
-- FUNCTION / PROCEDURE (counted as psql counts it) does not end a statement.
CREATE OR REPLACE FUNCTION {schema}.ddl_split(q text, OUT words text, OUT code text, OUT bodies text)
RETURNS SETOF record LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  ch text;
  chars text[] := string_to_array(coalesce(q, '') || E'\n', NULL);
  i int := 0;
  seg int := 1;
  dstart int := 0;
  ascii_code int;
  state text := 'code';
  prev text := '';
  word text := '';
  lw text;
  lead text[] := ARRAY[]::text[];
  delim text := '';
  tail text := '';
  nest int := 0;
  parens int := 0;
  depth int := 0;
  backslash boolean := current_setting('standard_conforming_strings') = 'off';
  escaping boolean := false;
BEGIN
  q := coalesce(q, '') || E'\n';
  code := '';
  bodies := '';
  FOREACH ch IN ARRAY chars LOOP
    i := i + 1;
    IF state = 'squote' THEN
      IF ch = '''' THEN
        state := 'squote_end';
      ELSIF ch = E'\\' AND escaping THEN
        state := 'squote_bs';
      END IF;
      CONTINUE;
    ELSIF state = 'squote_bs' THEN
      state := 'squote';
      CONTINUE;
    ELSIF state = 'squote_end' THEN
      IF ch = '''' THEN
        state := 'squote';
        CONTINUE;
      END IF;
      state := 'code';
      seg := i;
    ELSIF state = 'dquote' THEN
      IF ch = '"' THEN
        state := 'dquote_end';
      END IF;
      CONTINUE;
    ELSIF state = 'dquote_end' THEN
      IF ch = '"' THEN
        state := 'dquote';
        CONTINUE;
      END IF;
      state := 'code';
    ELSIF state = 'line' THEN
      IF ch IN (E'\n', E'\r') THEN
        state := 'code';
        seg := i;
      END IF;
      CONTINUE;
    ELSIF state = 'block' THEN
      IF prev = '*' AND ch = '/' THEN
        nest := nest - 1;
        ch := '';
        IF nest = 0 THEN
          state := 'code';
          seg := i + 1;
          code := code || ' ';
        END IF;
      ELSIF prev = '/' AND ch = '*' THEN
        nest := nest + 1;
        ch := '';
      END IF;
      prev := ch;
      CONTINUE;
    ELSIF state = 'dollar' THEN
      tail := right(tail || ch, length(delim));
      IF tail = delim THEN
        state := 'code';
        bodies := bodies || substr(q, dstart, i - length(delim) + 1 - dstart) || E'\n';
        seg := i + 1;
      END IF;
      CONTINUE;
    ELSIF state = 'dtag' THEN
      ascii_code := ascii(ch);
      IF ch = '$' THEN
        delim := delim || '$';
        tail := '';
        state := 'dollar';
        code := code || substr(q, seg, i - length(delim) + 1 - seg) || '$$';
        dstart := i + 1;
        CONTINUE;
      ELSIF ascii_code = 95 OR ascii_code BETWEEN 65 AND 90 OR ascii_code BETWEEN 97 AND 122
            OR ascii_code >= 128 OR ascii_code BETWEEN 48 AND 57 AND delim <> '$' THEN
        delim := delim || ch;
        CONTINUE;
      END IF;
      state := 'code';  -- not a dollar quote ($1, ...)
    END IF;
    -- code: outside quotes and comments
    ascii_code := ascii(ch);
    IF ascii_code = 95 OR ascii_code BETWEEN 65 AND 90 OR ascii_code BETWEEN 97 AND 122 OR ascii_code >= 128
       OR ascii_code BETWEEN 48 AND 57 OR ascii_code = 36 AND word <> '' THEN
      word := word || ch;
      prev := ch;
      CONTINUE;
    END IF;
    IF word <> '' THEN
      lw := lower(word);
      IF cardinality(lead) < 4 THEN
        lead := lead || lw;
      END IF;
      IF lead[1] = 'create' AND (lead[2] IN ('function', 'procedure')
           OR lead[2] = 'or' AND lead[3] = 'replace' AND lead[4] IN ('function', 'procedure'))
         AND parens = 0 THEN
        IF lw = 'begin' OR lw = 'case' AND depth > 0 THEN
          depth := depth + 1;
        ELSIF lw = 'end' AND depth > 0 THEN
          depth := depth - 1;
        END IF;
      END IF;
      escaping := backslash OR lw = 'e' AND ch = '''';
      word := '';
    ELSE
      escaping := backslash;
    END IF;
    IF ch = '''' THEN
      state := 'squote';
      code := code || substr(q, seg, i - seg) || '''''';
    ELSIF ch = '"' THEN
      state := 'dquote';
    ELSIF ch = '$' THEN
      state := 'dtag';
      delim := '$';
    ELSIF ch = '-' AND prev = '-' THEN
      state := 'line';
      code := code || substr(q, seg, i - 1 - seg);
      ch := '';
    ELSIF ch = '*' AND prev = '/' THEN
      state := 'block';
      code := code || substr(q, seg, i - 1 - seg);
      nest := 1;
      ch := '';
    ELSIF ch = '(' THEN
      parens := parens + 1;
    ELSIF ch = ')' THEN
      parens := greatest(parens - 1, 0);
    ELSIF ch = ';' AND parens = 0 AND depth = 0 THEN
      IF cardinality(lead) > 0 THEN
        words := array_to_string(lead, ' ');
        code := btrim(code || substr(q, seg, i - seg), E' \t\r\n');
        RETURN NEXT;
      END IF;
      lead := ARRAY[]::text[];
      code := '';
      bodies := '';
      seg := i + 1;
    END IF;
    prev := ch;
  END LOOP;
  IF cardinality(lead) > 0 THEN
    words := array_to_string(lead, ' ');
    code := btrim(code || CASE WHEN state = 'code' THEN substr(q, seg) ELSE '' END, E' \t\r\n');
    RETURN NEXT;
  END IF;
END
$body$;

-- The leading words of each top-level statement of a query string (ddl_split).
CREATE OR REPLACE FUNCTION {schema}.ddl_statements(q text) RETURNS SETOF text LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp AS $body$
  SELECT s.words FROM {schema}.ddl_split(q) s
$body$;

-- The first thing a piece of SQL (ddl_split's code: no comments, strings written '') calls whose
-- volatility is among `kinds` ('v' volatile, 's' stable), going by any function of that name: a name
-- before '(' (not a type after '::'); with 's', also the SQL value functions that read the clock or the
-- session (CURRENT_TIMESTAMP, LOCALTIME, CURRENT_USER, ...). NULL when there is none.
CREATE OR REPLACE FUNCTION {schema}.ddl_unstable(code text, kinds text) RETURNS text LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  m text[];
  fn text;
BEGIN
  IF strpos(kinds, 's') > 0 THEN
    m := regexp_match(code, '\m(current_timestamp|current_date|current_time|localtime|localtimestamp'
                            '|current_user|current_role|session_user|current_catalog|current_schema)\M', 'i');
    IF m IS NOT NULL THEN
      RETURN upper(m[1]);
    END IF;
  END IF;
  FOR m IN SELECT regexp_matches(code, '(::\s*)?(?:(?:[[:alpha:]_][[:alnum:]_$]*|"(?:[^"]|"")+")\s*\.\s*)?'
                                       '([[:alpha:]_][[:alnum:]_$]*|"(?:[^"]|"")+")\s*\(', 'g') LOOP
    CONTINUE WHEN m[1] IS NOT NULL;  -- a type modifier: '...'::timestamp(3)
    fn := CASE WHEN m[2] LIKE '"%' THEN replace(substr(m[2], 2, length(m[2]) - 2), '""', '"') ELSE lower(m[2]) END;
    IF EXISTS (SELECT 1 FROM pg_proc p WHERE p.proname = fn AND strpos(kinds, p.provolatile::text) > 0) THEN
      RETURN fn || '()';
    END IF;
  END LOOP;
  RETURN NULL;
END
$body$;

-- Whether one statement (ddl_split's code) writes rows the other nodes get as rows: INSERT, UPDATE,
-- DELETE, MERGE, TRUNCATE or COPY ... FROM into a table of pgmesh's publication (or a partition of one),
-- or into one that cannot be told (not there yet, made later in the string); CALL, WITH, EXECUTE, EXPLAIN
-- ANALYZE and a SELECT / VALUES calling a volatile function (other than set_config) may write anything.
-- A temporary, unlogged or excluded table's rows stay on each node: written again there, they are that
-- node's own. No SET clause: names resolve under the session's search_path.
CREATE OR REPLACE FUNCTION {schema}.ddl_written(words text, code text) RETURNS boolean LANGUAGE plpgsql STABLE
AS $body$
DECLARE
  name_re text := '((?:"(?:[^"]|"")+"|[[:alnum:]_$]+)(?:\s*\.\s*(?:"(?:[^"]|"")+"|[[:alnum:]_$]+))?)';
  m text[];
  rel regclass;
BEGIN
  IF words ~ '^(call|with|execute)\M' OR words ~ '^explain\M.*\manalyze\M' THEN
    RETURN true;
  ELSIF words ~ '^(select|values|table)\M' THEN
    RETURN {schema}.ddl_unstable(pg_catalog.regexp_replace(code, '\mset_config\s*\(', '(', 'gi'), 'v')
           IS NOT NULL;
  ELSIF words !~ '^(insert|update|delete|merge|copy|truncate)\M' THEN
    RETURN false;
  END IF;
  m := pg_catalog.regexp_match(code, '^(?:insert\s+into|update|delete\s+from|merge\s+into|truncate(?:\s+table)?|copy)'
                                     '(?:\s+only)?\s+' || name_re || '\s*(.*)$', 'i');
  IF m IS NULL OR words ~ '^truncate\M' AND m[2] ~ '^,' THEN
    RETURN true;
  ELSIF words ~ '^copy\M' AND m[2] ~* '^(\([^)]*\)\s*)?to\M' THEN
    RETURN false;  -- COPY ... TO reads
  END IF;
  rel := pg_catalog.to_regclass(m[1]);
  RETURN rel IS NULL OR EXISTS (
    SELECT 1 FROM pg_catalog.pg_publication_rel r JOIN pg_catalog.pg_publication p ON p.oid = r.prpubid
     WHERE p.pubname = {schema}.ddl_setting('publication')
       AND r.prrelid IN (rel, pg_catalog.pg_partition_root(rel)));
END
$body$;

-- What in a query string holding replicated DDL would write rows a second time where the other nodes
-- replay it (the capture records the whole string, current_query(), and the rows travel too): the leading
-- words of its first such statement (ddl_written), or NULL. Beside the DDL, or alone in a DO block's
-- body (the block runs again whole). SET, SHOW, RESET, LOCK, plain SELECTs and more DDL are harmless:
-- the string is replayed once. No SET clause: names resolve under the session's search_path.
CREATE OR REPLACE FUNCTION {schema}.ddl_writes(q text) RETURNS text LANGUAGE plpgsql STABLE AS $body$
DECLARE
  s record;
  b record;
  n int := 0;
  found text;
  m text[];
BEGIN
  FOR s IN SELECT * FROM {schema}.ddl_split(q) LOOP
    n := n + 1;
    IF s.words ~ '^do\M' THEN
      FOR b IN SELECT * FROM {schema}.ddl_split(s.bodies) LOOP
        m := pg_catalog.regexp_match(b.code, '(?:^|\m(?:begin|then|else|loop)\M)\s*'
                                             '((insert|update|delete|merge|truncate|copy|call)\M.*)$', 'i');
        IF m IS NOT NULL AND {schema}.ddl_written(pg_catalog.lower(m[2]), m[1]) THEN
          RETURN s.words || ' (a block that writes rows: ' || pg_catalog.lower(m[2]) || ')';
        END IF;
      END LOOP;
    END IF;
    IF found IS NULL AND {schema}.ddl_written(s.words, s.code) THEN
      found := s.words;
    END IF;
  END LOOP;
  RETURN CASE WHEN n > 1 THEN found END;
END
$body$;
