"""Identifier hygiene of generated SQL (issue 17), no server: a table whose columns are named after every
alias, label and helper pgmesh's SQL uses; no column reference in the fast or careful path's statements
resolves by name alone, and every alias pgmesh introduces is one of its reserved names.
(tests/integration/test_identifiers.py runs the same shapes on real clusters.)"""

from __future__ import annotations

import re

from protocol.messages import Column, Delete, Insert, Relation, TupleData, Update
from protocol.transactions import Transaction
from router.apply.careful.transaction import read_row_sql, read_tombstone_sql, row_where, write_row_sql
from router.apply.prepared import Prepared
from router.apply.scripts import CopyRun, transaction_segments
from router.apply.statements import KEY_LOCKS_MAX, RESERVED_NAMES, TABLE_ALIAS, TargetTable, identity_match

# Every name pgmesh's generated SQL uses or used for its own things (aliases, lateral function columns,
# output labels, helper functions, tombstone columns), as user columns.
NAMES = (
    "c", "t", "v", "r", "x", "k", "old", "new", "ts", "origin", "ours", "row", "timestamp", "roident",
    "xid", "xmin_", "key", "table_name", "to_jsonb", "count", "pgmesh_w", "c0", "c1", "excluded", "got",
    "wanted", "expected", "row_xmin", "a", "col", "ord", "qualified", "root", "deleted_key", "s", "f",
)
KEYED = Relation(7, "public", "t", "d", tuple(Column(n, 23, -1, n == "c") for n in NAMES))
FULL = Relation(8, "public", "x", "f", tuple(Column(n, 23, -1, True) for n in NAMES))
TYPES = {n: "integer" for n in NAMES}
TABLES = {
    ("public", "t"): TargetTable("public", "t", frozenset(NAMES), TYPES, pk=("c",), uniques=(("v", "key"),)),
    ("public", "x"): TargetTable("public", "x", frozenset(NAMES), TYPES),
}
# Qualifiers pgmesh may use: its aliases, schemas, and INSERT ... ON CONFLICT's `excluded` (which only
# ever names the proposed row there, whatever the table's columns are called).
QUALIFIERS = RESERVED_NAMES | {"pg_catalog", "pgmesh", "public", "excluded"}
_TOKEN = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|[A-Za-z_][A-Za-z0-9_$]*|\$\d+|::|\S")
_NOT_ALIASES = {"select", "update", "delete", "insert", "with", "("}


def _name(token: str) -> str:
    return token[1:-1].replace('""', '"') if token.startswith('"') else token.lower()


def misplaced(sql: str) -> list[str]:
    """References in `sql` to a user column name that are not qualified by one of pgmesh's aliases (nor
    a column being written: an INSERT's or ON CONFLICT's column list, a SET target), and aliases
    pgmesh introduces that are not its reserved names."""
    tokens = [t for t in _TOKEN.findall(sql) if not t.startswith("'")]
    bad: list[str] = []
    targets = 0  # > 0: inside a column list being written
    depth = 0
    set_depth: int | None = None  # the parenthesis depth of an UPDATE's SET list
    for i, token in enumerate(tokens):
        prev = tokens[i - 1].lower() if i else ""
        following = tokens[i + 1] if i + 1 < len(tokens) else ""
        if token == "(":
            depth += 1
            if targets or (prev == "conflict") or (i >= 4 and tokens[i - 4].lower() == "into"):
                targets = depth
            continue
        if token == ")":
            if targets == depth:
                targets = 0
            depth -= 1
            continue
        if prev == "set":
            set_depth = depth
        elif token.lower() in {"where", "from"} and set_depth == depth:
            set_depth = None
        is_name = token.startswith('"') or token[0].isalpha() or token[0] == "_"
        if not is_name:
            continue
        name = _name(token)
        if prev == "as" and token.lower() not in _NOT_ALIASES:
            if not name.startswith("pgmesh_"):
                bad.append(f"alias {token}")
            continue
        if following == ".":
            if name not in QUALIFIERS:
                bad.append(f"qualifier {token}")
            continue
        if prev in {".", "::"} or name not in NAMES:
            continue  # qualified, a type, or no user column's name
        if prev in {"from", "with", "join"}:
            continue  # a relation (pgmesh's CTE pgmesh_w): never resolved against columns
        if targets or (set_depth == depth and following == "=" and prev in {"set", ","}):
            continue
        bad.append(f"unqualified {token} at token {i}")
    return bad


