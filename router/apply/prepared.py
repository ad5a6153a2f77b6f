"""Server-side prepared statements of one target session (`Prepared`) and the keyed changes that run as
them: a keyed UPDATE or DELETE, a single insert.

With the source's origin (`origin` / `guard_origin`) each statement applies its change directly when the
row it meets was last written by the source, and otherwise calls the decision function of its shape
(router.apply.decide), created in the session beside the PREPARE: the conflict is decided and recorded
in the same statement, in the transaction's own round trip. Without a `Decisions` (a session built by
hand, the micro benchmarks) the statements raise at a conflict instead (router.apply.statements.guard),
for the careful path.

Must not: connect, retry, or decide conflicts itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from protocol.messages import KIND_UNCHANGED, Delete, Insert, Relation, Update
from router.apply.decide import Decisions
from router.apply.statements import (
    _OVERRIDING,
    TABLE_ALIAS,
    TOMBSTONE_ALIAS,
    TargetTable,
    _literals,
    bounded_key,
    check_always,
    guard,
    key_lock,
    quote_ident,
    quote_literal,
    setup_statement,
    tombstone_key,
    typed,
    untouched,
)

__all__ = [
    "Prepared", "delete_sql", "insert_locks_sql", "insert_sql", "prepared_delete", "prepared_insert",
    "prepared_update", "update_sql",
]

_SETUP_KEY: Final = (0, "S", b"")  # the origin's xact_setup in `Prepared` (no relation has id 0)
_BARE_SETUP_KEY: Final = (0, "SB", b"")  # the same without `pgmesh.remote`
_MARKED_KEYS: Final = ((0, "SM", b""), (0, "SBM", b""))  # both, setting the applied mark first
_REMOTE_KEY: Final = (0, "R", b"")  # the setting of `pgmesh.remote` alone


class Prepared:
    """Server-side prepared statements of one target session, by (relation version, shape).

    A prepared statement is planned once; afterwards each row costs the server only the parse of a
    short EXECUTE. The cache lives as long as the session: a new session needs a new `Prepared`.
    Names never repeat within a session; `forget_since(mark)` drops names whose PREPARE was never sent.
    """

    __slots__ = (
        "_counter", "_names", "_order", "_relations", "creates", "decisions", "functions", "insert_plans",
        "plans",
    )

    def __init__(self, decisions: Decisions | None = None, after: Prepared | None = None) -> None:
        """`after`: the session's previous cache, whose names are never used again here."""
        self.decisions = decisions  # makes the decision functions (None: guarded statements raise)
        self.functions: set[str] = set()  # decision functions this session made sure of
        # their CREATEs not run yet: run on a session of their own and committed before the statements
        # that call them are sent (router.apply.link.LinkSession.make_functions): never inside an applied
        # transaction, whose catalog change could come before its origin in a streamed transaction
        self.creates: list[str] = []
        self._names: dict[tuple[int, str, bytes], str] = {}
        # (id(relation), shape, row kinds) -> (name, parameter columns...): skips working out the
        # shape of a row seen before (ids stay unique: `_relations` keeps the relations alive)
        self.plans: dict[tuple[int, str, bytes], tuple[str, list[int], list[int]]] = {}
        # id(relation) -> insert, key positions, key types
        self.insert_plans: dict[int, tuple[str, list[int], list[str]]] = {}
        self._order: list[tuple[int, str, bytes]] = []
        self._relations: dict[int, Relation] = {}  # keeps the keyed relations alive (ids stay unique)
        self._counter: int = after._counter if after is not None else 0

    def name(
        self, relation: Relation, shape: str, mask: bytes, build: Callable[[], str], out: list[str]
    ) -> str:
        key = (id(relation), shape, mask)
        name = self._names.get(key)
        if name is None:
            name = self._new(key, build(), out)
            self._relations[id(relation)] = relation
        return name

    def setup(self, args: list[str], out: list[str], mark: bool = False) -> str:
        """`xact_setup_sql` as an EXECUTE of a statement prepared once per session (planned once);
        `args` from `setup_args` (without the remote version, it sets the origin up only); `mark`: see
        `setup_statement`."""
        bare = len(args) <= 2
        key = _MARKED_KEYS[bare] if mark else (_BARE_SETUP_KEY if bare else _SETUP_KEY)
        name = self._names.get(key)
        if name is None:
            body = setup_statement("$1", "$2", None if bare else "$3", mark)
            name = self._new(key, body, out)
        return _execute(name, args)

    def remote(self, literal: str, out: list[str]) -> str:
        """The setting of `pgmesh.remote` to `literal` (the last of `setup_args`) alone, prepared once:
        first in a transaction whose origin set-up comes last (router.apply.scripts)."""
        name = self._names.get(_REMOTE_KEY)
        if name is None:
            name = self._new(_REMOTE_KEY, "SELECT pg_catalog.set_config('pgmesh.remote', $1, true)", out)
        return _execute(name, [literal])

    def _new(self, key: tuple[int, str, bytes], body: str, out: list[str]) -> str:
        self._counter += 1
        name = f"pgmesh_{self._counter}"
        self._names[key] = name
        self._order.append(key)
        out.append(f"PREPARE {name} AS {body}")
        return name

    def names(self) -> list[str]:
        """The names of the statements this cache holds."""
        return list(self._names.values())

    def mark(self) -> int:
        return len(self._order)

    def forget_since(self, mark: int) -> None:
        if mark < len(self._order):
            self.plans.clear()  # some may name a statement forgotten here
            self.insert_plans.clear()
            self.functions.clear()  # made sure of again (harmless: each CREATE checks first)
        for key in self._order[mark:]:
            del self._names[key]
        del self._order[mark:]


