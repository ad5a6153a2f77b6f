"""The careful path's unique-clash SQL (router.apply.uniques), no server: which keys a remote row is
checked on, and how a partial or expression index is evaluated on both rows (issue 17). The integration
tests (tests/integration/ports/test_pglogical_conflict_secondary_unique.py) run it on real clusters."""

from __future__ import annotations

from router.apply.statements import TargetTable
from router.apply.uniques import clash_wheres, index_where

TYPES = {"id": "integer", "pgmesh_r": "text", "n": "integer"}
TABLE = TargetTable(
    "public", "w", frozenset(TYPES), TYPES, pk=("id",), uniques=(("id", "n"), ("n",)),
    indexes=((("lower(pgmesh_r)", "n % 10"), "n > 0"), (("pgmesh_r",), None)),
)


def test_a_partial_expression_index_is_evaluated_on_the_local_row_and_on_the_remote_row() -> None:
    where = index_where(TABLE, TABLE.indexes[0], {"id": "1", "pgmesh_r": "X", "n": None})
    assert where == (
        "(n > 0) AND ROW((lower(pgmesh_r)), (n % 10)) = (SELECT (lower(pgmesh_r)), (n % 10) FROM"
        " (VALUES ('1'::integer, 'X'::text, NULL::integer)) AS \"pgmesh_r\"(\"id\", \"pgmesh_r\", \"n\")"
        " WHERE (n > 0))"
    )


def test_keys_checked() -> None:
    # a plain key with a NULL value never collides; one inside the primary key is skipped for an update
    # of the row found by that key; the indexes are always checked
    assert len(clash_wheres(TABLE, {"id": "1", "pgmesh_r": "x", "n": None}, updating=False)) == 2
    assert len(clash_wheres(TABLE, {"id": "1", "pgmesh_r": "x", "n": "2"}, updating=False)) == 4
    updating = clash_wheres(TABLE, {"id": "1", "pgmesh_r": "x", "n": "2"}, updating=True)
    assert updating[0] == '"pgmesh_t"."id" = \'1\'::integer AND "pgmesh_t"."n" = \'2\'::integer'
    assert len(updating) == 4  # (id, n) is not inside the primary key (id)
    single = index_where(TABLE, TABLE.indexes[1], {"id": "1"})
    assert single.startswith("(pgmesh_r) = (SELECT (pgmesh_r) FROM (VALUES ('1'::integer, NULL::text,")
