-- DDL capture: the functions behind pgmesh's event triggers (ddl_capture on ddl_command_end, ddl_dropped
-- on sql_drop, ddl_refuse on ddl_command_start) and what they call. ddl_capture writes each replicated
-- command as a transactional logical message with prefix 'pgmesh.ddl' (its JSON: router/ddl/messages.py);
-- ddl_table puts a new or altered table of the replicated set into the publication with its tombstone
-- trigger; ddl_refuse, ddl_refuse_writes, ddl_filled and ddl_enum_grew refuse, where the command is typed,
-- what could not be replayed or would leave the nodes apart (reading SQL text with sql/statements.sql).
-- Installed (CREATE OR REPLACE, in order) by router/ddl/capture.py (install_ddl_capture), which
-- fills {schema} with pgmesh's schema, quoted as an identifier; the triggers' settings are rows 'ddl.*'
-- of {schema}.node_info. Statements end with a ';' at the end of a line outside $body$ quotes.

CREATE OR REPLACE FUNCTION {schema}.ddl_setting(name text) RETURNS text LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $body$
  SELECT value FROM {schema}.node_info WHERE key = 'ddl.' || name
$body$;

CREATE OR REPLACE FUNCTION {schema}.ddl_applying() RETURNS boolean LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $body$
  SELECT pg_catalog.pg_replication_origin_session_is_setup()
$body$;

-- The message's content is UTF-8 whatever the database's encoding (the text variant would carry the
-- server's bytes: LATIN1 on a LATIN1 database), as the router reads it. Every role may call this (the
-- capture runs as the session's role), and the router replays the command as the role the message
-- names (router/apply/link.py): so it names only a role this session may be (its login role, a role
-- that role is a member of, any for a superuser), else it is refused. pg_logical_emit_message itself
-- is not PUBLIC's on a pgmesh node (router/cluster/sql/ddl_as_owner.sql).
CREATE OR REPLACE FUNCTION {schema}.ddl_emit(content text) RETURNS void LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  author text := content::json ->> 'role';
BEGIN
  IF author IS DISTINCT FROM session_user::text
     AND NOT (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = session_user)
     AND (author IS NULL OR NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = author)
          OR NOT pg_catalog.pg_has_role(session_user, author, 'MEMBER')) THEN
    RAISE EXCEPTION 'pgmesh: DDL recorded as role % refused: session role % may not act as it', author,
                    session_user
      USING ERRCODE = '42501',
            HINT = 'the other nodes replay DDL as the role that ran it: run it as a role this login may '
                   'SET ROLE to (SECURITY DEFINER functions of other owners included)';
  END IF;
  PERFORM pg_catalog.pg_logical_emit_message(true, 'pgmesh.ddl', pg_catalog.convert_to(content, 'UTF8'));
END
$body$;

-- Note that this node's schema changed (router/apply/applier.py reads it: SCHEMA_CHANGES in capture.py).
CREATE OR REPLACE FUNCTION {schema}.ddl_changed() RETURNS void LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $body$
  SELECT NULL::void FROM pg_catalog.nextval('{schema}.schema_changes')
$body$;

-- TRUNCATE of one partition. The publication publishes via the partition root, and pgoutput then sends
-- a TRUNCATE only for the roots it names: one of a partition alone (or of a partitioned partition) never
-- reaches the other nodes. So every partition (relkind 'r') of a published partitioned table has the
-- statement trigger pgmesh_truncate (BEFORE TRUNCATE), which writes `TRUNCATE ONLY partition CASCADE`
-- as a command message ('pgmesh.ddl', tag TRUNCATE), replayed at its place like DDL. The root has
-- pgmesh_truncate_start / _end (BEFORE / AFTER TRUNCATE, argument 'root'), marking in the transaction
-- the statement that truncates the root: pgoutput carries that one, and its partitions write nothing.
-- CASCADE: the source's TRUNCATE succeeded, so every table referencing the partition was truncated there
-- too. Nothing for sessions applying changes (an origin set up; the router's also run with
-- session_replication_role = replica, where these triggers do not fire).
CREATE OR REPLACE FUNCTION {schema}.truncate_capture() RETURNS trigger LANGUAGE plpgsql AS $body$
DECLARE
  marks text := coalesce(pg_catalog.current_setting('pgmesh.truncating', true), '');
  root oid;
BEGIN
  IF {schema}.ddl_applying() THEN
    RETURN NULL;
  END IF;
  IF tg_nargs > 0 AND tg_argv[0] = 'root' THEN
    IF marks = '' THEN
      marks := ',';
    END IF;
    IF tg_when = 'BEFORE' THEN
      marks := marks || tg_relid::text || ',';
    ELSE
      marks := pg_catalog.replace(marks, ',' || tg_relid::text || ',', ',');
    END IF;
    PERFORM pg_catalog.set_config('pgmesh.truncating', marks, true);
    RETURN NULL;
  END IF;
  root := pg_catalog.pg_partition_root(tg_relid);
  IF root IS NULL OR root = tg_relid OR pg_catalog.strpos(marks, ',' || root::text || ',') > 0 THEN
    RETURN NULL;  -- detached (a table of its own now), or its root is truncated by this statement
  END IF;
  IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication_rel r
                   JOIN pg_catalog.pg_publication p ON p.oid = r.prpubid
                  WHERE p.pubname = {schema}.ddl_setting('publication') AND r.prrelid = root) THEN
    RETURN NULL;
  END IF;
  -- replayed through truncate_partition: a node that partitions the root otherwise has no such partition,
  -- and deletes the rows of this partition's bounds from the root instead
  PERFORM {schema}.ddl_emit(pg_catalog.json_build_object(
    'sql', pg_catalog.format('SELECT {schema}.truncate_partition(%L, %L, %L, %L, %L)',
                             tg_table_schema, tg_table_name,
                             (SELECT n.nspname FROM pg_catalog.pg_class c
                                JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = root),
                             (SELECT c.relname FROM pg_catalog.pg_class c WHERE c.oid = root),
                             pg_catalog.pg_get_partition_constraintdef(tg_relid)),
    'search_path', pg_catalog.current_setting('search_path'), 'role', current_user,
    'tag', 'TRUNCATE')::text);
  RETURN NULL;
