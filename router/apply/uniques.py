"""Where a remote row would collide with other rows on a secondary unique key, as SQL: the careful path's
(router.apply.careful.transaction) WHERE clauses for `_unique_clash`, and the row matches it shares.

A plain unique key (a column list) collides where those columns equal the remote row's values. A unique
index with a predicate or on expressions (`UNIQUE (b) WHERE u`, `UNIQUE (lower(email))`) collides only
where both rows satisfy the predicate and the index's terms are equal: the terms and the predicate are
evaluated on the local row (the table under TABLE_ALIAS, the one relation in scope) and on the remote
row, a one-row VALUES under REMOTE_ALIAS holding every column of the table cast to its type (the one
relation in scope inside that subquery: the catalog's deparsed expressions name columns unqualified).
NULL terms never collide (a unique index's NULLs are distinct; NULLS NOT DISTINCT is not taken into
account, as for plain keys).

Must not: connect, decide conflicts, or write.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from router.apply.statements import (
    REMOTE_ALIAS,
    TABLE_ALIAS,
    TargetTable,
    UniqueIndex,
    quote_ident,
    quote_literal,
    typed,
)
from router.conflicts.given_up import plain_name, unique_name

__all__ = ["clash_wheres", "given_up_probes", "literal", "row_where"]

T = TABLE_ALIAS


def literal(value: Any) -> str:
    """A value of a decoded row (text, or a JSON-like value a resolver returned) as an SQL literal."""
    if value is None:
        return "NULL"
    if isinstance(value, (dict, list)):
        return quote_literal(json.dumps(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    return quote_literal(str(value))


def row_where(values: Mapping[str, Any], columns: tuple[str, ...], types: Mapping[str, str] | None = None,
              ) -> str:
    """`columns` of TABLE_ALIAS equal to (or, for None, NULL as) `values`, cast to `types` (the target's
    column types by name: an untyped literal compared with a composite would be read as a record)."""
    kinds, ident = types or {}, quote_ident
    return " AND ".join(f"{T}.{ident(k)} IS NULL" if values.get(k) is None
                        else f"{T}.{ident(k)} = {typed(literal(values[k]), kinds.get(k))}" for k in columns)


def _remote_row(table: TargetTable, row: Mapping[str, Any]) -> str:
    """`row` as a one-row relation REMOTE_ALIAS with every column of `table`, each cast to its type (a
    column the row lacks is NULL, cast to its base type: a NOT NULL domain refuses a NULL)."""
    names = tuple(table.types) or tuple(sorted(table.columns))
    values = ", ".join(
        f"{literal(row[n])}::{table.types.get(n, 'text')}" if row.get(n) is not None
        else f"NULL::{table.compare.get(n, 'text')}"
        for n in names
    )
    return f"(VALUES ({values})) AS {REMOTE_ALIAS}({', '.join(quote_ident(n) for n in names)})"


def index_where(table: TargetTable, index: UniqueIndex, row: Mapping[str, Any]) -> str:
    """The rows of TABLE_ALIAS (the only relation in scope) that `row` collides with on `index`."""
    terms, where = index
    both = ", ".join(f"({term})" for term in terms)
    local = both if len(terms) == 1 else f"ROW({both})"
    remote = f"(SELECT {both} FROM {_remote_row(table, row)}{f' WHERE ({where})' if where else ''})"
    return f"({where}) AND {local} = {remote}" if where else f"{local} = {remote}"


def clash_wheres(table: TargetTable, row: Mapping[str, Any], *, updating: bool, moved: bool = False,
                 ) -> list[str]:
    """One WHERE per secondary unique key of `table` on which `row` may collide with another row: every
    plain key whose columns `row` has non-NULL (but the ones inside the primary key when `updating` a
    row found by that key), and every unique index with a predicate or on expressions; first the
    primary key itself when `moved` (an update moving its row to another key)."""
    wheres = [row_where(row, table.pk, table.compare)] if moved and table.pk else []
    for unique in table.uniques:
        if any(row.get(c) is None for c in unique) or (updating and set(unique) <= set(table.pk)):
            continue
        wheres.append(row_where(row, unique, table.compare))
    wheres += [index_where(table, index, row) for index in table.indexes]
    return wheres


def given_up_probes(table: TargetTable, row: Mapping[str, Any], *, updating: bool) -> list[tuple[str, str]]:
    """Per secondary unique key of `table` on which `row` claims a value: the key's name (as the given-up
    trigger names it, router.conflicts.given_up) and SQL for the value `row` claims there (a text[], each
    term as text; NULL where the row is outside the index's predicate). The same keys as `clash_wheres`
    (without the primary key)."""
    probes = []
    for unique in table.uniques:
        if any(row.get(c) is None for c in unique) or (updating and set(unique) <= set(table.pk)):
            continue
        terms = ", ".join(f"({quote_ident(c)})::text" for c in unique)
        probes.append((plain_name(unique), f"(SELECT ARRAY[{terms}]::text[] FROM {_remote_row(table, row)})"))
    for terms_of, where in table.indexes:
        terms = ", ".join(f"({term})::text" for term in terms_of)
        inside = f" WHERE ({where})" if where else ""
        value = f"(SELECT ARRAY[{terms}]::text[] FROM {_remote_row(table, row)}{inside})"
        probes.append((unique_name(terms_of, where), value))
    return probes