def _execute(name: str, literals: list[str]) -> str:
    return f"EXECUTE {name}({', '.join(literals)})"


_INSTALLED_AT = (
    "coalesce(nullif(pg_catalog.current_setting('pgmesh.installed_at', true), ''), '-infinity')::timestamptz"
)


def _deciding(statement: str, origin: str, function: str, arguments: int) -> str:
    """`statement` (an UPDATE or DELETE ending in its WHERE) applied to a row the source wrote last (or
    this transaction, or one from before pgmesh, as `pgmesh.expect_origin` accepts); when it touched no
    row, decision function `function` gets the statement's first `arguments` parameters as text and
    decides."""
    args = ", ".join(f"${n}::text" for n in range(1, arguments + 1))
    version = f"pg_catalog.pg_xact_commit_timestamp_origin({TABLE_ALIAS}.xmin)"
    # the test inline: a PL/pgSQL call for every row not written by the source (every row from before
    # pgmesh, every conflict) costs the target as much as the update itself
    check = (
        f"CASE WHEN ({version}).roident = {origin} THEN true"
        # no commit time: this transaction's own row, or one older than what commit times keep
        f" WHEN ({version}).roident IS NULL THEN true"
        f" WHEN ({version}).roident = 0 THEN ({version}).\"timestamp\" < {_INSTALLED_AT}"
        " ELSE false END"
    )
    # the function only when no row was written (a one-time filter, tested before the call): cheaper for
    # the target than counting the CTE's rows (about 3 µs an UPDATE)
    return (
        f"WITH pgmesh_w AS ({statement} AND {check} RETURNING 1)"
        f" SELECT {function}(VARIADIC ARRAY[{args}]::text[]) WHERE NOT EXISTS (SELECT FROM pgmesh_w)"
    )



def update_sql(
    relation: Relation, table: TargetTable, sets: list[int], keys: list[int], origin: str | None,
    prepared: Prepared,
) -> str:
    """A keyed UPDATE setting columns `sets` (parameters $1...) of the row with key columns `keys` (the
    parameters after them). With `origin` (SQL for the source's origin id: a parameter, or a literal where
    the session has it in the statement's text) it applies only to a row the source wrote last, and
    otherwise calls its decision function (created through `prepared`), or raises for the careful path."""
    cols = relation.columns
    # an identity GENERATED ALWAYS is set by no UPDATE (router.apply.statements.update_sets): its value
    # is matched instead (the key's is anyway), so that its parameter still has a type
    always = [(n, i) for n, i in enumerate(sets, 1) if cols[i].name in table.always]
    written = [(n, i) for n, i in enumerate(sets, 1) if cols[i].name not in table.always]
    assignments = ", ".join(f"{quote_ident(cols[i].name)} = ${n}" for n, i in written) or untouched(
        table, [c.name for c in cols])
    matches = [
        f"{TABLE_ALIAS}.{quote_ident(cols[i].name)} = {typed(f'${n}', table.compare.get(cols[i].name))}"
        for n, i in [*enumerate(keys, len(sets) + 1), *always]
    ]
    where = " AND ".join(matches)
    statement = f"UPDATE {table.qualified} AS {TABLE_ALIAS} SET {assignments} WHERE {where}"
    if origin is not None and prepared.decisions is not None:
        decisions = prepared.decisions
        function = decisions.update(relation, table, sets, keys, prepared.creates, prepared.functions)
        return _deciding(statement, origin, function, len(sets) + len(keys))
    return guard(statement, origin)