END
$body$;

-- A partition's TRUNCATE replayed from another node (truncate_capture): TRUNCATE ONLY ... CASCADE of the
-- partition of that name under the same root; a node that has none (it partitions the root otherwise)
-- deletes from the root the rows within the partition's bounds on the source (`bounds`, the source's
-- pg_get_partition_constraintdef, an expression on the root's columns).
CREATE OR REPLACE FUNCTION {schema}.truncate_partition(part_schema text, part_name text, root_schema text,
                                                       root_name text, bounds text) RETURNS void
LANGUAGE plpgsql AS $body$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = part_schema AND c.relname = part_name AND c.relispartition
                AND pg_catalog.pg_partition_root(c.oid)
                    = pg_catalog.to_regclass(pg_catalog.format('%I.%I', root_schema, root_name))) THEN
    EXECUTE pg_catalog.format('TRUNCATE ONLY %I.%I CASCADE', part_schema, part_name);
  ELSE
    EXECUTE pg_catalog.format('DELETE FROM %I.%I WHERE %s', root_schema, root_name,
                              coalesce(bounds, 'true'));
  END IF;
END
$body$;

-- The TRUNCATE triggers on a published partitioned table (or a partition of one) and everything under
-- it; idempotent, so installing them again on every ALTER of the root is cheap.
CREATE OR REPLACE FUNCTION {schema}.truncate_triggers(rel oid) RETURNS void LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  t record;
  wanted text[];
  trig text;
BEGIN
  FOR t IN SELECT c.oid, c.relkind, c.relispartition, n.nspname, c.relname
             FROM pg_partition_tree(rel) p JOIN pg_class c ON c.oid = p.relid
             JOIN pg_namespace n ON n.oid = c.relnamespace LOOP
    IF t.relkind = 'r' AND t.relispartition THEN
      wanted := ARRAY['pgmesh_truncate'];
    ELSIF t.relkind = 'p' AND NOT t.relispartition THEN
      wanted := ARRAY['pgmesh_truncate_start', 'pgmesh_truncate_end'];
    ELSE
      CONTINUE;
    END IF;
    FOREACH trig IN ARRAY wanted LOOP
      CONTINUE WHEN EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = t.oid AND tgname = trig);
      EXECUTE format('CREATE TRIGGER %I %s TRUNCATE ON %I.%I FOR EACH STATEMENT '
                     'EXECUTE FUNCTION {schema}.truncate_capture(%s)', trig,
                     CASE WHEN trig = 'pgmesh_truncate_end' THEN 'AFTER' ELSE 'BEFORE' END,
                     t.nspname, t.relname, CASE WHEN trig = 'pgmesh_truncate' THEN '' ELSE 'root' END);
    END LOOP;
  END LOOP;
END
$body$;

-- The replica identity pgmesh gives a table of the replicated set that has no usable one (no immediate
-- primary key, no replica identity index), or a partition whose root its owner made FULL: FULL, on the table and every partition under it, each listed
-- in auto_identity (to_full); or, once a usable key is back, DEFAULT again on those it had set
-- (NOT to_full). pgoutput then sends whole old rows, matched on the other nodes by all their columns.
CREATE OR REPLACE FUNCTION {schema}.ddl_identity(rel oid, to_full boolean) RETURNS void LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  t record;
  owner_full boolean;
BEGIN
  DELETE FROM {schema}.auto_identity a WHERE NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = a.relid);
  FOR t IN SELECT c.oid, n.nspname, c.relname, c.relreplident
             FROM (SELECT rel AS relid UNION SELECT relid FROM pg_partition_tree(rel)) p
             JOIN pg_class c ON c.oid = p.relid
             JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE c.relkind IN ('r', 'p') LOOP
    -- a partition under a root its owner made FULL is FULL too: pgoutput sends a partition's changes with
    -- the partition's own replica identity, and a key-only old row cannot be matched by whole rows
    owner_full := EXISTS (SELECT 1 FROM pg_class r WHERE r.oid = pg_partition_root(t.oid) AND r.oid <> t.oid
                            AND r.relreplident = 'f'
                            AND NOT EXISTS (SELECT 1 FROM {schema}.auto_identity a WHERE a.relid = r.oid));
    IF to_full AND t.relreplident <> 'f' AND (owner_full OR NOT EXISTS (
         SELECT 1 FROM pg_index i WHERE i.indrelid = t.oid AND (i.indisreplident AND t.relreplident = 'i'
           OR i.indisprimary AND i.indimmediate AND t.relreplident = 'd'))) THEN
      EXECUTE format('ALTER TABLE %I.%I REPLICA IDENTITY FULL', t.nspname, t.relname);
      INSERT INTO {schema}.auto_identity VALUES (t.oid) ON CONFLICT DO NOTHING;
    ELSIF NOT to_full AND t.relreplident = 'f' AND NOT owner_full
          AND EXISTS (SELECT 1 FROM {schema}.auto_identity a WHERE a.relid = t.oid)
          AND EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = t.oid AND i.indisprimary AND i.indimmediate) THEN
      EXECUTE format('ALTER TABLE %I.%I REPLICA IDENTITY DEFAULT', t.nspname, t.relname);
      DELETE FROM {schema}.auto_identity WHERE relid = t.oid;
    END IF;
  END LOOP;
