"""`pgmesh compare` with partial nodes (router.cluster.compare.plan, .worker): what is compared where, and
the per-node SQL (the reference reads through the partial node's filter, both hash its columns); pure."""

from __future__ import annotations

from router.cluster.compare.plan import CompareTable, RangeTask, compared_on, integer_ranges
from router.cluster.compare.worker import (
    CompareJob,
    bucket_sql,
    range_sql,
    row_hash,
    row_hashes_sql,
    rows_sql,
)
from router.config.model import NodeConfig
from router.ops.compare.job import CompareReport, Divergence

ORDERS = CompareTable("public", "orders", ("id",), "integer")
CUSTOMERS = CompareTable("public", "customers", ("id",), "integer")
LOGS = CompareTable("public", "logs", ("id",), "integer")
KEPT = "coalesce((region = 'eu'), false)"


def render(composed: object) -> str:
    return composed.as_string(None)  # type: ignore[attr-defined,no-any-return]


def nodes() -> list[NodeConfig]:
    r = NodeConfig(
        "r", "host=r", receive_only=True, tables=["public.orders", "public.customers"],
        rows={"public.orders": "region = 'eu'"}, columns={"public.customers": ["id", "name"]},
    )
    s = NodeConfig("s", "host=s", receive_only=True)
    full = [NodeConfig("a", "host=a"), NodeConfig("b", "host=b"), s]
    return [r, *full]


def test_full_nodes_compare_with_each_other_and_a_partial_node_with_the_first_full_one() -> None:
    compared = compared_on([CUSTOMERS, LOGS, ORDERS], nodes())
    # s is receive-only but holds everything: a full node
    assert [(t.name, t.nodes) for t in compared[:3]] == [("customers", (1, 2, 3)), ("logs", (1, 2, 3)),
                                                         ("orders", (1, 2, 3))]
    assert all(t.rows is None and t.columns is None for t in compared[:3])
    # r: the two tables it gets (not logs), against a (the first full node), with its part of each
    assert compared[3:] == [
        CompareTable("public", "customers", ("id",), "integer", (1, 0), None, ("id", "name")),
        CompareTable("public", "orders", ("id",), "integer", (1, 0), "region = 'eu'", None),
    ]
    orders = compared[4]
    assert orders.filtered(1) and not orders.filtered(0)  # the reference reads through the filter, r not
    assert not compared[3].filtered(1)  # no filter: every row on both
    job = CompareJob(("r", "a", "b", "s"), ("", "", "", ""), ("", "", "", ""), tuple(compared))
    assert job.nodes_of(orders) == (1, 0) and job.nodes_of(CUSTOMERS) == (0, 1, 2, 3)


def test_a_lone_full_node_is_compared_with_nobody_but_its_partial_nodes() -> None:
    compared = compared_on([ORDERS], [NodeConfig("a", "host=a"), nodes()[0]])
    assert [(t.nodes, t.rows) for t in compared] == [((0, 1), "region = 'eu'")]


def test_the_reference_reads_only_the_rows_the_filter_keeps_at_every_step() -> None:
    orders = compared_on([ORDERS], nodes())[1]
    task = integer_ranges(1, 1, 100_000, 1)[0]
    for filtered in (True, False):
        queries = [range_sql(orders, task, filtered)[0], bucket_sql(orders, task, filtered)[0],
                   rows_sql(orders, task, [3], filtered)[0], row_hashes_sql(orders, filtered)]
        for query in queries:
            assert (KEPT in render(query)) == filtered, render(query)
    # no filter on the table: none anywhere
    assert "coalesce" not in render(range_sql(ORDERS, RangeTask(0, None, None), True)[0])
    # the filter's names are the table's columns only: nothing else in scope where it is evaluated
    recheck = render(row_hashes_sql(orders, True))
    assert recheck.startswith('SELECT ROW(t."id")::text, pg_catalog.hashtextextended((t.*)::text, 1)'
                              ' FROM "public"."orders" AS t WHERE (t."id") IN (SELECT r."id" FROM')
    assert recheck.endswith(f"AS r) AND {KEPT}")


def test_both_sides_hash_only_the_columns_the_partial_node_holds() -> None:
    customers = compared_on([CUSTOMERS], nodes())[1]
    expected = 'pg_catalog.hashtextextended(ROW(t."id", t."name")::text, 1)'
    assert render(row_hash(customers.columns)) == expected
    for filtered in (True, False):
        assert expected in render(range_sql(customers, RangeTask(1, "1", "9"), filtered)[0])
        assert expected in render(row_hashes_sql(customers, filtered))
    assert render(row_hash()) == "pg_catalog.hashtextextended((t.*)::text, 1)"
    weird = render(row_hash(['we"ird', "x y"]))  # every name quoted
    assert weird == 'pg_catalog.hashtextextended(ROW(t."we""ird", t."x y")::text, 1)'


def test_a_partial_node_s_difference_is_listed_against_its_reference() -> None:
    report = CompareReport(
        ["a", "b", "r"], ["public.orders"], [],
        [Divergence("public.orders", "(2)", '{"id": 2}', {"a": "00000000000000aa", "b": None}),
         Divergence("public.orders", "(4)", '{"id": 4}', {"a": None, "r": "00000000000000ff"})],
        [], True, 0.1,
    )
    lines = report.render().splitlines()
    assert lines[-2].split() == ["public.orders", "(2)", "00000000000000aa", "missing", "-"]
    assert lines[-1].split() == ["public.orders", "(4)", "missing", "-", "00000000000000ff"]
    assert report.exit_code == 1