def delete_sql(
    relation: Relation, table: TargetTable, keys: list[int], origin: str | None, prepared: Prepared
) -> str:
    """A keyed DELETE of the row with key columns `keys` (parameters $1...); `origin`: as `update_sql`."""
    cols = relation.columns
    where = " AND ".join(
        f"{TABLE_ALIAS}.{quote_ident(cols[i].name)} = {typed(f'${n}', table.compare.get(cols[i].name))}"
        for n, i in enumerate(keys, 1)
    )
    statement = f"DELETE FROM {table.qualified} AS {TABLE_ALIAS} WHERE {where}"
    if origin is not None and prepared.decisions is not None:
        function = prepared.decisions.delete(relation, table, keys, prepared.creates, prepared.functions)
        return _deciding(statement, origin, function, len(keys))
    return guard(statement, origin)


def prepared_update(
    relation: Relation,
    table: TargetTable,
    change: Update,
    prepared: Prepared,
    out: list[str],
    origin: int | None = None,
) -> str:
    new = change.new
    row_key = change.old if change.old is not None else new
    cols = relation.columns
    check_always(relation, table, change)
    shape = "U" if origin is None else "UG"
    plan = prepared.plans.get((id(relation), shape, new.kinds))
    if plan is not None:
        name, sets, keys = plan
        literals = _literals(relation, new, sets) + _literals(relation, row_key, keys)
        if origin is not None:
            literals.append(f"'{origin}'")
        return _execute(name, literals)
    sets = [i for i in range(len(cols)) if new.kinds[i] != KIND_UNCHANGED]
    keys = [i for i, c in enumerate(cols) if c.key]

    def build() -> str:
        origin_sql = None if origin is None else f"${len(sets) + len(keys) + 1}"
        return update_sql(relation, table, sets, keys, origin_sql, prepared)

    mask = bytes(1 if new.kinds[i] == KIND_UNCHANGED else 0 for i in range(len(cols)))
    name = prepared.name(relation, shape, mask, build, out)
    prepared.plans[(id(relation), shape, new.kinds)] = (name, sets, keys)
    literals = _literals(relation, new, sets) + _literals(relation, row_key, keys)
    if origin is not None:
        literals.append(f"'{origin}'")
    return _execute(name, literals)


def prepared_delete(
    relation: Relation,
    table: TargetTable,
    change: Delete,
    prepared: Prepared,
    out: list[str],
    origin: int | None = None,
) -> str:
    cols = relation.columns
    keys = [i for i, c in enumerate(cols) if c.key]

    def build() -> str:
        return delete_sql(relation, table, keys, None if origin is None else f"${len(keys) + 1}", prepared)

    name = prepared.name(relation, "D" if origin is None else "DG", b"", build, out)
    literals = _literals(relation, change.old, keys)
    if origin is not None:
        literals.append(f"'{origin}'")
    return _execute(name, literals)


def prepared_insert(
    relation: Relation,
    table: TargetTable,
    change: Insert,
    prepared: Prepared,
    out: list[str],
    setup: list[str] | None = None,
) -> str:
    """A single guarded insert as two prepared statements: the locks (the table shared, the key
    exclusive), then the insert, which raises PGM02 if a tombstone holds the key. Planned once per
    relation: a text INSERT ... SELECT with the tombstone check costs the server far more to parse and
    plan. With `setup` (`setup_args`), the first statement also does the origin's xact_setup (the
    transaction's first statement then: one fewer for the target to run), and sets `pgmesh.remote` when
    `setup` has it."""
    plan = prepared.insert_plans.get(id(relation))
    if plan is None:
        plan = _plan_insert(relation, table, prepared, out)
    insert, key_columns, key_types = plan
    values = _literals(relation, change.new, range(len(relation.columns)))
    keys = [values[i] for i in key_columns]
    if setup is None:
        lock = prepared.name(relation, "IL", b"", lambda: f"SELECT {insert_locks_sql(table, key_types)}", out)
        first = _execute(lock, keys)
    else:
        n = len(keys)
        remote = f" pg_catalog.set_config('pgmesh.remote', ${n + 3}, true)," if len(setup) > 2 else ""
        fused = prepared.name(
            relation, "ISL" if remote else "ISLB", b"",
            lambda: (f"SELECT pg_catalog.pg_replication_origin_xact_setup(${n + 1}, ${n + 2}),{remote}"
                     f" {insert_locks_sql(table, key_types)}"),
            out,
        )
        first = _execute(fused, [*keys, *setup])
    return f"{first};\n{_execute(insert, values)}"