END
$body$;

-- Columns an ALTER TABLE just added to a replicated table (those known_columns does not list yet) whose
-- values the command computed on each node for the rows it holds: an identity column (GENERATED ... AS
-- IDENTITY, a sequence per node), or a default that is not immutable (serial's nextval(), now(),
-- CURRENT_TIMESTAMP, random(), gen_random_uuid(), ...). Each node would fill its rows with its own values
-- (also rows inserted earlier in the same transaction: they reach the other nodes before the command):
-- refused where the command is typed when the table has rows there. On an empty table it is allowed: no
-- row is filled, and new rows get their values where they are inserted and travel with them (rows another
-- node inserts while the command travels would still be filled there: docs/ddl.md says to run it behind
-- `pgmesh ddl --wait`). A constant default and a STORED generated column (its expression is immutable)
-- give every node the same values.
CREATE OR REPLACE FUNCTION {schema}.ddl_filled(rel oid, qualified text) RETURNS void LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  col record;
  what text;
  filled boolean;
BEGIN
  FOR col IN SELECT a.attname::text AS name, a.attidentity::text AS ident, a.attgenerated::text AS gen,
                    pg_get_expr(d.adbin, d.adrelid) AS expr
               FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
              WHERE a.attrelid = rel AND a.attnum > 0 AND NOT a.attisdropped
                AND NOT EXISTS (SELECT 1 FROM {schema}.known_columns k WHERE k.relid = rel AND k.attnum = a.attnum)
              ORDER BY a.attnum LOOP
    IF col.ident <> '' THEN
      what := 'GENERATED ' || CASE col.ident WHEN 'a' THEN 'ALWAYS' ELSE 'BY DEFAULT' END
              || ' AS IDENTITY numbers the rows from each node''s own sequence';
    ELSIF col.gen = '' AND col.expr IS NOT NULL THEN
      what := {schema}.ddl_unstable((SELECT string_agg(s.code, ';') FROM {schema}.ddl_split(col.expr) s), 'vs');
      CONTINUE WHEN what IS NULL;
      what := format('DEFAULT %s is computed on each node (%s is not immutable)', col.expr, what);
    ELSE
      CONTINUE;
    END IF;
    IF filled IS NULL THEN
      EXECUTE format('SELECT EXISTS (SELECT FROM %s)', rel::regclass) INTO filled;
    END IF;
    EXIT WHEN NOT filled;
    RAISE EXCEPTION 'pgmesh: ADD COLUMN % to table % refused: % and fills the rows there with that node''s '
                    'own values', col.name, qualified, what
      USING ERRCODE = '0A000',
            HINT = format('add the column without a default, fill it with an UPDATE (replicated: every node '
                          'gets the same values), then give it its default for new rows: ALTER TABLE %s '
                          'ALTER COLUMN %I SET DEFAULT ... (a key numbered by a sequence: then `pgmesh '
                          'sequences convert`, so that no two nodes hand out the same number)',
                          rel::regclass, col.name);
  END LOOP;
END
$body$;

-- One table a command created or altered: track its columns; in the replicated set, put it in the
-- publication with its tombstone trigger. A table without a usable replica identity (no key, its primary
-- key dropped, or a deferrable one) is made REPLICA IDENTITY FULL (ddl_identity), unless the setting
-- new_table_without_key says to leave a new one local ('warn') or to refuse it ('refuse'), or the command
-- itself set that replica identity: then it is refused. A primary key arriving on a table pgmesh made
-- FULL makes it DEFAULT again. The tombstone key is the primary key (deferrable too), else the replica
-- identity index, else every column; when it changes, the table's old tombstones go (their keys name
-- other columns). The trigger fires REPLICA when the stream carries that key, else ALWAYS.
CREATE OR REPLACE FUNCTION {schema}.ddl_table(rel oid) RETURNS void LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  nsp text; tab text; kind "char"; part boolean; persist "char"; ident "char";
  qualified text; key text[]; pub text; published boolean; col record; usable boolean; explicit boolean;
  root oid; mode text := coalesce({schema}.ddl_setting('new_table_without_key'), 'full');
  args bytea; had bytea; fires text;
