"""Tables without a key in `pgmesh compare` (router.cluster.compare.multiset) and what the reports' exit
codes say: pure."""

from __future__ import annotations

from router.cluster.compare.multiset import buckets_for, multiset_differences, row_text
from router.ops.compare.job import CompareReport, Divergence
from router.ops.compare.repair import Fix, RepairReport


def test_rows_whose_copies_differ_are_named_with_their_copies_per_node() -> None:
    a = {"(1,x)": 2, "(2,y)": 1, "(3,z)": 1}
    b = {"(1,x)": 2, "(2,y)": 2, "(4,w)": 1}
    c = {"(1,x)": 1, "(2,y)": 1, "(3,z)": 1}
    assert multiset_differences([a, b, c]) == [
        ("(1,x)", (2, 2, 1)),
        ("(2,y)", (1, 2, 1)),
        ("(3,z)", (1, None, 1)),
        ("(4,w)", (None, 1, None)),
    ]
    assert multiset_differences([a, dict(a)]) == []  # duplicates alike: equal


def test_buckets_keep_a_few_hundred_rows_each_within_bounds() -> None:
    assert buckets_for(0) == 64 and buckets_for(10_000) == 64
    assert buckets_for(1_000_000) == 4096
    assert buckets_for(10**10) == 1 << 16
    assert all(b & (b - 1) == 0 for b in (buckets_for(n) for n in (1, 99_999, 5_000_000)))


def test_row_text_quotes_the_columns_it_names() -> None:
    assert row_text().as_string(None) == "(t.*)::text"
    assert row_text(["a", "B c"]).as_string(None) == 'ROW(t."a", t."B c")::text'


def _report(**kw: object) -> CompareReport:
    base: dict[str, object] = dict(nodes=["a", "b"], tables=["public.t"], skipped=[], differences=[],
                                   unsettled=[], rechecked=True, seconds=0.1)
    base.update(kw)
    return CompareReport(**base)  # type: ignore[arg-type]


def test_compare_exits_non_zero_when_anything_was_not_compared_or_is_not_replicated() -> None:
    row = Divergence("public.h", "(1,x)", "", {"a": "2 copies", "b": "1 copy"}, {"a": 2, "b": 1})
    assert _report().exit_code == 0
    assert _report(differences=[row]).exit_code == 1
    assert _report(skipped=["public.x (missing on b)"]).exit_code == 4
    assert _report(unreplicated=["public.m_2024: ..."]).exit_code == 4
    assert _report(unsettled=[row]).exit_code == 3
    text = _report(differences=[row], unreplicated=["public.m_2024: not in publication"]).render()
    assert "2 copies" in text and "1 copy" in text and "not replicated: public.m_2024" in text


def test_repair_exits_non_zero_when_a_keyless_table_was_left_alone() -> None:
    done = RepairReport(_report(), [Fix("public.t", "(1)", "a", ["b"], [])])
    assert done.exit_code == 0
    left = RepairReport(_report(), [], ["public.h: ... `pgmesh repair --from NODE public.h` ..."])
    assert left.exit_code == 1 and "not repaired: public.h" in left.render()
