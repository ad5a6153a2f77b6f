"""The pure parts of global sequences: node id assignment, the snowflake layout, step progressions, and
telling a column's mode from its default and sequence. No server; the integration side is
tests/integration/test_sequences.py.
"""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.config.model import parse_config
from router.errors import ConfigError, PgmeshError
from router.sequences.convert import _snowflake_problem, _step_problem
from router.sequences.ids import (
    EPOCH_MS,
    MAX_NODE_ID,
    Mode,
    NodeSequences,
    SequenceColumn,
    default_kind,
    detect_mode,
    disagreements,
    first_in_progression,
    parse_node_id,
    plan_node_ids,
    render_status,
    snowflake,
    snowflake_floor,
    snowflake_parts,
    status_json,
)


def column(
    default: str | None = "nextval('t_id_seq'::regclass)",
    *,
    identity: str = "",
    type_: str = "bigint",
    increment: int = 1,
    start: int = 1,
    last: int | None = None,
) -> SequenceColumn:
    return SequenceColumn(
        "public", "t", "id", type_, identity, default, "public", "t_id_seq", increment, start, 2**63 - 1,
        "bigint", last,
    )


# ---------------------------------------------------------------------------------------------------------
# Node ids


def test_new_nodes_get_the_smallest_free_ids_in_config_order() -> None:
    assert plan_node_ids(["a", "b", "c"], {}) == {"a": 0, "b": 1, "c": 2}
    assert plan_node_ids(["a", "b", "c"], {"a": None, "b": 0, "c": None}) == {"a": 1, "b": 0, "c": 2}


def test_existing_ids_are_kept_and_the_id_of_a_node_that_left_is_reused() -> None:
    # b (id 1) left; d joins: it gets 1, the smallest id no current node holds.
    assert plan_node_ids(["a", "c", "d"], {"a": 0, "c": 2, "d": None}) == {"a": 0, "c": 2, "d": 1}
    # ids of nodes outside the config do not count, whatever they were.
    assert plan_node_ids(["x", "y"], {"x": 7, "gone": 0}) == {"x": 7, "y": 0}


def test_two_current_nodes_with_one_id_are_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"node a and node d both have node id 0") as refused:
        plan_node_ids(["a", "b", "d"], {"a": 0, "b": 1, "d": 0})
    assert "node_info" in (refused.value.hint or "")


def test_node_ids_run_out_after_1024_nodes() -> None:
    names = [f"n{i}" for i in range(MAX_NODE_ID + 2)]
    with pytest.raises(ConfigError, match=r"no node id left for node n1024"):
        plan_node_ids(names, {})


def test_a_stored_node_id_must_be_a_number_in_range() -> None:
    assert parse_node_id("a", "1023") == 1023
    for bad in ("1024", "-1", "x", ""):
        with pytest.raises(PgmeshError, match=r"node a: .*not a number 0\.\.1023"):
            parse_node_id("a", bad)


# ---------------------------------------------------------------------------------------------------------
# Snowflake layout


def test_snowflake_layout_40_10_14() -> None:
    assert int(dt.datetime(2025, 1, 1, tzinfo=dt.UTC).timestamp() * 1000) == EPOCH_MS
    assert snowflake(EPOCH_MS, 0, 0) == 0
    assert snowflake(EPOCH_MS + 1, 0, 0) == 1 << 24
    assert snowflake(EPOCH_MS, 1, 0) == 1 << 14
    assert snowflake(EPOCH_MS, 0, 16384 + 5) == 5  # the counter is the sequence's value mod 16384
    # 40 + 10 + 14 bits fill all 64 of a bigint: from 2042-06-03 (time field 2**39) ids are negative.
    sign_flip = EPOCH_MS + (1 << 39)
    assert dt.datetime.fromtimestamp(sign_flip / 1000, dt.UTC).date() == dt.date(2042, 6, 3)
    assert snowflake(sign_flip - 1, MAX_NODE_ID, 16383) == 2**63 - 1
    assert snowflake(sign_flip, 0, 0) == -(2**63)
    assert snowflake(EPOCH_MS + (1 << 40) - 1, MAX_NODE_ID, 16383) == -1
    with pytest.raises(ValueError):
        snowflake(EPOCH_MS - 1, 0, 0)
    with pytest.raises(ValueError):
        snowflake(EPOCH_MS + (1 << 40), 0, 0)


