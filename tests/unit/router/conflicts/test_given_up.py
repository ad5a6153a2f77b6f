"""router.conflicts.given_up and router.apply.uniques.given_up_probes: a secondary unique key's name is the
one the given-up trigger's installer gives it (sql/given_up_ensure.sql: jsonb's text of a text[]), and a
remote row probes each key it claims a value on."""

from __future__ import annotations

from router.apply.statements import TargetTable
from router.apply.uniques import given_up_probes
from router.conflicts.given_up import plain_name, unique_name


def test_names_are_jsonb_text() -> None:
    # as PostgreSQL prints to_jsonb(ARRAY['tag'])::text, to_jsonb(ARRAY['a', 'b'])::text
    assert plain_name(("tag",)) == '["tag"]'
    assert plain_name(("a", 'quo"te', "ünï")) == '["a", "quo\\"te", "ünï"]'
    # to_jsonb(ARRAY['lower(email)'] || NULL::text)::text, with a predicate: ... || 'u'
    assert unique_name(("lower(email)",), None) == '["lower(email)", null]'
    assert unique_name(("b",), "u") == '["b", "u"]'


def test_probes_follow_the_keys_a_row_claims() -> None:
    table = TargetTable("public", "t", frozenset({"id", "a", "b", "e"}), {"id": "integer", "a": "integer",
                        "b": "text", "e": "text"}, ("id",), (("a",), ("id", "b")),
                        indexes=((("lower(e)",), "a > 0"),))
    probes = given_up_probes(table, {"id": "1", "a": "2", "b": None, "e": "X"}, updating=False)
    names = [name for name, _ in probes]
    assert names == ['["a"]', '["lower(e)", "a > 0"]']  # (id, b): b is NULL, so no value claimed
    assert "ARRAY[(\"a\")::text]::text[]" in probes[0][1]
    assert "WHERE (a > 0)" in probes[1][1]
    # an update of the row found by its key claims nothing on a key inside the primary key
    kinds = {"id": "integer", "a": "integer"}
    table2 = TargetTable("public", "t", frozenset(kinds), kinds, ("id", "a"), (("id",),))
    assert given_up_probes(table2, {"id": "1", "a": "2"}, updating=True) == []
