"""The init check for a node with a physical standby (`router.cluster.checks`, "failover"), on facts (no
server): silent without a standby; on 15/16 a warning saying the slot is lost at a promotion and what to
do; on 17+ a warning until the standby's slot is in synchronized_standby_slots and pgmesh's slot is a
failover slot. Never a failure. The check against real nodes: tests/integration/test_failover.py.
"""

from __future__ import annotations

import msgspec

from router.cluster.checks import Check, InitReport, NodeFacts, _node_checks
from router.cluster.standbys import StandbyFacts, slot_names
from router.config.model import parse_config

CONFIG = parse_config("""
[cluster]
name = "fo"

[[nodes]]
name = "a"
dsn = "host=x"

[[nodes]]
name = "b"
dsn = "host=y"
""")


def facts(version: int, standbys: list[str | None], synchronized_standby_slots: str = "") -> NodeFacts:
    base = {"server_version": f"{version}.1", "server_version_num": f"{version}0001", "wal_level": "logical"}
    base |= {"track_commit_timestamp": "on", "max_replication_slots": "10", "max_wal_senders": "10"}
    own = ("pgoutput", "app", False)
    standby = StandbyFacts(version * 10000 + 1, standbys, [s for s in standbys if s is not None],
                           slot_names(synchronized_standby_slots), True if version >= 17 else None)
    return NodeFacts(base, "postgres", True, 2, own, "app", 1, {}, standby=standby)


def standby(f: NodeFacts, **changes: object) -> NodeFacts:
    return msgspec.structs.replace(f, standby=msgspec.structs.replace(f.standby, **changes))


def failover_check(f: NodeFacts) -> Check | None:
    return {c.check: c for c in _node_checks("b", f, CONFIG)}.get("failover")


def test_no_standby_no_line() -> None:
    assert failover_check(facts(15, [])) is None
    assert failover_check(facts(18, [])) is None


def test_15_and_16_warn_that_the_slot_is_lost_and_say_to_rejoin() -> None:
    for version in (15, 16):
        check = failover_check(facts(version, ["b_standby"]))
        assert check is not None and check.ok and check.warn
        assert "b_standby" in check.detail and "pgmesh_fo" in check.detail
        assert "pgmesh join" in (check.hint or "") and "docs/failover.md" in (check.hint or "")


def test_18_warns_until_the_standby_slot_is_synchronized() -> None:
    check = failover_check(facts(18, ["b_standby"], synchronized_standby_slots=""))
    assert check is not None and check.ok and check.warn
    assert "synchronized_standby_slots does not name b_standby" in check.detail
    assert "synchronized_standby_slots = 'b_standby'" in (check.hint or "")
    assert "sync_replication_slots = on" in (check.hint or "")
    check = failover_check(facts(18, ["b_standby", "other"], synchronized_standby_slots='other, "b_standby"'))
    assert check is not None and check.ok and not check.warn
    assert "b_standby" in check.detail


def test_18_warns_of_a_slot_without_failover_and_a_standby_without_a_slot() -> None:
    listed = facts(18, [None, "s1"], synchronized_standby_slots="s1")
    check = failover_check(standby(listed, slot_failover=False))
    assert check is not None and check.ok and check.warn
    assert "not a failover slot" in check.detail and "without a replication slot" in check.detail
    assert "ALTER_REPLICATION_SLOT pgmesh_fo (FAILOVER true)" in (check.hint or "")


def test_18_a_synchronized_standby_slot_that_does_not_exist_fails_one_not_streaming_warns() -> None:
    promoted = facts(18, [], synchronized_standby_slots="b_standby")  # the old primary's setting
    check = failover_check(promoted)
    assert check is not None and not check.ok
    assert "names b_standby, no physical slot here" in check.detail
    assert "synchronized_standby_slots = ''" in (check.hint or "")
    idle = standby(promoted, physical_slots=["b_standby"])
    check = failover_check(idle)
    assert check is not None and check.ok and check.warn
    assert "the standby of slot b_standby is not streaming" in check.detail


def test_a_warning_is_rendered_with_its_hint_and_the_report_stays_ready() -> None:
    checks = _node_checks("b", facts(15, ["b_standby"]), CONFIG)
    report = InitReport(checks, [], "fo")
    text = report.render()
    assert report.ok
    assert "  ! failover" in text and "-> after a failover, re-join" in text
    assert text.endswith("ready: every node passed every check")