@given(
    st.integers(EPOCH_MS, EPOCH_MS + (1 << 40) - 1),
    st.integers(0, MAX_NODE_ID),
    st.integers(0, 16383),
)
def test_snowflake_parts_inverts_the_layout(ms: int, node: int, counter: int) -> None:
    value = snowflake(ms, node, counter)
    assert -(2**63) <= value < 2**63
    assert snowflake_parts(value) == (ms, node, counter)
    if ms < EPOCH_MS + (1 << 39) - 1:  # ordered by time while the sign bit is clear
        assert 0 <= snowflake_floor(ms) <= value < snowflake_floor(ms + 1)


@given(st.integers(EPOCH_MS, EPOCH_MS + (1 << 39)), st.integers(0, 1023), st.integers(0, 1023))
def test_ids_of_two_nodes_never_meet(ms: int, one: int, other: int) -> None:
    if one != other:
        assert {snowflake(ms, one, c) for c in range(0, 16384, 997)}.isdisjoint(
            {snowflake(ms, other, c) for c in range(0, 16384, 997)}
        )


# ---------------------------------------------------------------------------------------------------------
# Step progressions


def test_first_value_above_in_a_nodes_progression() -> None:
    assert first_in_progression(0, 100, 0) == 100
    assert first_in_progression(0, 100, 1) == 1
    assert first_in_progression(1050, 100, 0) == 1100
    assert first_in_progression(1050, 100, 2) == 1102
    assert first_in_progression(1100, 100, 0) == 1200  # strictly above
    assert first_in_progression(1099, 100, 99) == 1199


@given(st.integers(-(10**6), 10**12), st.integers(2, 1024), st.data())
def test_progressions_are_above_and_disjoint(above: int, step: int, data: st.DataObject) -> None:
    offset = data.draw(st.integers(0, step - 1))
    value = first_in_progression(above, step, offset)
    assert above < value <= above + step
    assert value % step == offset


# ---------------------------------------------------------------------------------------------------------
# Defaults and modes


@pytest.mark.parametrize(
    ("default", "identity", "kind"),
    [
        ("nextval('t_id_seq'::regclass)", "", "nextval"),
        ("nextval('\"We ird\".\"T 3_id_seq\"'::regclass)", "", "nextval"),
        ("nextval('it''s'::regclass)", "", "nextval"),
        ("pgmesh.snowflake_nextval('t_id_seq'::regclass)", "", "snowflake"),
        ("snowflake_nextval('sales.t_id_seq'::regclass)", "", "snowflake"),
        (None, "a", "identity"),
        (None, "d", "identity"),
        (None, "", "none"),
        ("(nextval('t_id_seq'::regclass) * 2)", "", "other"),
        ("other.snowflake_nextval('t_id_seq'::regclass)", "", "other"),
        ("0", "", "other"),
    ],
)
def test_default_kind(default: str | None, identity: str, kind: str) -> None:
    assert default_kind(default, identity) == kind


def test_detect_mode() -> None:
    assert detect_mode(column()) == Mode("local")
    assert str(detect_mode(column())) == "local (unconverted)"
    assert detect_mode(column("pgmesh.snowflake_nextval('t_id_seq'::regclass)")) == Mode("snowflake")
    stepped = column(increment=100, start=1102, last=None)
    assert detect_mode(stepped) == Mode("step", 100, 2)
    assert str(detect_mode(stepped)) == "step 100 offset 2"
    assert detect_mode(column(increment=100, start=1102, last=1402)) == Mode("step", 100, 2)
    assert detect_mode(column(None, identity="d", increment=100, start=1100)) == Mode("step", 100, 0)
    assert detect_mode(column(None, identity="a")) == Mode("local")
    assert detect_mode(column("0")).kind == "other"


def test_snowflake_is_refused_for_identity_and_non_bigint_columns() -> None:
    identity = _snowflake_problem("a", column(None, identity="a"))
    assert identity is not None and identity.node == "a" and identity.relation == "public.t"
    assert "identity" in identity.message and "--mode step" in (identity.hint or "")
    narrow = _snowflake_problem("b", column(type_="integer"))
    assert narrow is not None
    assert str(narrow).startswith("node b, table public.t: column id is integer: snowflake ids need bigint")
    assert '--mode step, or ALTER TABLE "public"."t" ALTER COLUMN "id" TYPE bigint' in (narrow.hint or "")
    assert _snowflake_problem("a", column()) is None
    assert _step_problem("a", column(type_="integer")) is None
    assert _step_problem("a", column(None, identity="d", type_="smallint")) is None
    assert _step_problem("a", column(type_="numeric")) is not None
    assert _step_problem("a", column("0")) is not None
    assert _step_problem("a", column(increment=-1)) is not None


