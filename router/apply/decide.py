"""Conflicts decided in the transaction's own round trip: the target-side functions the fast path falls
back to when a remote change does not fit the row it meets.

The applier's prepared statements (router.apply.prepared) apply a change directly when its row was last
written by the source (the common case, no function call). When it was not - another node's version,
no row, a tombstone, a row already there for an insert - the same statement calls a decision function
for its shape, `pgmesh.d_<hash of its text>(VARIADIC text[])` (created at first use unless it is there:
a persistent function, shared by every session; not in pg_temp, whose drop when a session ends commits
under the session's replication origin and could move it past a transaction that never committed). On
the target, in the applying transaction, it:

1. reads the row by key `FOR UPDATE` with its version (router.apply.careful.sql.read_row_sql); when
   there is none, takes the advisory locks every decision on a key takes (the table's, shared; the
   key's: the same as the careful path's, router.apply.statements.key_lock), so that appliers of other
   sources deciding the same absent key go one after the other, reads again, then reads the tombstone;
2. asks `pgmesh.decide` (router/conflicts/sql/decide.sql: the SQL twin of router.conflicts.resolve for the
   built-in resolvers), which records the conflict in `pgmesh.conflict_history` and says whether the
   remote change wins;
3. writes what was decided: the update, the re-created row, the delete, the tombstone of a delete that
   found nothing.

No rollback, no replay, no extra round trip: a transaction with conflicts costs what its statements cost
on the target (the first conflict after a quiet spell excepted: its batch is sent once more, with the
remote version, `Decisions.remote`). What these functions do not decide raises SQLSTATE PGM01, and the
transaction goes the careful way (router.apply.careful.transaction), as every conflict did before: custom and
`error`
resolvers, tables with delta columns or other unique keys than the primary key, an update that moves its
row to another key, and re-creating a row whose unchanged TOASTed values pgoutput did not send.

The remote version comes from the session: `pgmesh.source`, `pgmesh.target`, `pgmesh.source_origin`,
`pgmesh.origin_prefix` (set once per session, `session_settings`) and `pgmesh.remote` (set with a
transaction's origin set-up, router.apply.statements.setup_args; read through `pgmesh.remote_version()`,
which raises PGM03 when a batch left it out: `Decisions.remote`).

Must not: connect or run anything (callers send the SQL), or decide anything in Python.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Final

from protocol.messages import Relation
from router.apply.careful.sql import read_row_sql, read_tombstone_sql
from router.apply.statements import (
    TABLE_ALIAS,
    TOMBSTONE_ALIAS,
    TargetTable,
    key_lock,
    quote_ident,
    quote_literal,
    tombstone_key,
    typed,
    untouched,
)
from router.config.model import Config

__all__ = ["REMOTE_KEEP", "Decisions", "session_settings"]

T, TS = TABLE_ALIAS, TOMBSTONE_ALIAS
_BODY: Final = "$pgmesh_d$"

# Raised by a decision function for what it leaves to the careful path (router.errors.is_conflict).
_CAREFUL: Final = "RAISE EXCEPTION 'pgmesh: % goes the careful way', {why} USING ERRCODE = 'PGM01';"
# After a decision function lacked the remote version, the link's transactions set it for this many: a
# stream with conflicts keeps it (each one sets it again); one without them pays one batch sent twice.
REMOTE_KEEP: Final = 50_000

_REMOTE_TIME: Final = (
    "pg_catalog.split_part(pgmesh.remote_version(), '|', 2)::timestamptz"
)
_MINE: Final = (  # a row written by the source, by this transaction, or before pgmesh: no conflict
    "pgmesh_l.pgmesh_ours OR pgmesh_l.pgmesh_origin = pg_catalog.current_setting('pgmesh.source_origin')::oid"
    " OR ((pgmesh_l.pgmesh_origin IS NULL OR pgmesh_l.pgmesh_origin = 0) AND (pgmesh_l.pgmesh_ts IS NULL"
    " OR pgmesh_l.pgmesh_ts < coalesce(nullif(pg_catalog.current_setting('pgmesh.installed_at', true), ''),"
    " '-infinity')::timestamptz))"
)


def session_settings(source: str, target: str, source_origin: int | None, origin_prefix: str) -> str:
    """The SQL that sets a target session up for the decision functions (once per session)."""
    pairs = {
        "pgmesh.source": source, "pgmesh.target": target, "pgmesh.origin_prefix": origin_prefix,
        "pgmesh.source_origin": str(source_origin if source_origin is not None else 0),
    }
    return "SELECT " + ", ".join(
        f"pg_catalog.set_config({quote_literal(k)}, {quote_literal(v)}, false)" for k, v in pairs.items()
    )


class Decisions:
    """Makes the decision functions of one session's prepared statements, from the config's policies."""

    __slots__ = ("config", "contested", "remote_left")

    def __init__(self, config: Config) -> None:
        self.config = config
        # tables (TargetTable.name) where a single insert met a row with its key on this link: their single
        # inserts decide insert_exists in the statement from then on (router.apply.prepared)
        self.contested: set[str] = set()
        # transactions still to be sent with `pgmesh.remote` (`remote`, `needed_remote`)
        self.remote_left = 0

    @property
    def remote(self) -> bool:
        """Whether the link's batched transactions set `pgmesh.remote` (router.apply.scripts). A link that
        met no conflict lately leaves it out: a transaction-local setting costs PostgreSQL 15 a pass over
        all its settings at every commit (a tenth of a small insert's cost on the target). A decision
        function that then needs it raises PGM03 (`pgmesh.remote_version()`), never decides without
        it, and the applier sends the batch again with it (`needed_remote`)."""
        return self.remote_left > 0

    def needed_remote(self) -> None:
        """A decision function lacked the remote version: the next REMOTE_KEEP transactions set it."""
        self.remote_left = REMOTE_KEEP

    def sent(self, transactions: int) -> None:
        """`transactions` were applied in a batch: one step nearer to leaving the remote version out."""
        if self.remote_left:
            self.remote_left = max(0, self.remote_left - transactions)

    def _policy(self, table: TargetTable, conflict: str) -> str:
        """`resolver, priority` literals for pgmesh.decide."""
        schema, _, name = table.name.partition(".")
        policy = self.config.policy(schema, name, conflict)
        priority = "ARRAY[" + ", ".join(quote_literal(n) for n in policy.node_priority) + "]::text[]"
        return f"{quote_literal(policy.resolver.value)}, {priority}"

    def _unsupported(self, table: TargetTable, key: Mapping[str, str]) -> str | None:
        """Why this table's conflicts all go the careful way (None: they are decided here); `key`: the
        columns the change names its row by."""
        schema, _, name = table.name.partition(".")
        if self.config.delta_columns(schema, name):
            return "delta columns"
        if table.uniques or table.indexes:
            return "unique keys besides the primary key"
        if not table.pk or not set(table.pk) <= set(key):
            return "no primary key, or rows named by another key"
        return None

    def _decide(self, table: TargetTable, conflict: str, local: str) -> str:
        """A call of pgmesh.decide for `conflict`; `local` names the record holding the local version
        ('l': the row, 'tb': its tombstone, '': none)."""
        l_row = "pgmesh_l.pgmesh_row" if local == "l" else "NULL"
        version = f"pgmesh_{local}.pgmesh_ts, pgmesh_{local}.pgmesh_origin" if local else "NULL, NULL"
        return (
            f"pgmesh.decide({quote_literal(conflict)}, {quote_literal(table.name)}, pgmesh_key, {version},"
            f" {l_row}, pgmesh_r_row, {self._policy(table, conflict)})"
        )

    def _function(self, declare: str, body: str) -> str:
        return (
            f"{_BODY}\n#variable_conflict use_column\nDECLARE\n  pgmesh_l record;\n  pgmesh_tb record;\n"
            f"  pgmesh_won boolean;\n  pgmesh_n bigint;\n  pgmesh_had boolean;\n{declare}"
            f"BEGIN\n{body}\nEND\n{_BODY}"
        )

    def update(
        self, relation: Relation, table: TargetTable, sets: list[int], keys: list[int], out: list[str],
        created: set[str],
    ) -> str:
        """The decision function of a keyed UPDATE setting columns `sets` (arguments 1...) of the row
        with key columns `keys` (the arguments after them): its CREATE goes to `out`, its name back."""
        cols = relation.columns
        new = {cols[i].name: f"pgmesh_a[{n}]" for n, i in enumerate(sets, 1)}
        old = {cols[i].name: f"pgmesh_a[{n}]" for n, i in enumerate(keys, len(sets) + 1)}
        why = self._unsupported(table, old)
        if why:
            return self._emit(table, new, new, [_CAREFUL.format(why=quote_literal(why))], out, created)
        complete = len(sets) == len(cols)  # no unchanged TOAST value: the row can be re-created
        lines = []
        moved = " OR ".join(f"{new[k]} IS DISTINCT FROM {old[k]}" for k in table.pk if k in new and k in old)
        if moved:
            lines.append(f"IF {moved} THEN {_CAREFUL.format(why=quote_literal('a new primary key'))} END IF;")
        lines += self._read(table, old)
        assignments = ", ".join(  # (an identity GENERATED ALWAYS: set by no UPDATE, its value is the row's)
            f"{quote_ident(c)} = {_cast(table, c, v)}" for c, v in new.items() if c not in table.always
        ) or untouched(table, [c.name for c in cols])
        # another version of the row, met by an update without its unchanged TOAST values: those values
        # may differ here, and only the source has them (router.apply.toast, on the careful path)
        other = (f"pgmesh_won := {self._decide(table, 'update_origin_differs', 'l')};" if complete else
                 _CAREFUL.format(why=quote_literal("unchanged TOAST values to overwrite another version")))
        lines += [
            "IF FOUND THEN",
            f"  IF {_MINE} THEN pgmesh_won := true;",
            f"  ELSE {other} END IF;",
            f"  IF pgmesh_won THEN UPDATE {table.qualified} AS {T} SET {assignments} WHERE {_at()}; END IF;",
            "  RETURN pgmesh_won;",
            "END IF;",
            *self._tombstone(table, new),
            "IF pgmesh_had THEN",
            f"  pgmesh_won := {self._decide(table, 'update_deleted', 'tb')};",
            f"ELSE pgmesh_won := {self._decide(table, 'update_missing', '')}; END IF;",
            "IF NOT pgmesh_won THEN RETURN false; END IF;",
        ]
        if not complete:
            lines.append(_CAREFUL.format(why=quote_literal("unchanged TOAST values to re-create the row")))
        else:
            lines += self._create(table, new)
        return self._emit(table, new, new, lines, out, created)

    def delete(
        self, relation: Relation, table: TargetTable, keys: list[int], out: list[str], created: set[str]
    ) -> str:
        """The decision function of a keyed DELETE (its key columns `keys` are the arguments)."""
        cols = relation.columns
        old = {cols[i].name: f"pgmesh_a[{n}]" for n, i in enumerate(keys, 1)}
        why = self._unsupported(table, old)
        if why:
            return self._emit(table, old, old, [_CAREFUL.format(why=quote_literal(why))], out, created)
        lines = self._read(table, old)
        lines += [
            "IF FOUND THEN",
            f"  IF {_MINE} THEN pgmesh_won := true;",
            f"  ELSE pgmesh_won := {self._decide(table, 'delete_origin_differs', 'l')}; END IF;",
            f"  IF pgmesh_won THEN DELETE FROM {table.qualified} AS {T} WHERE {_at()}; END IF;",
            "  RETURN pgmesh_won;",
            "END IF;",
            *self._tombstone(table, old),
            f"PERFORM {self._decide(table, 'delete_missing', '')};",
            # a newer deletion than the one recorded (or none) is the key's tombstone now, unless a local
            # deletion came after the read (then the whole transaction is decided again)
            "IF NOT pgmesh_had OR pgmesh.remote_wins('last_update_wins', '{}', pgmesh_tb.pgmesh_ts,"
            f" pgmesh.origin_node(pgmesh_tb.pgmesh_origin), {_REMOTE_TIME},"
            " pg_catalog.current_setting('pgmesh.source')) THEN",
            f"  INSERT INTO pgmesh.tombstones AS {TS} (table_name, key, xid)"
            f" VALUES ({quote_literal(table.name)}, {self._key_array(table, old)},"
            " pg_catalog.pg_current_xact_id())"
            f" ON CONFLICT (table_name, key) DO UPDATE SET xid = excluded.xid"
            f" WHERE {TS}.xid::text IS NOT DISTINCT FROM"
            " (CASE WHEN pgmesh_had THEN pgmesh_tb.pgmesh_xid END);",
            "  GET DIAGNOSTICS pgmesh_n = ROW_COUNT;",
            f"  IF pgmesh_n = 0 THEN {_MOVED} END IF;",
            "END IF;",
            "RETURN false;",
        ]
        return self._emit(table, old, old, lines, out, created)

    def insert_deleted(
        self, relation: Relation, table: TargetTable, out: list[str], created: set[str]
    ) -> str:
        """The decision of a single insert whose key has a tombstone (all columns are the arguments):
        whether to insert."""
        new = {c.name: f"pgmesh_a[{n}]" for n, c in enumerate(relation.columns, 1)}
        why = self._unsupported(table, new)
        if why:
            return self._emit(table, new, new, [_CAREFUL.format(why=quote_literal(why))], out, created)
        lines = [
            *self._tombstone(table, new),
            "IF NOT pgmesh_had OR pgmesh_tb.pgmesh_ours OR pgmesh_tb.pgmesh_origin"
            " = pg_catalog.current_setting('pgmesh.source_origin')::oid THEN RETURN true; END IF;",
            f"RETURN {self._decide(table, 'insert_deleted', 'tb')};",
        ]
        return self._emit(table, new, new, lines, out, created)

    def insert_exists(
        self, relation: Relation, table: TargetTable, out: list[str], created: set[str]
    ) -> str:
        """The decision of a single insert meeting a row with its primary key (all columns are the
        arguments; the row is locked by ON CONFLICT): whether to overwrite that row."""
        new = {c.name: f"pgmesh_a[{n}]" for n, c in enumerate(relation.columns, 1)}
        why = self._unsupported(table, new)
        if why:
            return self._emit(table, new, new, [_CAREFUL.format(why=quote_literal(why))], out, created)
        lines = [
            f"SELECT * INTO pgmesh_l FROM ({read_row_sql(table, _where(table, new))}) AS r;",
            f"RETURN {self._decide(table, 'insert_exists', 'l')};",
        ]
        return self._emit(table, new, new, lines, out, created)

    # ------------------------------------------------------------------ pieces

    def _emit(
        self, table: TargetTable, key_of: Mapping[str, str], row: Mapping[str, str], lines: list[str],
        out: list[str], created: set[str],
    ) -> str:
        """The function made of `lines`, created (into `out`) unless the session made sure of it already
        (`created`, the session's `Prepared.functions`: emptied after a rolled-back transaction); its
        name."""
        key = " || ',' || ".join(f"coalesce({key_of.get(k, 'NULL')}, 'None')" for k in table.tombstone_key)
        names = ", ".join(quote_literal(c) for c in row)
        values = ", ".join(row.values())
        declare = (
            f"  pgmesh_key text := {key or quote_literal('')};\n"
            f"  pgmesh_r_row text := pg_catalog.json_object(ARRAY[{names}]::text[],"
            f" ARRAY[{values}]::text[])::text;\n"
        )
        body = self._function(declare, "\n".join("  " + line for line in lines))
        name = "pgmesh.d_" + hashlib.sha256(body.encode()).hexdigest()[:24]
        if name not in created:
            created.add(name)
            out.append(_create(name, body))
        return name

    def _key_array(self, table: TargetTable, values: Mapping[str, str]) -> str:
        """The key as pgmesh.tombstones holds it."""
        return tombstone_key(_key_text(table, values))

    def _lock(self, table: TargetTable, values: Mapping[str, str]) -> list[str]:
        """The careful path's locks: the table's, shared, then the key's."""
        name = quote_literal(table.name)
        shared = f"pg_catalog.pg_advisory_xact_lock_shared(pg_catalog.hashtext({name}), 0)"
        return [f"PERFORM {shared}, {key_lock(table, _key_text(table, values))};"]

    def _read(self, table: TargetTable, key: Mapping[str, str]) -> list[str]:
        """The row with `key`, locked, into pgmesh_l. A row lock serializes the decisions on a row that is
        there; when there is none, the key's advisory lock does (then the row is read again: another
        applier may have written it before letting the lock go)."""
        read = f"SELECT * INTO pgmesh_l FROM ({read_row_sql(table, _where(table, key))}) AS r;"
        return [read, "IF NOT FOUND THEN", *("  " + line for line in self._lock(table, key)), f"  {read}",
                "END IF;"]

    def _tombstone(self, table: TargetTable, values: Mapping[str, str]) -> list[str]:
        read = read_tombstone_sql(self._key_array(table, values)).replace("$1", quote_literal(table.name))
        return [f"SELECT * INTO pgmesh_tb FROM ({read}) AS r;", "pgmesh_had := FOUND;"]

    def _create(self, table: TargetTable, row: Mapping[str, str]) -> list[str]:
        """Insert the row; then the tombstone read must still be the key's (else decided again)."""
        names = ", ".join(quote_ident(c) for c in row)
        values = ", ".join(_cast(table, c, v) for c, v in row.items())
        check = read_tombstone_sql(self._key_array(table, row)).replace("$1", quote_literal(table.name))
        return [
            f"INSERT INTO {table.qualified} ({names}) OVERRIDING SYSTEM VALUE VALUES ({values});",
            # (a tombstone of this very transaction is no deletion meanwhile: a partial target's row filter
            # took the row out again, router.cluster.partial)
            f"IF NOT coalesce((SELECT r.pgmesh_ours FROM ({check}) AS r), false)"
            f" AND (SELECT r.pgmesh_xid FROM ({check}) AS r) IS DISTINCT FROM"
            f" (CASE WHEN pgmesh_had THEN pgmesh_tb.pgmesh_xid END) THEN {_MOVED} END IF;",
            "RETURN true;",
        ]


# A local deletion of the key committed while this decision rested on the tombstone read before it: the
# transaction is decided again, as after a local insert of the key (router.errors.retry_unique).
_MOVED: Final = (
    "RAISE EXCEPTION 'pgmesh: a key decided here was deleted meanwhile: decided again'"
    " USING ERRCODE = 'unique_violation';"
)


def _key_text(table: TargetTable, values: Mapping[str, str]) -> str:
    """The key (`values` by column) as text[], each value cast to its type and back
    (router.apply.careful.transaction
    `_key_sql`)."""
    parts = [
        f"({typed(values.get(k, 'NULL'), table.compare.get(k, 'text'))})::text" for k in table.tombstone_key
    ]
    return f"ARRAY[{', '.join(parts)}]::text[]"


def _create(name: str, body: str) -> str:
    """Create function `name` (`body`: its dollar-quoted text) unless it is there. Names are the hash of
    the text: a function once created never changes, and every session and link of the node shares it.
    Two sessions creating it at once: the second waits for the first and then finds it (the duplicate is
    caught)."""
    return (
        f"DO $pgmesh_do$ BEGIN IF pg_catalog.to_regprocedure({quote_literal(name + '(text[])')}) IS NULL THEN"
        f" BEGIN EXECUTE {quote_literal(f'CREATE FUNCTION {name}(VARIADIC pgmesh_a text[]) RETURNS boolean')}"
        f" || ' LANGUAGE plpgsql AS ' || {quote_literal(body)};"
        " EXCEPTION WHEN duplicate_function OR unique_violation THEN NULL; END;"
        # owned by pgmesh's schema's owner, not by the router's role (which may be dropped one day)
        f" BEGIN EXECUTE pg_catalog.format('ALTER FUNCTION %s(text[]) OWNER TO %I', {quote_literal(name)},"
        " (SELECT n.nspowner::regrole::text FROM pg_catalog.pg_namespace AS n WHERE n.nspname = 'pgmesh'));"
        " EXCEPTION WHEN insufficient_privilege THEN NULL; END; END IF; END $pgmesh_do$"
    )


def _cast(table: TargetTable, column: str, value: str) -> str:
    return typed(value, table.types.get(column, "text"))


def _where(table: TargetTable, values: Mapping[str, str]) -> str:
    return " AND ".join(
        f"{T}.{quote_ident(k)} = {typed(values[k], table.compare.get(k, 'text'))}" for k in table.pk
    )


def _at() -> str:
    return f"{T}.ctid = pgmesh_l.pgmesh_ctid::tid AND {T}.tableoid = pgmesh_l.pgmesh_tableoid::oid"