BEGIN
  SELECT n.nspname, c.relname, c.relkind, c.relispartition, c.relpersistence, c.relreplident
    INTO nsp, tab, kind, part, persist, ident
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = rel;
  IF NOT FOUND THEN
    RETURN;
  END IF;
  pub := {schema}.ddl_setting('publication');
  explicit := pg_catalog.current_query() ~* '\mreplica\s+identity\M';
  IF explicit AND ident = 'f' THEN
    DELETE FROM {schema}.auto_identity WHERE relid = rel;  -- FULL by the owner's choice now
  END IF;
  IF part THEN
    -- a partition: its root stands for it in the publication; it gets the TRUNCATE trigger, and the
    -- root's replica identity when it has no key of its own
    root := pg_partition_root(rel);
    IF EXISTS (SELECT 1 FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid
                WHERE p.pubname = pub AND r.prrelid = root) THEN
      PERFORM {schema}.truncate_triggers(rel);
      PERFORM {schema}.ddl_identity(rel, true);
      PERFORM {schema}.ddl_identity(rel, false);
    END IF;
    RETURN;
  END IF;
  IF kind NOT IN ('r', 'p') OR persist <> 'p' THEN
    RETURN;
  END IF;
  qualified := nsp || '.' || tab;
  SELECT EXISTS (SELECT 1 FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid
                  WHERE p.pubname = pub AND r.prrelid = rel) INTO published;
  IF qualified !~ {schema}.ddl_setting('tables') OR qualified ~ {schema}.ddl_setting('exclude') THEN
    IF published THEN  -- moved out of the replicated set (SET SCHEMA, RENAME): it stays local from here
      EXECUTE format('ALTER PUBLICATION %I DROP TABLE %I.%I', pub, nsp, tab);
      IF EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = rel AND tgname = 'pgmesh_tombstone') THEN
        EXECUTE format('DROP TRIGGER pgmesh_tombstone ON %I.%I', nsp, tab);
      END IF;
      DELETE FROM {schema}.known_columns WHERE relid = rel;
    END IF;
    RETURN;
  END IF;
  FOR col IN SELECT k.name AS was, a.attname::text AS now, a.attisdropped AS dropped
               FROM {schema}.known_columns k
               JOIN pg_attribute a ON a.attrelid = rel AND a.attnum = k.attnum
              WHERE k.relid = rel AND (a.attisdropped OR a.attname <> k.name) LOOP
    INSERT INTO {schema}.column_changes (table_name, old_name, new_name)
    VALUES (qualified, col.was, CASE WHEN col.dropped THEN NULL ELSE col.now END);
  END LOOP;
  IF published AND {schema}.ddl_setting('replicate') = 'on' AND NOT {schema}.ddl_applying()
     AND coalesce(pg_catalog.current_setting('pgmesh.ddl_local', true), '') NOT IN ('on', 'true', '1') THEN
    PERFORM {schema}.ddl_filled(rel, qualified);  -- where the command is typed, not where it is replayed
  END IF;
  DELETE FROM {schema}.known_columns WHERE relid = rel;
  INSERT INTO {schema}.known_columns
  SELECT rel, a.attnum, a.attname FROM pg_attribute a
   WHERE a.attrelid = rel AND a.attnum > 0 AND NOT a.attisdropped;

  -- what pgoutput can identify a row by: an immediate primary key, a replica identity index, or FULL
  usable := ident = 'f' OR EXISTS (
    SELECT 1 FROM pg_index i WHERE i.indrelid = rel
       AND (i.indisreplident AND ident = 'i' OR i.indisprimary AND i.indimmediate AND ident = 'd'));
  IF NOT usable THEN
    IF explicit AND published OR mode = 'refuse' THEN
      IF published THEN
        RAISE EXCEPTION 'pgmesh: table % is replicated and would be left without a replica identity',
          qualified
          USING ERRCODE = '0A000',
                HINT = 'keep a primary key, a replica identity index or REPLICA IDENTITY FULL; to stop '
                       'replicating it, exclude it in config.toml and run pgmesh init';
      END IF;
      RAISE EXCEPTION 'pgmesh: table % has no primary key, replica identity index or REPLICA IDENTITY FULL',
        qualified
        USING ERRCODE = '0A000',
              HINT = 'create it with a primary key, or exclude it in config.toml';
    ELSIF NOT published AND mode = 'warn' THEN
      RAISE WARNING 'pgmesh: table % has no primary key: it stays local (not replicated) until it gets one',
        qualified;
      RETURN;
    END IF;
    PERFORM {schema}.ddl_identity(rel, true);
    RAISE NOTICE 'pgmesh: table % has no primary key: replicated with REPLICA IDENTITY FULL (rows are '
                 'matched by all their columns)', qualified;
  ELSIF kind = 'p' OR ident = 'f' THEN
    PERFORM {schema}.ddl_identity(rel, true);  -- partitions without a key of their own
    PERFORM {schema}.ddl_identity(rel, false);  -- a primary key is back: DEFAULT where pgmesh set FULL
  END IF;

  SELECT array_agg(a.attname::text ORDER BY k.ord) INTO key
    FROM pg_index i CROSS JOIN unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
    JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
   WHERE i.indrelid = rel AND i.indisprimary;
  SELECT relreplident INTO ident FROM pg_class WHERE oid = rel;
  IF key IS NULL AND ident = 'i' THEN
    SELECT array_agg(a.attname::text ORDER BY k.ord) INTO key
      FROM pg_index i CROSS JOIN unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
     WHERE i.indrelid = rel AND i.indisreplident;
  END IF;
  IF key IS NULL THEN
    SELECT array_agg(a.attname::text ORDER BY a.attnum) INTO key  -- (not generated ones, as catalog.py)
      FROM pg_attribute a
     WHERE a.attrelid = rel AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = '';
  END IF;
  IF NOT published THEN
    EXECUTE format('ALTER PUBLICATION %I ADD TABLE %I.%I', pub, nsp, tab);
  END IF;
  SELECT string_agg(convert_to(c, 'UTF8') || '\x00'::bytea, ''::bytea ORDER BY o) INTO args
    FROM unnest(key) WITH ORDINALITY AS k(c, o);
  SELECT t.tgargs INTO had FROM pg_trigger t
   WHERE t.tgrelid = rel AND t.tgname = 'pgmesh_tombstone' AND t.tgparentid = 0;
  IF had IS DISTINCT FROM args THEN
    -- other key columns: tombstones keyed by the old ones would be compared with keys of the new ones
    DELETE FROM {schema}.tombstones WHERE table_name = qualified;
  END IF;
  -- (dropped only when there: DROP TRIGGER IF EXISTS would tell every CREATE TABLE's session it skipped)
  IF EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = rel AND tgname = 'pgmesh_tombstone') THEN
    EXECUTE format('DROP TRIGGER pgmesh_tombstone ON %I.%I', nsp, tab);
  END IF;
  EXECUTE format('CREATE TRIGGER pgmesh_tombstone AFTER DELETE ON %I.%I FOR EACH ROW '
                 'EXECUTE FUNCTION {schema}.tombstone(%s)',
                 nsp, tab, (SELECT string_agg(quote_literal(c), ', ') FROM unnest(key) AS c));
  -- REPLICA where the stream carries the key (the router records the node's own deletes from it,
  -- router/apply/recorder.py), ALWAYS where it does not (router.conflicts.catalog.trigger_fires)
  fires := CASE WHEN ident = 'f' OR ident = 'd' AND EXISTS (
                  SELECT 1 FROM pg_index i WHERE i.indrelid = rel AND i.indisprimary)
                  OR ident = 'i' AND key <@ (
                  SELECT array_agg(a.attname::text)
                    FROM pg_index i CROSS JOIN unnest(i.indkey::int2[]) AS k(attnum)
                    JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                   WHERE i.indrelid = rel AND i.indisreplident)
                THEN 'REPLICA' ELSE 'ALWAYS' END;
  EXECUTE format('ALTER TABLE %I.%I ENABLE %s TRIGGER pgmesh_tombstone', nsp, tab, fires);
  -- the given-up trigger, where the table has unique keys besides `key` (router/conflicts/given_up.py)
  PERFORM {schema}.given_up_ensure(rel, key);
  -- a node that only receives refuses local writes to it (router/cluster/receive.py)
  IF EXISTS (SELECT 1 FROM {schema}.node_info AS i WHERE i.key = 'receive_only') THEN
    IF EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = rel AND tgname = 'pgmesh_receive_only') THEN
      EXECUTE format('DROP TRIGGER pgmesh_receive_only ON %I.%I', nsp, tab);
    END IF;
    EXECUTE format('CREATE TRIGGER pgmesh_receive_only BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON %I.%I'
                   ' FOR EACH STATEMENT EXECUTE FUNCTION {schema}.refuse_local_write()', nsp, tab);
  END IF;
  IF kind = 'p' THEN
    PERFORM {schema}.truncate_triggers(rel);
  END IF;