def test_sequences_section_defaults_and_validation() -> None:
    base = '[cluster]\nname = "s"\n[[nodes]]\nname = "a"\ndsn = "x"\n[[nodes]]\nname = "b"\ndsn = "y"\n'
    config = parse_config(base)
    assert (config.sequences.mode, config.sequences.step) == ("snowflake", 100)
    assert parse_config(base + '[sequences]\nmode = "step"\nstep = 2\n').sequences.step == 2
    with pytest.raises(ConfigError, match=r"config.toml:11: sequences.step: 1 is too small"):
        parse_config(base + '[sequences]\nmode = "step"\nstep = 1\n')
    with pytest.raises(ConfigError, match=r"sequences.mode: 'odd' is not one of snowflake, step"):
        parse_config(base + '[sequences]\nmode = "odd"\n')


def test_status_renders_each_nodes_modes_and_warns_when_nodes_differ() -> None:
    converted = column("pgmesh.snowflake_nextval('t_id_seq'::regclass)")
    nodes = [
        NodeSequences("a", 0, [converted]),
        NodeSequences("b", 1, [column()]),
        NodeSequences("c", None, [], "cannot connect: connection refused"),
    ]
    text = render_status(nodes)
    default = "pgmesh.snowflake_nextval('t_id_seq'::regclass)"
    assert text.splitlines()[:3] == [
        "node a (node id 0)",
        f"  table     column  type    sequence         {'default':<{len(default)}}  mode",
        f"  public.t  id      bigint  public.t_id_seq  {default}  snowflake",
    ]
    assert "nextval('t_id_seq'::regclass)  local (unconverted)" in text
    assert "node c: NOT READ: cannot connect: connection refused" in text
    assert disagreements(nodes) == ["public.t.id"]
    assert "WARNING: public.t.id is not in the same mode on every node" in text
    assert disagreements(nodes[:1]) == []
    (first,) = status_json(nodes[:1])
    assert first["node_id"] == 0
    assert (first["columns"][0]["mode"], first["columns"][0]["sequence"]) == ("snowflake", "public.t_id_seq")


def standalone(increment: int = 1, last: int | None = 3) -> SequenceColumn:
    """A sequence no column default names (the application calls nextval() on it itself)."""
    return SequenceColumn("public", "invoice_no_seq", "", "bigint", "", None, "public", "invoice_no_seq",
                          increment, 1, 2**63 - 1, "bigint", last, standalone=True)


def test_a_sequence_no_default_names_has_a_mode_and_is_shown_and_converted_in_step_mode() -> None:
    local, stepped = standalone(), standalone(100, 101)
    assert (local.kind, local.label, local.key) == (
        "standalone", "sequence public.invoice_no_seq", ("public", "invoice_no_seq", ""))
    assert detect_mode(local) == Mode("local")
    assert detect_mode(stepped) == Mode("step", 100, 1)
    assert _step_problem("a", local) is None  # converted on the sequence itself, for every caller
    nodes = [NodeSequences("a", 0, [local]), NodeSequences("b", 1, [stepped])]
    text = render_status(nodes)
    assert "none: callers run nextval() themselves  local (unconverted)" in text
    assert disagreements(nodes) == ["sequence public.invoice_no_seq"]
    assert "WARNING: sequence public.invoice_no_seq hand(s) out the same values on every node" in text
    (first, _) = status_json(nodes)
    assert first["columns"][0]["standalone"] is True and first["columns"][0]["table"] is None


def test_local_columns_are_warned_of_only_on_a_cluster_of_several_nodes() -> None:
    assert "hand(s) out the same values" not in render_status([NodeSequences("a", 0, [column()])])
    both = [NodeSequences("a", 0, [column()]), NodeSequences("b", 1, [column()])]
    assert "WARNING: public.t.id hand(s) out the same values on every node" in render_status(both)