def insert_locks_sql(table: TargetTable, key_types: list[str]) -> str:
    """The locks of a single guarded insert, its key as parameters $1...: the table's, shared (as
    `table_lock`), then the key's (`key_lock`)."""
    texts = [f"${n}::{t}::text" for n, t in enumerate(key_types, 1)]
    single = texts[0] if len(texts) == 1 else None
    key = ", ".join(texts)
    return (
        f"pg_catalog.pg_advisory_xact_lock_shared(pg_catalog.hashtext({quote_literal(table.name)}), 0),"
        f" {key_lock(table, f'ARRAY[{key}]::text[]', single)}"
    )


def _plan_insert(
    relation: Relation, table: TargetTable, prepared: Prepared, out: list[str]
) -> tuple[str, list[int], list[str]]:
    """The PREPARE (into `out`) of a single guarded insert into `relation`, where its key is."""
    sql, key_positions, key_types = insert_sql(relation, table, prepared)
    insert = prepared.name(relation, "IG", b"", lambda: sql, out)
    plan = (insert, key_positions, key_types)
    prepared.insert_plans[id(relation)] = plan
    return plan


def insert_sql(
    relation: Relation, table: TargetTable, prepared: Prepared
) -> tuple[str, list[int], list[str]]:
    """A single guarded insert into `relation` (every column a parameter, $1...): its SQL, the positions
    of its key's columns in the row and the types they are compared as."""
    cols = relation.columns
    position = {c.name: i for i, c in enumerate(cols)}
    key = [k for k in table.tombstone_key if k in position]
    key_types = [table.compare[k] for k in key]
    bounded = bounded_key(key_types)
    names = ", ".join(quote_ident(c.name) for c in cols)
    picks = ", ".join(f"${i + 1}::{table.types.get(c.name, 'text')}" for i, c in enumerate(cols))
    keys = ", ".join(f"${position[k] + 1}::{table.compare[k]}::text" for k in key)
    exists = (
        f"EXISTS (SELECT 1 FROM pgmesh.tombstones AS {TOMBSTONE_ALIAS}"
        f" WHERE {TOMBSTONE_ALIAS}.table_name = {quote_literal(table.name)}"
        f" AND {TOMBSTONE_ALIAS}.key = {tombstone_key(f'ARRAY[{keys}]::text[]', bounded)})"
    )
    plan = ([position[k] for k in key], key_types)
    decisions = prepared.decisions
    written = [c.name for c in cols if c.name not in table.always]
    if decisions is not None and table.pk and not table.deferred and written:
        # a tombstone: its decision function says whether to insert
        args = ", ".join(f"${i + 1}::text" for i in range(len(cols)))
        deleted = decisions.insert_deleted(relation, table, prepared.creates, prepared.functions)
        insert = (
            f"INSERT INTO {table.qualified} AS {TABLE_ALIAS} ({names}) {_OVERRIDING} SELECT {picks}"
            f" WHERE CASE WHEN {exists} THEN {deleted}(VARIADIC ARRAY[{args}]::text[]) ELSE true END"
        )
        if table.name not in decisions.contested:
            # a row with the key raises unique_violation: that transaction is decided the careful
            # way, and the table's inserts decide it in the statement from then on (`contested`,
            # router.apply.link.LinkSession.contest). Until then no ON CONFLICT: speculative insertion
            # costs every insert a third more on the target (and its walsender), conflict or not
            return insert, *plan
        # a row with the key: ON CONFLICT locks it and the other function says whether to overwrite it
        exists_fn = decisions.insert_exists(relation, table, prepared.creates, prepared.functions)
        # every column, the key too: equal by its collation is not the same bytes (as the careful
        # path writes the winning row whole); not an identity GENERATED ALWAYS (no UPDATE may set it)
        sets = ", ".join(f"{quote_ident(c)} = excluded.{quote_ident(c)}" for c in written)
        return (
            f"{insert} ON CONFLICT ({', '.join(quote_ident(k) for k in table.pk)}) DO UPDATE SET {sets}"
            f" WHERE {exists_fn}(VARIADIC ARRAY[{args}]::text[])", *plan,
        )
    # Raising in the WHERE clause (CASE evaluates in order; the subquery keeps the planner from
    # folding the call) is cheaper for the target than counting through a data-modifying CTE.
    return (
        f"INSERT INTO {table.qualified} ({names}) {_OVERRIDING} SELECT {picks}"
        f" WHERE CASE WHEN {exists} THEN pgmesh.expect_rows((SELECT 0::bigint), 1) IS NULL ELSE true END",
        *plan,
    )