def txn(*changes: object) -> Transaction:
    return Transaction(
        xid=5, commit_lsn=0x100, end_lsn=0x200, commit_time=0, changes=list(changes),  # type: ignore[arg-type]
        relations={KEYED.relid: KEYED, FULL.relid: FULL},
    )


def row(value: int) -> TupleData:
    return TupleData(b"t" * len(NAMES), tuple(str(value + i).encode() for i in range(len(NAMES))))


def fast_path_sql() -> list[str]:
    """Every shape of statement the fast path sends: plain and guarded, prepared or not, keyed or by the
    whole row, single and multi-row inserts, a big transaction that locks tables, a COPY's fallback."""
    changes = [
        Insert(7, row(1)), Update(7, row(2), row(1), "K"), Delete(7, row(2), "K"),
        Insert(8, row(1)), Insert(8, row(5)), Update(8, row(2), row(1), "O"), Delete(8, row(2), "O"),
        Insert(7, row(9)),
    ]
    out: list[str] = []
    for guard in (None, 3):
        for prepared in (None, Prepared()):
            prelude: list[str] = []
            segments = transaction_segments(
                txn(*changes), TABLES, prepared=prepared, guard_origin=guard, prelude=prelude
            )
            out += prelude + [s for s in segments if isinstance(s, str)]
    big = [Insert(7, row(i)) for i in range(KEY_LOCKS_MAX + 300)]
    for segment in transaction_segments(txn(*big), TABLES, guard_origin=3):
        out.append(segment.fallback() if isinstance(segment, CopyRun) else segment)
    return out


def careful_path_sql() -> list[str]:
    """The careful path's reads (by key, by whole row, by a secondary unique key but another row) and
    writes of the same table."""
    table = TABLES[("public", "t")]
    values = {n: str(i) for i, n in enumerate(NAMES)}
    by_key = row_where(values, table.pk)
    own = f"{TABLE_ALIAS}.ctid = '(0,1)'"
    return [
        read_row_sql(table, by_key),
        read_row_sql(table, identity_match(KEYED, row(1), full=True)),
        read_row_sql(table, f"({row_where(values, ('v', 'key'))}) AND NOT ({own})"),
        read_tombstone_sql("ARRAY[('1'::integer)::text]::text[]"),
        write_row_sql(table, values, None),
        write_row_sql(table, values, own),
        write_row_sql(table, dict.fromkeys(NAMES), by_key),
    ]


def test_the_checker_sees_what_issue_17_hit() -> None:
    old = (
        "SELECT to_jsonb(t)::text AS row, (c).timestamp AS ts FROM \"public\".\"t\" t,"
        " LATERAL pg_catalog.pg_xact_commit_timestamp_origin(t.xmin) c WHERE \"c\" = '1'"
    )
    found = misplaced(old)
    assert "unqualified to_jsonb at token 1" in found and "alias row" in found and "alias ts" in found
    assert any(f.startswith("unqualified c ") for f in found) and "qualifier t" in found
    assert any(f.startswith('unqualified "c"') for f in found)


def test_fast_path_sql_qualifies_every_reference() -> None:
    statements = fast_path_sql()
    text = "\n".join(statements)
    # every shape was built
    for shape in ("PREPARE", "EXECUTE", "pgmesh_w", "pgmesh_v", "pgmesh_f", "pgmesh.tombstones", "UPDATE"):
        assert shape in text, shape
    for sql in statements:
        assert misplaced(sql) == [], sql[:300]


def test_careful_path_sql_qualifies_every_reference() -> None:
    for sql in careful_path_sql():
        assert misplaced(sql) == [], sql[:300]
        assert not re.search(r"\b(?<![.\"])(to_jsonb|xid|count|pg_current_xact_id)\s*\(", sql), sql
