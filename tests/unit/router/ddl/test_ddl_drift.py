"""`router.ddl.drift`'s comparison (pure) and `[ddl] mode` in the config (issue 18, item 3)."""

from __future__ import annotations

import re

import pytest

from router.apply.applier import Applier
from router.apply.state import LinkHold, LinkState, Liveness
from router.config.model import parse_config
from router.ddl.drift import Shape, compare, drifted_nodes, shapes_from_rows
from router.errors import ConfigError
from router.progress.positions import LinkProgress
from router.service.metrics import LINK_STATES
from router.stream.linkqueue import LinkQueue

T = "public.t"
BASE: Shape = (("id", "bigint", True), ("v", "text", False))


def with_column(*column: tuple[str, str, bool]) -> Shape:
    return tuple(sorted((*BASE, *column)))


def test_rows_become_shapes_sorted_by_name_whatever_the_attnum_order() -> None:
    rows = [(T, "v", "text", False), (T, "id", "bigint", True), ("public.u", "k", "integer", True)]
    other = [(T, "id", "bigint", True), (T, "v", "text", False), ("public.u", "k", "integer", True)]
    assert shapes_from_rows(rows) == shapes_from_rows(other)
    assert shapes_from_rows(rows)[T] == BASE


def test_same_columns_everywhere_is_no_drift() -> None:
    assert compare({"a": {T: BASE}, "b": {T: BASE}, "c": {T: BASE}}) == {}
    assert compare({"a": {}, "b": {}}) == {}


def test_two_nodes_differing_in_a_type_both_drift_naming_the_column() -> None:
    found = compare({"a": {T: with_column(("z", "text", False))},
                     "b": {T: with_column(("z", "integer", False))}})
    drift = found[T]
    assert drift.nodes == ("a", "b") and drift.columns == ("z",)
    assert drift.detail == "column z: text on a; integer on b"
    assert drift.describe() == "table public.t differs on a, b: column z: text on a; integer on b"


def test_a_majority_leaves_only_the_odd_node_drifted() -> None:
    z = with_column(("z", "integer", False))
    found = compare({"a": {T: z}, "b": {T: with_column(("z", "integer", True))}, "c": {T: z}})
    assert found[T].nodes == ("b",)
    assert found[T].detail == "column z: integer on a, c; integer NOT NULL on b"
    assert drifted_nodes(found) == {"b": [found[T]]}


def test_no_majority_drifts_every_node() -> None:
    found = compare({"a": {T: with_column(("z", "text", False))},
                     "b": {T: with_column(("z", "integer", False))}, "c": {T: BASE}})
    assert found[T].nodes == ("a", "b", "c")
    assert found[T].detail == "column z: text on a; integer on b; missing on c"


def test_a_table_missing_from_a_node_is_drift() -> None:
    found = compare({"a": {T: BASE, "public.u": BASE}, "b": {T: BASE, "public.u": BASE}, "c": {T: BASE}})
    assert list(found) == ["public.u"]
    assert found["public.u"].nodes == ("c",)
    assert found["public.u"].detail == "table published on a, b; absent on c"


def test_many_differing_columns_are_named_up_to_five() -> None:
    wide = with_column(*((f"c{i}", "integer", False) for i in range(7)))
    found = compare({"a": {T: wide}, "b": {T: BASE}})
    assert found[T].columns == tuple(f"c{i}" for i in range(7))
    assert found[T].detail.endswith("(and 2 more columns)")


def test_schema_drift_is_a_link_state_in_the_metrics() -> None:
    assert "schema_drift" in LINK_STATES


MINIMAL = '[cluster]\nname = "d"\n[[nodes]]\nname = "a"\ndsn = "x"\n[[nodes]]\nname = "b"\ndsn = "y"\n'


