"""`router.config.parts`: a partial node's `tables`, `rows`, `columns` checked at parse, and described."""

from __future__ import annotations

import pytest

from router.config.model import parse_config
from router.config.parts import describe_part
from router.errors import ConfigError
from tests.unit.router.config.test_config import MINIMAL

BASE = MINIMAL  # nodes a and b: b (the last) is the one given a part


def with_part(part: str, receive_only: bool = True) -> str:
    return BASE + ("receive_only = true\n" if receive_only else "") + part


def test_a_receive_only_node_may_hold_part_of_the_data() -> None:
    config = parse_config(with_part(
        'tables = ["public.orders", "public.customers"]\n'
        '[nodes.rows]\n"public.orders" = "region = \'eu\'"\n'
        '[nodes.columns]\n"public.customers" = ["id", "name"]\n'
    ))
    r = config.node("b")
    assert r.tables == ["public.orders", "public.customers"]
    assert r.rows == {"public.orders": "region = 'eu'"}
    assert describe_part(r) == ("only public.orders, public.customers; rows of public.orders where"
                                " region = 'eu'; columns id, name of public.customers")
    assert describe_part(config.node("a")) == ""


@pytest.mark.parametrize(("part", "receive_only", "says"), [
    ('tables = ["public.orders"]\n', False, "nodes[1].tables: node b sends: only a receive_only node"),
    ('[nodes.rows]\n"public.orders" = "x > 1"\n', False, "nodes[1].rows: node b sends"),
    ('tables = ["orders"]\n', True, "name the table as schema.table"),
    ('tables = []\n', True, "an empty table list"),
    ('[nodes.rows]\n"public.orders" = " "\n', True, "an empty row filter"),
    ('[nodes.columns]\n"public.orders" = []\n', True, "is empty or names a column twice"),
    ('[nodes.columns]\n"public.orders" = ["id", "id"]\n', True, "is empty or names a column twice"),
    ('tables = ["public.a"]\n[nodes.rows]\n"public.orders" = "x > 1"\n', True,
     "nodes[1].rows: public.orders is not in this node's tables"),
])
def test_a_part_that_cannot_be_is_refused_at_parse(part: str, receive_only: bool, says: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(with_part(part, receive_only))
    assert says in str(refused.value), str(refused.value)