END
$body$;

-- [ddl] mode = "locked" (setting 'ddl.mode'): DDL on replicated objects runs only through `pgmesh ddl`,
-- which drains the links, runs it in a session with pgmesh.ddl = on and waits until every node replayed
-- it. A guard against mistakes, not a security boundary: any session may set pgmesh.ddl.
CREATE OR REPLACE FUNCTION {schema}.ddl_locked(tag text) RETURNS void LANGUAGE plpgsql AS $body$
BEGIN
  RAISE EXCEPTION 'pgmesh: % refused: DDL on replicated objects runs only through pgmesh ddl in this cluster '
                  '([ddl] mode = "locked")', tag
    USING ERRCODE = '0A000',
          HINT = 'run it with `pgmesh ddl --config config.toml "<statement>"`: it waits until no change is in '
                 'flight, runs it on one node and waits until every node replayed it (a change meant for '
                 'this node only: SET pgmesh.ddl_local = on)';
END
$body$;

-- An ALTER TYPE that added enum labels (pg_enum holds more rows than ddl_refuse counted at its start, where
-- it is typed: not where it is replayed, nor local) outside `pgmesh ddl` (pgmesh.ddl = on): refused.
-- Labels added to one enum on two nodes at once would sort in a different order on each node (ORDER BY,
-- comparisons, indexes and CHECKs on the enum then answer differently); `pgmesh ddl` runs them one at a
-- time, cluster-wide, behind replication barriers.
CREATE OR REPLACE FUNCTION {schema}.ddl_enum_grew() RETURNS void LANGUAGE plpgsql AS $body$
DECLARE
  counted text := coalesce(pg_catalog.current_setting('pgmesh.enum_labels', true), '');
BEGIN
  IF counted = '' THEN
    RETURN;
  END IF;
  PERFORM pg_catalog.set_config('pgmesh.enum_labels', '', true);
  IF (SELECT count(*) FROM pg_catalog.pg_enum) > counted::bigint
     AND coalesce(pg_catalog.current_setting('pgmesh.ddl', true), '') NOT IN ('on', 'true', '1') THEN
    RAISE EXCEPTION 'pgmesh: ALTER TYPE ... ADD VALUE refused here: enum labels added on two nodes at once '
                    'would sort in a different order on each node'
      USING ERRCODE = '0A000',
            HINT = 'run it with `pgmesh ddl --config config.toml "ALTER TYPE ... ADD VALUE ..."`: it adds enum '
                   'labels one at a time, cluster-wide, behind a replication barrier';
  END IF;
END
$body$;

