"""Per-link progress and the source confirm position: never past what some target could lose."""

from __future__ import annotations

from router.progress import LinkProgress, SourceProgress


def make() -> tuple[SourceProgress, LinkProgress, LinkProgress]:
    b, c = LinkProgress("a", "b", 100), LinkProgress("a", "c", 100)
    return SourceProgress("a", [b, c]), b, c


def test_start_and_confirm_follow_the_least_durable_link() -> None:
    b, c = LinkProgress("a", "b", 300), LinkProgress("a", "c", 200)
    source = SourceProgress("a", [b, c])
    assert source.start_position() == 200 and source.confirmable() == 200


def test_handed_but_not_flushed_holds_the_confirm_back() -> None:
    source, b, c = make()
    for link in (b, c):
        link.enqueued = 150
    source.on_seen(150)
    b.on_applied(150)
    assert source.confirmable() == 100  # applied is not flushed
    b.on_flushed(150)
    assert source.confirmable() == 100  # c has not flushed
    c.on_flushed(150)
    assert source.confirmable() == 150


def test_echoes_after_the_last_handed_transaction_count_once_flushed() -> None:
    source, b, c = make()
    b.enqueued = c.enqueued = 150
    source.on_seen(150)
    source.on_seen(400)  # an echo: handed to nobody
    assert source.confirmable() == 100
    b.on_flushed(150)
    c.on_flushed(150)
    assert source.confirmable() == 400


def test_detached_link_holds_the_slot_until_it_has_re_read() -> None:
    source, b, c = make()
    b.enqueued = 150
    source.on_seen(150)
    c.detach(source.seen)
    b.on_flushed(150)
    assert not c.wants(200) and b.wants(200)
    assert source.confirmable() == 100 and source.rewind_position() == 100
    source.on_seen(500)  # the source went on while c was detached
    c.reattach(source.seen)
    assert c.receiving and c.enqueued == 100 and c.missed_until == 500
    assert source.confirmable() == 100  # still missing 100..150
    c.enqueued = 150
    source.on_seen(150)  # the re-read passed the point where it was detached: not enough
    c.on_flushed(150)
    assert c.missed_until == 500 and source.confirmable() == 150  # c is durable to 150, no further
    b.enqueued = 500
    b.on_flushed(500)
    c.enqueued = 500
    source.on_seen(500)  # the re-read reached where the source was at re-attach time
    assert c.missed_until is None
    c.on_flushed(500)
    assert source.confirmable() == 500


def test_target_that_lost_unflushed_commits_re_reads() -> None:
    source, b, c = make()
    c.enqueued = 180
    c.on_applied(180)
    assert c.restart_at(120) is True  # the target came back with less than we applied
    assert c.applied == 120 and c.detached and c.missed_until == 180
    assert source.rewind_position() == 120
    assert b.restart_at(100) is False and b.receiving


def test_the_log_counts_only_for_the_targets_it_holds_transactions_for() -> None:
    """A joined node's link (d) is durable at its own position, whatever the log holds for b."""
    b, d = LinkProgress("a", "b", 100), LinkProgress("a", "d", 100)
    source = SourceProgress("a", [b, d])
    source.log_since, source.log_durable = 50, 400
    assert source.confirmable() == 400
    source.log_targets = frozenset({"b"})
    assert source.confirmable() == 100
