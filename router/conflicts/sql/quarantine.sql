-- Changes this node refused (a CHECK, foreign key or trigger here, a value its type rejects), set aside by
-- an applier under `on_refused = "quarantine"` instead of stopping the link, and the later changes of the
-- same key that followed them (router.apply.quarantine; docs/conflicts.md "Quarantine"). `key`: the row's
-- key columns as text; `new_row`: the change's row (insert, update); `old_key`: the old row or key it
-- sent (update, delete); `follows`: the earlier entry of the key this one followed (NULL: refused itself).
-- `pgmesh quarantine replay | discard` resolve them (router.ops.quarantine).
-- Created once, when the table is missing, by router/conflicts/catalog.py (install_conflict_catalog),
-- which fills {schema} with pgmesh's schema, quoted as an identifier.

CREATE TABLE {schema}.quarantine (
  id bigserial PRIMARY KEY, created_at timestamptz NOT NULL DEFAULT now(),
  source text NOT NULL, source_lsn pg_lsn NOT NULL, commit_time timestamptz,
  table_name text NOT NULL, key jsonb, change_kind text NOT NULL, new_row jsonb, old_key jsonb,
  sqlstate text, message text, follows bigint, state text NOT NULL DEFAULT 'pending',
  resolved_at timestamptz);

CREATE INDEX quarantine_pending_idx ON {schema}.quarantine (table_name, key) WHERE state = 'pending';