-- A query string holding replicated DDL and statements that write replicated rows (ddl_writes): the other
-- nodes get those rows and, replaying the whole string, would write them a second time (a keyed table's
-- link then stops on a duplicate key). Refused where it is typed, before its message is written.
CREATE OR REPLACE FUNCTION {schema}.ddl_refuse_writes(tag text) RETURNS void LANGUAGE plpgsql AS $body$
DECLARE
  q text := pg_catalog.current_query();
  what text;
BEGIN
  IF q !~ ';[[:space:]]*[^[:space:];]' AND q !~* '\mdo\M' THEN
    RETURN;  -- one statement, not a DO block (the cheap test)
  END IF;
  what := {schema}.ddl_writes(q);
  IF what IS NOT NULL THEN
    RAISE EXCEPTION 'pgmesh: % refused: its query string also writes rows (%), and the other nodes, which '
                    'get those rows and replay the whole string, would write them a second time', tag, what
      USING ERRCODE = '0A000',
            HINT = 'send the DDL and the statements that write rows as separate statements (psql -f, or one '
                   'execute per statement from a driver), in one transaction if they belong together; a DO '
                   'block is replayed whole, so keep its writes out of it';
  END IF;
END
$body$;

-- A schema renamed (ALTER SCHEMA ... RENAME), where it is typed and where it is replayed: its tables keep
-- their oids, so nothing tells pgoutput that their names changed (a namespace rename invalidates no
-- relation), and a walsender that sent a table's Relation message goes on naming the old schema, which
-- no node has any more: every link would wait for that table for ever. A REPLICA IDENTITY set to what it
-- is changes nothing but invalidates the table (relation_mark_replica_identity), so the next change of it
-- sends its new name. Each table is then what ddl_table makes of it under its new name (it leaves the
-- replicated set when the new name is outside the patterns).
CREATE OR REPLACE FUNCTION {schema}.ddl_schema_renamed(nsp oid) RETURNS void LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  t record;
BEGIN
  FOR t IN SELECT c.oid, n.nspname, c.relname, c.relreplident,
                  (SELECT i.relname FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
                    WHERE x.indrelid = c.oid AND x.indisreplident) AS ident_index
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE c.relkind IN ('r', 'p') AND c.relpersistence = 'p'
              AND (c.relnamespace = nsp OR c.relispartition AND pg_partition_root(c.oid) IN (
                     SELECT r.oid FROM pg_class r WHERE r.relnamespace = nsp))
            ORDER BY c.oid LOOP
    EXECUTE format('ALTER TABLE %I.%I REPLICA IDENTITY %s', t.nspname, t.relname,
                   CASE t.relreplident WHEN 'f' THEN 'FULL' WHEN 'n' THEN 'NOTHING'
                     WHEN 'i' THEN format('USING INDEX %I', t.ident_index) ELSE 'DEFAULT' END);
    PERFORM {schema}.ddl_table(t.oid);
  END LOOP;
END
$body$;

-- ddl_command_end: record the command in the transaction (unless it is local or replayed here); under
-- [ddl] mode = "locked", refuse it unless it comes through `pgmesh ddl` (ddl_locked).
-- SECURITY INVOKER and no SET clause: current_user and search_path are the session's own.
CREATE OR REPLACE FUNCTION {schema}.ddl_capture() RETURNS event_trigger LANGUAGE plpgsql AS $body$
DECLARE
  cmd record;
  replicated boolean := false;
  locked boolean;
  stamp text;
BEGIN
  IF coalesce(pg_catalog.current_setting('pgmesh.ddl_inner', true), '') = 'on' THEN
    RETURN;  -- DDL pgmesh itself runs from here (ALTER PUBLICATION, its trigger)
  END IF;
  IF tg_tag = 'ALTER TYPE' THEN
    PERFORM {schema}.ddl_enum_grew();
  END IF;
  PERFORM pg_catalog.set_config('pgmesh.ddl_inner', 'on', true);
  replicated := coalesce(pg_catalog.current_setting('pgmesh.ddl_dropped', true), '') = 'on';
  PERFORM pg_catalog.set_config('pgmesh.ddl_dropped', 'off', true);
  locked := {schema}.ddl_setting('mode') = 'locked' AND {schema}.ddl_setting('replicate') = 'on'
            AND coalesce(pg_catalog.current_setting('pgmesh.ddl', true), '') NOT IN ('on', 'true', '1')
            AND coalesce(pg_catalog.current_setting('pgmesh.ddl_local', true), '') NOT IN ('on', 'true', '1')
            AND NOT {schema}.ddl_applying();
  IF locked AND replicated THEN
    PERFORM {schema}.ddl_locked(tg_tag);
  END IF;
  FOR cmd IN SELECT * FROM pg_catalog.pg_event_trigger_ddl_commands() LOOP
    CONTINUE WHEN cmd.in_extension OR cmd.schema_name IS NOT NULL
      AND (cmd.schema_name IN ('pgmesh', 'pgmesh_join') OR cmd.schema_name LIKE 'pg\_temp%'
           OR cmd.schema_name LIKE 'pg\_toast%');
    CONTINUE WHEN cmd.object_type IN ('publication', 'publication relation', 'publication namespace',
                                      'subscription', 'event trigger');
    IF locked THEN
      PERFORM {schema}.ddl_locked(tg_tag);
    END IF;
    replicated := true;
    IF cmd.object_type IN ('table', 'table column') THEN
      PERFORM {schema}.ddl_table(cmd.objid);
    ELSIF cmd.object_type = 'index' THEN  -- a unique key more or less: the given-up trigger's arguments
      PERFORM {schema}.given_up_index(cmd.objid);
    ELSIF cmd.object_type = 'schema' AND tg_tag = 'ALTER SCHEMA' THEN
      PERFORM {schema}.ddl_schema_renamed(cmd.objid);
    END IF;
  END LOOP;
  IF replicated AND tg_tag = 'ALTER TABLE' AND pg_catalog.current_query() ~* '\mdetach\s+partition\M' THEN
    PERFORM {schema}.ddl_detached(pg_catalog.current_query());  -- it leaves its root's publication
  END IF;
  IF replicated THEN
    PERFORM {schema}.ddl_changed();
  END IF;
  IF replicated AND {schema}.ddl_setting('replicate') = 'on' AND NOT {schema}.ddl_applying()
     AND coalesce(pg_catalog.current_setting('pgmesh.ddl_local', true), '') NOT IN ('on', 'true', '1') THEN
    -- one message per statement, also when a query string holds several commands
    stamp := pg_catalog.statement_timestamp()::text || ' ' || pg_catalog.md5(pg_catalog.current_query());
    IF stamp IS DISTINCT FROM pg_catalog.current_setting('pgmesh.ddl_stamp', true) THEN
      PERFORM {schema}.ddl_refuse_writes(tg_tag);
      PERFORM pg_catalog.set_config('pgmesh.ddl_stamp', stamp, true);
      PERFORM {schema}.ddl_emit(pg_catalog.json_build_object(
        'sql', pg_catalog.current_query(), 'search_path', pg_catalog.current_setting('search_path'),
        'role', current_user, 'tag', tg_tag)::text);
    END IF;
  END IF;
  PERFORM pg_catalog.set_config('pgmesh.ddl_inner', 'off', true);