def test_ddl_mode_defaults_to_replicated_and_accepts_locked() -> None:
    assert parse_config(MINIMAL).ddl.mode == "replicated"
    assert parse_config(MINIMAL + '[ddl]\nmode = "locked"\n').ddl.mode == "locked"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('[ddl]\nmode = "global"\n', "ddl.mode: 'global' is not one of replicated, locked"),
        ('[replication]\nreplicate_ddl = false\n[ddl]\nmode = "locked"\n', "ddl.mode: locked needs"),
        ('[ddl]\nlock = true\n', "unknown key 'lock' in [ddl]"),
    ],
)
def test_ddl_mode_is_validated(extra: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(MINIMAL + extra)


def applier() -> Applier:
    config = parse_config(MINIMAL)
    return Applier(config, "a", config.node("b"), LinkQueue(10), LinkProgress("a", "b"))


def test_a_drifted_link_holds_through_resume_and_runs_once_released() -> None:
    link = applier()
    link.add_hold(LinkHold.DRIFT, "table public.t differs on a, b: column z: text on a; integer on b")
    assert link.state is LinkState.SCHEMA_DRIFT and "column z" in (link.last_error or "")
    assert not link.ready_for_more
    link.resume()  # `pgmesh resume`: the router compares again; until the tables agree, held
    assert link.state is LinkState.SCHEMA_DRIFT and not link.ready_for_more
    link.drop_hold(LinkHold.DRIFT)
    assert (link.state, link.last_error) == (LinkState.DOWN, None)  # not connected here: it reconnects
    link.drop_hold(LinkHold.DRIFT)  # again: nothing to do
    assert link.drift is None


def test_release_keeps_an_operator_pause_and_an_error() -> None:
    paused = applier()
    paused.add_hold(LinkHold.DRIFT, "drift")
    paused.pause()
    paused.drop_hold(LinkHold.DRIFT)
    assert paused.state is LinkState.PAUSED and paused.user_paused
    failed = applier()
    failed.condition.to(Liveness.ERROR, "node b: 42701")
    failed.add_hold(LinkHold.DRIFT, "drift")
    assert (failed.state, failed.last_error) == (LinkState.ERROR, "node b: 42701")  # the error stays in view
    failed.resume()
    assert (failed.state, failed.last_error) == (LinkState.SCHEMA_DRIFT, "drift")
    failed.drop_hold(LinkHold.DRIFT)
    assert failed.state is LinkState.DOWN


def test_what_fills_a_column_is_part_of_its_shape() -> None:
    rows = [(T, "id", "bigint", True, ""), (T, "v", "text", False, "DEFAULT now()")]
    assert shapes_from_rows(rows)[T] == (("id", "bigint", True), ("v", "text", False, "DEFAULT now()"))
    found = compare({"a": shapes_from_rows(rows), "b": {T: BASE}, "c": {T: BASE}})
    assert found[T].describe() == (
        "table public.t differs on a: column v: text DEFAULT now() on a; text on b, c"
    )


def test_an_enum_in_another_order_is_drift_of_the_type() -> None:
    def labels(text: str) -> dict[str, Shape]:
        return shapes_from_rows([("type public.mood", "labels", text, False, "")])

    found = compare({"a": labels("'sad', 'ok'"), "b": labels("'ok', 'sad'"), "c": labels("'sad', 'ok'")})
    drift = found["type public.mood"]
    assert (drift.kind, drift.table, drift.nodes) == ("type", "public.mood", ("b",))
    assert drift.describe() == "type public.mood differs on b: labels: 'sad', 'ok' on a, c; 'ok', 'sad' on b"
    assert drifted_nodes(found) == {"b": [drift]}


def test_a_domain_missing_on_a_node_is_named_as_a_domain() -> None:
    pos = shapes_from_rows([("domain public.pos", "definition", "integer", False, "CHECK ((VALUE > 0))")])
    found = compare({"a": pos, "b": pos, "c": {}})
    assert found["domain public.pos"].describe() == (
        "domain public.pos differs on c: domain used on a, b; absent on c"
    )
