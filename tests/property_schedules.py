"""Random schedules for the property test (issue 17): table shapes and concurrent transactions, from a seed.

Owns: turning one integer seed into a `Schedule` (tables with their DDL, the rows every node starts
from, and per node and session a list of transactions of operations), every SQL text and parameter the
player sends, and the catalogue of column types, names and key encodings behind them.
Must not: talk to a server (the player, `tests.property_play`, does), or read any randomness other than
the `random.Random(seed)` it is given: the same seed always gives the same schedule.

Shapes: 1-3 tables, each with a primary key of 1-3 columns of different types (integers, numeric,
text, timestamptz, date, uuid, bytea, int4[], enums), 1-6 other columns (text large enough to be
TOASTed, numeric, float8 with its specials, timestamptz, jsonb, arrays with NULL elements, enums, bytea,
interval, bool, ranges, a composite type holding an array, a domain), named after SQL keywords and
after the aliases and labels pgmesh's generated SQL uses; some tables partitioned by range or list
over a key column, some with REPLICA IDENTITY FULL.
Transactions: inserts (plain, which may fail on a duplicate, or ON CONFLICT DO NOTHING), updates of some
columns (an untouched TOASTed column travels as pgoutput's "unchanged"), updates of the key (rows move
across partitions), deletes, multi-row updates and deletes, savepoints with ROLLBACK TO and RELEASE,
statements that fail on purpose, bulk inserts and updates of all of a node's rows larger than the test
nodes' `logical_decoding_work_mem` (64kB: they are streamed), and endings COMMIT, ROLLBACK, PREPARE
TRANSACTION then COMMIT PREPARED or ROLLBACK PREPARED. Keys 0..HOT-1 are shared by every node (inserts,
updates and deletes of the same rows at once: conflicts); other keys are each node's own. Shapes known
to end apart today are left out unless asked for (`KNOWN`, `make_schedule`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from psycopg import sql

from tests.property_types import ENUM_LABELS, FRESH, KEY_TYPES, TYPES, USER_TYPES, VALUE_TYPES, enum_type

HOT = 8  # keys every node writes
KNOWN = ("key_conflicts", "toast_conflicts", "root_only_full")  # shapes that fail today (make_schedule)
BULK_ROWS = (150, 450)  # a bulk insert: well over 64kB of changes, so the walsender streams it

# Names pgmesh's generated SQL uses or used for its own things (router/apply/statements.py, careful.py,
# router/conflicts/sql/*.sql), SQL keywords, and names that need quoting: user columns named so must not
# change what that SQL means.
PGMESH_NAMES = [
    "pgmesh_t", "pgmesh_v", "pgmesh_ts", "pgmesh_c", "pgmesh_f", "pgmesh_w", "pgmesh_c0", "pgmesh_c1",
    "pgmesh_row", "pgmesh_origin", "pgmesh_ours", "pgmesh_tableoid", "pgmesh_ctid", "t", "c", "v", "k",
    "a", "ts", "timestamp", "roident", "origin", "ours", "row", "key", "table_name", "xid", "col", "ord",
    "excluded", "old", "new", "count", "to_jsonb",
]
KEYWORDS = ["select", "order", "user", "group", "from", "table", "check", "default", "end", "all", "where"]
ODD = ["Mixed Case", "with space", 'quo"te', "semi;colon", "ünï", "x" * 63]
COLUMN_NAMES = PGMESH_NAMES + KEYWORDS + ODD
TABLE_WORDS = ["t", "c", "order", "pgmesh_t", "tombstones", "User Table", "select", "data"]


# --------------------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Column:
    name: str
    type: str  # a TYPES name or "enum"
    # (its SQL type: a built-in name, or the schedule's enum, composite "pair" or domain "word")
    sql_type: sql.Composable


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    key: tuple[str, ...]  # primary key columns, in order
    partition: tuple[str, str] | None  # ("range" | "list", column)
    replica_full: bool
    full_partitions: bool = True  # REPLICA IDENTITY FULL also on each partition (see make_schedule)

    @property
    def ident(self) -> sql.Identifier:
        return sql.Identifier("public", self.name)

    def column(self, name: str) -> Column:
        return next(c for c in self.columns if c.name == name)

    @property
    def others(self) -> list[Column]:
        return [c for c in self.columns if c.name not in self.key]

    def key_values(self, n: int) -> list[str]:
        """The n-th key: injective in n (at least one key column is not an enum)."""
        out = []
        for i, name in enumerate(self.key):
            col = self.column(name)
            if col.type == "enum":
                out.append(ENUM_LABELS[(n + i) % len(ENUM_LABELS)])
            else:
                maker = TYPES[col.type].key
                assert maker is not None
                out.append(maker(n))
        return out

    def own_range(self, index: int) -> tuple[sql.Composed, list[str]]:
        """WHERE the row's key is one of node `index`'s own: a range of the first key column that is no
        enum (its key encodings keep the order of n)."""
        column = next(k for k in self.key if self.column(k).type != "enum")
        first = (index + 1) * FRESH
        bounds = [self.key_values(n)[self.key.index(column)] for n in (first, first + FRESH)]
        typed, ident = _typed(self.column(column)), sql.Identifier(column)
        return sql.SQL("{} >= {} AND {} < {}").format(ident, typed, ident, typed), bounds

    def own_rows(self, index: int) -> tuple[sql.Composed, list[str]]:
        """Count and md5 of node `index`'s own rows: only that node writes them, so every node must end
        with exactly what it held when its sessions were done (nothing lost, nothing applied twice)."""
        where, bounds = self.own_range(index)
        query = sql.SQL("SELECT count(*), md5(coalesce(string_agg((r.*)::text, '|'"
                        " ORDER BY (r.*)::text), '')) FROM {} AS r WHERE {}").format(self.ident, where)
        return query, bounds

    def value(self, rng: random.Random, col: Column) -> str | None:
        if rng.random() < 0.15:
            return None
        return (enum_type() if col.type == "enum" else TYPES[col.type]).value(rng)


def _typed(col: Column) -> sql.Composable:
    return sql.SQL("{}::{}").format(sql.Placeholder(), col.sql_type)


def _key_where(table: Table, alias: sql.Composable | None = None) -> sql.Composable:
    parts = []
    for name in table.key:
        ident: sql.Composable = sql.Identifier(name)
        if alias is not None:
            ident = sql.SQL("{}.{}").format(alias, ident)
        parts.append(sql.SQL("{} = {}").format(ident, _typed(table.column(name))))
    return sql.SQL(" AND ").join(parts)


def make_table(
    rng: random.Random, name: str, user_types: dict[str, sql.Identifier], root_only_full: bool = False
) -> Table:
    def sql_type(t: str) -> sql.Composable:
        return user_types[t] if t in user_types else sql.SQL(TYPES[t].sql)

    names = rng.sample(COLUMN_NAMES, rng.randint(2, 9))
    nkey = min(len(names) - 1, rng.choice([1, 1, 1, 2, 2, 3]))
    key_types = [rng.choice(KEY_TYPES) for _ in range(nkey)]
    if nkey > 1 and rng.random() < 0.4:
        key_types[rng.randrange(1, nkey)] = "enum"
    columns = [Column(n, t, sql_type(t)) for n, t in zip(names, key_types, strict=False)]
    for n in names[nkey:]:
        t = rng.choice(VALUE_TYPES)
        columns.append(Column(n, t, sql_type(t)))
    rng.shuffle(columns)
    key = tuple(names[:nkey])
    partition = None
    if rng.random() < 0.35:
        rangeable = [k for k, t in zip(key, key_types, strict=True) if t != "enum" and TYPES[t].range_ok]
        listable = [k for k, t in zip(key, key_types, strict=True) if t in ("enum", "int4", "text")]
        if listable and (not rangeable or rng.random() < 0.4):
            partition = ("list", rng.choice(listable))
        elif rangeable:
            partition = ("range", rng.choice(rangeable))
    return Table(name, tuple(columns), key, partition, rng.random() < 0.3, not root_only_full)


def _partition_ddl(table: Table) -> list[tuple[sql.Composed, list[str]]]:
    """The partitions: RANGE over the key encodings of n (hot keys split, nodes' own keys apart) from
    MINVALUE to MAXVALUE; LIST over a few values, and a DEFAULT partition."""
    assert table.partition is not None
    how, column = table.partition
    col = table.column(column)
    out: list[tuple[sql.Composed, list[str]]] = []
    part = [sql.Identifier("public", f"{table.name} p{i}") for i in range(4)]
    if how == "range":
        maker = TYPES[col.type].key
        assert maker is not None
        cuts = [maker(HOT // 2), maker(int(1.5 * FRESH)), maker(int(2.5 * FRESH))]
        bounds = ["MINVALUE", *cuts, "MAXVALUE"]
        for i in range(4):
            lo = sql.SQL("MINVALUE") if i == 0 else sql.Literal(bounds[i])
            hi = sql.SQL("MAXVALUE") if i == 3 else sql.Literal(bounds[i + 1])
            out.append((sql.SQL("CREATE TABLE {} PARTITION OF {} FOR VALUES FROM ({}) TO ({})").format(
                part[i], table.ident, lo, hi), []))
        return out
    if col.type == "enum":
        groups = [ENUM_LABELS[:2], ENUM_LABELS[2:3]]
    elif col.type == "int4":
        groups = [[str(n) for n in range(0, HOT, 2)], [str(n) for n in range(1, HOT, 2)]]
    else:
        groups = [[f"k{n:08d}" for n in range(HOT // 2)]]
    for i, values in enumerate(groups):
        out.append((sql.SQL("CREATE TABLE {} PARTITION OF {} FOR VALUES IN ({})").format(
            part[i], table.ident, sql.SQL(", ").join(sql.Literal(v) for v in values)), []))
    out.append((sql.SQL("CREATE TABLE {} PARTITION OF {} DEFAULT").format(part[3], table.ident), []))
    return out


def _partition_names(table: Table, ddl: list[tuple[sql.Composed, list[str]]]) -> list[sql.Identifier]:
    count = len(ddl)
    indexes = range(4) if count == 4 else [*range(count - 1), 3]
    return [sql.Identifier("public", f"{table.name} p{i}") for i in indexes]


def table_ddl(table: Table) -> list[tuple[sql.Composed, list[str]]]:
    cols = [sql.SQL("{} {}").format(sql.Identifier(c.name), c.sql_type) for c in table.columns]
    cols.append(sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(sql.Identifier(k) for k in table.key)))
    statement = sql.SQL("CREATE TABLE {} ({})").format(table.ident, sql.SQL(", ").join(cols))
    if table.partition is not None:
        statement = sql.SQL("{} PARTITION BY {} ({})").format(
            statement, sql.SQL(table.partition[0].upper()), sql.Identifier(table.partition[1]))
    out: list[tuple[sql.Composed, list[str]]] = [(statement, [])]
    if table.partition is not None:
        parts = _partition_ddl(table)
        out += parts
        if table.replica_full and table.full_partitions:
            out += [(sql.SQL("ALTER TABLE {} REPLICA IDENTITY FULL").format(name), [])
                    for name in _partition_names(table, parts)]
    if table.replica_full:
        out.append((sql.SQL("ALTER TABLE {} REPLICA IDENTITY FULL").format(table.ident), []))
    return out


# --------------------------------------------------------------------------------------------- transactions


@dataclass(frozen=True)
class Op:
    """One step of a transaction: `sql` with `params` ("sql"), a savepoint step ("savepoint", "release",
    "rollback_to": `name`), or a statement that fails on purpose ("fail"). `rows` counts row changes."""

    kind: str
    statement: sql.Composed | None = None
    params: tuple[str | None, ...] = ()
    name: str = ""
    rows: int = 0


@dataclass(frozen=True)
class Transaction:
    ops: tuple[Op, ...]
    end: str  # commit | rollback | prepare_commit | prepare_rollback


@dataclass
class Schedule:
    seed: int
    nodes: list[str]
    tables: list[Table]
    ddl_node: str
    seed_rows: list[Op]  # one transaction on ddl_node before the concurrent phase
    known: frozenset[str]  # the shapes known to fail that it may hold (make_schedule)
    tag: str = ""  # the seed and this name its tables and types (a seed played again gets fresh names)
    sessions: dict[tuple[str, int], list[Transaction]] = field(default_factory=dict)

    @property
    def transactions(self) -> int:
        return 1 + sum(len(txs) for txs in self.sessions.values())

    @property
    def rows(self) -> int:
        ops = [*self.seed_rows, *(op for txs in self.sessions.values() for tx in txs for op in tx.ops)]
        return sum(op.rows for op in ops)

    def user_types(self) -> dict[str, sql.Identifier]:
        """The schedule's own types ("enum", "pair", "word": `USER_TYPES`), named after its seed."""
        return user_types(self.tag)

    def ddl(self) -> list[tuple[sql.Composed, list[str]]]:
        labels = sql.SQL(", ").join(sql.Literal(label) for label in ENUM_LABELS)
        types = self.user_types()
        out: list[tuple[sql.Composed, list[str]]] = [
            (sql.SQL("CREATE TYPE {} AS ENUM ({})").format(types["enum"], labels), []),
            (sql.SQL("CREATE TYPE {} AS (a int4, b text, c int4[])").format(types["pair"]), []),
            (sql.SQL("CREATE DOMAIN {} AS text CHECK (VALUE <> 'forbidden')").format(types["word"]), []),
        ]
        for table in self.tables:
            out += table_ddl(table)
        return out

    def table_names(self) -> list[str]:
        return [f"public.{t.name}" for t in self.tables]



def user_types(tag: str) -> dict[str, sql.Identifier]:
    return {t: sql.Identifier("public", f"{t} {tag}") for t in USER_TYPES}


class _Writer:
    """Draws one node's operations: keys it may touch (hot ones and its own) and fresh keys."""

    def __init__(self, rng: random.Random, tables: list[Table], index: int, known: frozenset[str]) -> None:
        self.rng = rng
        self.tables = tables
        self.first = self.next_key = (index + 1) * FRESH
        self.own: list[int] = []
        self.key_conflicts = "key_conflicts" in known
        self.toast_conflicts = "toast_conflicts" in known

    def fresh(self) -> int:
        self.next_key += 1
        self.own.append(self.next_key)
        return self.next_key

    def some_key(self) -> int:
        if self.own and self.rng.random() < 0.4:
            return self.rng.choice(self.own)
        return self.rng.randrange(HOT)

    def insert(self, table: Table, keys: list[int], conflict: str = "") -> Op:
        cols = [c for c in table.columns if c.name in table.key or self.rng.random() < 0.8]
        rows, params = [], []
        for n in keys:
            by_key = dict(zip(table.key, table.key_values(n), strict=True))
            rows.append(sql.SQL("({})").format(sql.SQL(", ").join(_typed(c) for c in cols)))
            params += [by_key[c.name] if c.name in by_key else table.value(self.rng, c) for c in cols]
        statement = sql.SQL("INSERT INTO {} ({}) VALUES {}{}").format(
            table.ident, sql.SQL(", ").join(sql.Identifier(c.name) for c in cols), sql.SQL(", ").join(rows),
            sql.SQL(conflict))
        return Op("sql", statement, tuple(params), rows=len(keys))

    def _sets(self, table: Table, hot: bool = False) -> tuple[sql.Composable, list[str | None]]:
        """Some of the columns, or all of them where a TOASTed value left as it was would reach a conflict
        unsent (a hot row, a table without REPLICA IDENTITY FULL; see make_schedule)."""
        if hot and not table.replica_full and not self.toast_conflicts:
            cols = list(table.others)
        else:
            cols = self.rng.sample(table.others, self.rng.randint(1, len(table.others)))
        sets = sql.SQL(", ").join(sql.SQL("{} = {}").format(sql.Identifier(c.name), _typed(c)) for c in cols)
        return sets, [table.value(self.rng, c) for c in cols]

    def update(self, table: Table, n: int) -> Op:
        sets, params = self._sets(table, n < HOT)
        statement = sql.SQL("UPDATE {} SET {} WHERE {}").format(table.ident, sets, _key_where(table))
        return Op("sql", statement, (*params, *table.key_values(n)), rows=1)

    def update_key(self, table: Table, n: int, to: int) -> Op:
        new = table.key_values(to)
        sets = sql.SQL(", ").join(
            sql.SQL("{} = {}").format(sql.Identifier(k), _typed(table.column(k))) for k in table.key)
        statement = sql.SQL("UPDATE {} SET {} WHERE {}").format(table.ident, sets, _key_where(table))
        return Op("sql", statement, (*new, *table.key_values(n)), rows=1)

    def delete(self, table: Table, keys: list[int]) -> Op:
        where = sql.SQL(" OR ").join(sql.SQL("({})").format(_key_where(table)) for _ in keys)
        params = [v for n in keys for v in table.key_values(n)]
        return Op("sql", sql.SQL("DELETE FROM {} WHERE {}").format(table.ident, where), tuple(params),
                  rows=len(keys))

    def update_many(self, table: Table, keys: list[int]) -> Op:
        sets, params = self._sets(table, any(n < HOT for n in keys))
        where = sql.SQL(" OR ").join(sql.SQL("({})").format(_key_where(table)) for _ in keys)
        statement = sql.SQL("UPDATE {} SET {} WHERE {}").format(table.ident, sets, where)
        keyed = (v for n in keys for v in table.key_values(n))
        return Op("sql", statement, (*params, *keyed), rows=len(keys))

    def update_all(self, table: Table) -> Op:
        """Every row of the table (a large transaction once bulk inserts have run)."""
        sets, params = self._sets(table, True)
        statement = sql.SQL("UPDATE {} SET {}").format(table.ident, sets)
        return Op("sql", statement, tuple(params), rows=BULK_ROWS[0])

    def update_own(self, table: Table) -> Op:
        """Every row of this node's own keys (a range of the first key column that is no enum: its key
        encodings keep the order of n), a large transaction once bulk inserts have run."""
        sets, params = self._sets(table)
        where, bounds = table.own_range(self.first // FRESH - 1)
        statement = sql.SQL("UPDATE {} SET {} WHERE {}").format(table.ident, sets, where)
        return Op("sql", statement, (*params, *bounds), rows=BULK_ROWS[0])

    def op(self) -> Op:
        rng = self.rng
        table = rng.choice(self.tables)
        roll = rng.random()
        if roll < 0.25:
            keys = [self.fresh() if rng.random() < 0.6 else self.some_key() for _ in range(rng.randint(1, 3))]
            return self.insert(table, keys, rng.choice(["", " ON CONFLICT DO NOTHING"]))
        if roll < 0.5:
            return self.update(table, self.some_key())
        if roll < 0.6 and self.key_conflicts:
            to = self.fresh() if rng.random() < 0.6 else self.some_key()
            return self.update_key(table, self.some_key(), to)
        if roll < 0.6:  # a key no other node writes, to a fresh one: the row may move to another partition
            n = rng.choice(self.own) if self.own else self.fresh()
            return self.update_key(table, n, self.fresh())
        if roll < 0.72:
            return self.delete(table, [self.some_key() for _ in range(rng.randint(1, 3))])
        if roll < 0.87:
            return self.update_many(table, [self.some_key() for _ in range(rng.randint(2, 5))])
        if roll < 0.9:  # 3% of statements fail on purpose
            return Op("fail", sql.Composed([sql.SQL("SELECT 1 / 0")]))
        if roll < 0.96:
            keys = [self.fresh() for _ in range(rng.randint(*BULK_ROWS))]
            return self.insert(table, keys, " ON CONFLICT DO NOTHING")
        return self.update_all(table) if self.key_conflicts else self.update_own(table)

    def transaction(self) -> Transaction:
        rng = self.rng
        ops: list[Op] = []
        stack: list[str] = []
        for i in range(rng.randint(1, 7)):
            roll = rng.random()
            if roll < 0.15:
                stack.append(f"s{i}")
                ops.append(Op("savepoint", name=stack[-1]))
            elif roll < 0.25 and stack:
                name = rng.choice(stack)
                ops.append(Op("rollback_to", name=name))
                del stack[stack.index(name) + 1:]
            elif roll < 0.3 and stack:
                name = rng.choice(stack)
                ops.append(Op("release", name=name))
                del stack[stack.index(name):]
            ops.append(self.op())
        end = rng.choices(["commit", "rollback", "prepare_commit", "prepare_rollback"], [70, 10, 14, 6])[0]
        return Transaction(tuple(ops), end)


def make_schedule(
    seed: int,
    nodes: list[str],
    transactions: tuple[int, int] = (2, 6),
    *,
    known: frozenset[str] = frozenset(),
    again: str = "",
) -> Schedule:
    """The schedule of `seed` over `nodes`: tables named after the seed (fresh in every schedule), the hot
    keys written on one node first, then on each node one or two sessions of transactions. `again`
    (for a seed played again on the same nodes) is added to the names, nothing else changes.

    `known` turns on shapes that end with nodes apart today (issue 17; each has its xfail test in
    tests/integration/test_property.py), left out by default so that the test finds what is new:
    - "key_conflicts": updates of the key of a row other nodes write at the same time (a hot key, or
      any row in a whole-table UPDATE): a key-changing UPDATE that met a conflict was not decided as
      the deletion of the old key and the insert of the new one. Converges since issue 18
      (test_key_update_against_concurrent_update_converges; 4 minutes of `--known key_conflicts` on 3
      nodes: 50 schedules, 0 failures), still off by default so the fixed seeds keep their schedules;
    - "toast_conflicts": updates of a hot row of a table without REPLICA IDENTITY FULL that leave a
      TOASTed column as it was: pgoutput does not send that value, so where the update wins over
      another node's version of the row, the other node's value of that column stays
      (test_unchanged_toast_value_in_a_conflict_converges);
    - "root_only_full": REPLICA IDENTITY FULL on a partitioned table's root and not on its partitions:
      an update that keeps the key and leaves a TOASTed column as it was stops the link
      (test_update_in_a_partition_of_a_full_identity_root_keeps_the_link)."""
    rng = random.Random(seed)
    count = rng.randint(1, 3)
    root_only = "root_only_full" in known
    tag = f"{seed}{again}"
    types = user_types(tag)
    words = [rng.choice(TABLE_WORDS) for _ in range(count)]
    tables = [make_table(rng, f"{word} {tag}#{i}", types, root_only) for i, word in enumerate(words)]
    ddl_node = rng.choice(nodes)
    seeder = _Writer(rng, tables, len(nodes), known)
    seed_rows = [seeder.insert(t, list(range(HOT))) for t in tables]
    schedule = Schedule(seed, list(nodes), tables, ddl_node, seed_rows, known, tag)
    for index, node in enumerate(nodes):
        writer = _Writer(rng, tables, index, known)
        for session in range(rng.choice([1, 1, 2])):
            txs = [writer.transaction() for _ in range(rng.randint(*transactions))]
            schedule.sessions[(node, session)] = txs
    return schedule