END
$body$;

-- sql_drop: DROP commands are not listed at ddl_command_end; note here that one dropped something
-- replicated (ddl_command_end, which fires next, then captures the command).
CREATE OR REPLACE FUNCTION {schema}.ddl_dropped() RETURNS event_trigger LANGUAGE plpgsql AS $body$
BEGIN
  IF coalesce(pg_catalog.current_setting('pgmesh.ddl_inner', true), '') = 'on' THEN
    RETURN;
  END IF;
  IF EXISTS (SELECT 1 FROM pg_catalog.pg_event_trigger_dropped_objects() d
              WHERE d.original AND NOT d.is_temporary
                AND coalesce(d.schema_name, '') NOT IN ('pgmesh', 'pgmesh_join')
                AND coalesce(d.schema_name, '') NOT LIKE 'pg\_toast%'
                AND d.object_type NOT IN ('publication', 'publication relation', 'publication namespace',
                                          'subscription', 'event trigger')) THEN
    PERFORM pg_catalog.set_config('pgmesh.ddl_dropped', 'on', true);
  END IF;
END
$body$;

-- A table an ALTER TABLE ... DETACH PARTITION made a table of its own (the query string names it; resolved
-- under the session's search_path): in the replicated set, it joins the publication with its tombstone
-- trigger (ddl_table), on every node, as the root published its rows until now.
CREATE OR REPLACE FUNCTION {schema}.ddl_detached(q text) RETURNS void LANGUAGE plpgsql AS $body$
DECLARE
  names text[];
  name_re text := '((?:"(?:[^"]|"")+"|[[:alnum:]_$]+)(?:\s*\.\s*(?:"(?:[^"]|"")+"|[[:alnum:]_$]+))?)';
  leaf regclass;
BEGIN
  FOR names IN SELECT pg_catalog.regexp_matches(s.code, '\malter\s+table\s+(?:if\s+exists\s+)?(?:only\s+)?'
                        || name_re || '\s+detach\s+partition\s+' || name_re, 'gi')
                 FROM {schema}.ddl_split(q) s LOOP
    leaf := pg_catalog.to_regclass(names[2]);
    IF leaf IS NOT NULL AND NOT (SELECT c.relispartition FROM pg_catalog.pg_class c WHERE c.oid = leaf) THEN
      PERFORM {schema}.ddl_table(leaf);
    END IF;
  END LOOP;
END
$body$;

-- A replicated table about to be attached as a partition of a replicated partitioned table: it loses its
-- own tombstone trigger (the root's is cloned onto it, under the same name: ATTACH would fail) and its
-- own place in the publication (the root publishes it). Called at ddl_command_start, also on the nodes
-- replaying the command; `parent` and `leaf` are resolved by the caller, under the session's search_path.
CREATE OR REPLACE FUNCTION {schema}.ddl_attaching(parent oid, leaf oid) RETURNS void LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
  nsp text; tab text; pub text := {schema}.ddl_setting('publication');
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = parent AND tgname = 'pgmesh_tombstone') THEN
    RETURN;
  END IF;
  SELECT n.nspname, c.relname INTO nsp, tab
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = leaf;
  PERFORM pg_catalog.set_config('pgmesh.ddl_inner', 'on', true);
  IF EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = leaf AND tgname = 'pgmesh_tombstone' AND tgparentid = 0) THEN
    EXECUTE format('DROP TRIGGER pgmesh_tombstone ON %I.%I', nsp, tab);
  END IF;
  IF EXISTS (SELECT 1 FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid
              WHERE p.pubname = pub AND r.prrelid = leaf) THEN
    EXECUTE format('ALTER PUBLICATION %I DROP TABLE %I.%I', pub, nsp, tab);
  END IF;
  PERFORM pg_catalog.set_config('pgmesh.ddl_inner', 'off', true);
END
$body$;

-- ddl_command_start: refuse here what could not be replayed on the other nodes; make room for a table
-- being attached as a partition (ddl_attaching).
CREATE OR REPLACE FUNCTION {schema}.ddl_refuse() RETURNS event_trigger LANGUAGE plpgsql AS $body$
DECLARE
  q text := pg_catalog.current_query();
  what text;
  names text[];
  name_re text := '((?:"(?:[^"]|"")+"|[[:alnum:]_$]+)(?:\s*\.\s*(?:"(?:[^"]|"")+"|[[:alnum:]_$]+))?)';
BEGIN
  IF tg_tag = 'ALTER TABLE' AND q ~* '\mattach\s+partition\M'
     AND coalesce(pg_catalog.current_setting('pgmesh.ddl_inner', true), '') <> 'on' THEN
    FOR names IN SELECT pg_catalog.regexp_matches(q, '\malter\s+table\s+(?:if\s+exists\s+)?(?:only\s+)?'
                          || name_re || '\s+attach\s+partition\s+' || name_re, 'gi') LOOP
      IF pg_catalog.to_regclass(names[1]) IS NOT NULL AND pg_catalog.to_regclass(names[2]) IS NOT NULL THEN
        PERFORM {schema}.ddl_attaching(pg_catalog.to_regclass(names[1]), pg_catalog.to_regclass(names[2]));
      END IF;
    END LOOP;
  END IF;
  IF coalesce(pg_catalog.current_setting('pgmesh.ddl_inner', true), '') = 'on'
     OR coalesce(pg_catalog.current_setting('pgmesh.ddl_local', true), '') IN ('on', 'true', '1')
     OR {schema}.ddl_setting('replicate') IS DISTINCT FROM 'on' OR {schema}.ddl_applying() THEN
    RETURN;
  END IF;
  IF tg_tag IN ('CREATE INDEX', 'DROP INDEX') AND q ~* '\mconcurrently\M'
     AND EXISTS (SELECT 1 FROM {schema}.ddl_statements(q) s
                  WHERE s ~ '^(create (unique )?index|drop index) concurrently\M') THEN
    RAISE EXCEPTION 'pgmesh: % CONCURRENTLY is not replicated (the other nodes replay DDL inside a '
                    'transaction)', tg_tag
      USING ERRCODE = '0A000',
            HINT = 'run it without CONCURRENTLY (`pgmesh ddl --wait`), or on every node as a statement of its '
                   'own in a session with pgmesh.ddl_local on (psql -c ''SET pgmesh.ddl_local = on'' -c '
                   '''CREATE INDEX CONCURRENTLY ...'': one string of both is one transaction, where '
                   'CONCURRENTLY cannot run)';
  END IF;
  -- only the top-level statements count (not a function's body, a string or a comment); the first test
  -- is the cheap one that most DDL fails
  IF q ~* ('(^|;)\s*(begin|start\s+transaction|commit|end|rollback|abort|savepoint|release'
           '|prepare\s+transaction)\M|\*/|--')
     AND EXISTS (SELECT 1 FROM {schema}.ddl_statements(q) s
                  WHERE s ~ ('^(begin|start transaction|commit|end|rollback|abort|savepoint|release'
                             '|prepare transaction)\M')) THEN
    RAISE EXCEPTION 'pgmesh: DDL sent in one query string with transaction control is not replicated'
      USING ERRCODE = '0A000', HINT = 'send BEGIN, each DDL statement and COMMIT as separate statements';
  END IF;
  IF tg_tag = 'ALTER TABLE' AND q ~* '\musing\M' THEN
    FOR what IN SELECT {schema}.ddl_unstable(substring(substring(s.code from '(?i)\mtype\M.*') from '(?i)\musing\M(.*)'),
                                             'vs')
                  FROM {schema}.ddl_split(q) s WHERE s.words ~ '^alter table\M' LOOP
      CONTINUE WHEN what IS NULL;
      RAISE EXCEPTION 'pgmesh: ALTER TABLE refused: its ALTER COLUMN ... TYPE ... USING calls % (not immutable), '
                      'which gives each node its own values', what
        USING ERRCODE = '0A000',
              HINT = 'convert with an immutable expression; or add a column of the new type, fill it with an '
                     'UPDATE (replicated: every node gets the same values), drop the old column and rename '
                     'the new one';
    END LOOP;
  END IF;
  IF tg_tag = 'ALTER TABLE' AND q ~* '\mconcurrently\M'
     AND EXISTS (SELECT 1 FROM {schema}.ddl_split(q) s
                  WHERE s.code ~* '\mdetach\s+partition\M.*\mconcurrently\M') THEN
    RAISE EXCEPTION 'pgmesh: ALTER TABLE ... DETACH PARTITION CONCURRENTLY is not replicated (the other nodes '
                    'replay DDL inside a transaction)'
      USING ERRCODE = '0A000', HINT = 'run it without CONCURRENTLY';
  END IF;
  -- labels added to one enum on two nodes at once would sort differently on each: enum changes go one at
  -- a time, cluster-wide, through `pgmesh ddl`; ddl_capture refuses the others (ddl_enum_grew), however
  -- the command is spelt (a DO block, a function) and not when ADD VALUE IF NOT EXISTS added nothing
  IF tg_tag = 'ALTER TYPE' THEN
    PERFORM pg_catalog.set_config('pgmesh.enum_labels', (SELECT count(*) FROM pg_catalog.pg_enum)::text, true);
  END IF;
END
$body$;
