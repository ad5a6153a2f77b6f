"""Per-link progress and the source confirm position: never past what some target could lose."""

from __future__ import annotations

from router.progress.positions import LinkProgress, SourceProgress


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


def make_k(k: int, n: int = 3) -> tuple[SourceProgress, list[LinkProgress]]:
    links = [LinkProgress("a", f"t{i}", 100) for i in range(n)]
    return SourceProgress("a", links, synchronous=k), links


def hand(source: SourceProgress, links: list[LinkProgress], end: int) -> None:
    for link in links:
        link.enqueued = end
    source.on_seen(end)


def test_synchronous_zero_flushes_to_confirmable() -> None:
    source, links = make_k(0)
    hand(source, links, 150)
    links[0].on_flushed(150)
    assert source.flush_position() == source.confirmable() == 100
    for link in links[1:]:
        link.on_flushed(150)
    assert source.flush_position() == 150


def test_applied_by_is_the_kth_highest_synced_position() -> None:
    source, links = make_k(2)
    hand(source, links, 400)
    for link, lsn in zip(links, (300, 150, 200), strict=True):
        link.on_flushed(lsn)
    assert source.applied_by(1) == 300
    assert source.applied_by(2) == 200
    assert source.applied_by(3) == 150
    assert source.applied_by(4) == 0  # fewer targets than k: nothing is ever applied by k
    links[0].on_flushed(400)  # it has everything handed to it: synced to what the source passed
    source.on_seen(450)  # an echo, handed to nobody
    assert source.applied_by(1) == 450


def test_synchronous_never_flushes_past_confirmable() -> None:
    """k = 1 and one target has it all: still held by the others unless the log holds it for them."""
    source, links = make_k(1)
    hand(source, links, 150)
    links[0].on_flushed(150)
    assert source.applied_by(1) == 150
    assert source.flush_position() == 100  # invariant 1: the others have not got it, no log holds it
    source.log_since, source.log_durable = 50, 150  # the log holds it durably for them
    assert source.confirmable() == 150 and source.flush_position() == 150


def test_the_log_never_counts_toward_k() -> None:
    """A target down: the log lets the slot move (confirmable) but k counts targets that applied."""
    source, links = make_k(2)
    hand(source, links, 150)
    source.log_since, source.log_durable = 50, 150
    assert source.confirmable() == 150
    links[0].on_flushed(150)
    assert source.flush_position() == 100  # one target applied, two needed
    links[2].on_flushed(150)
    assert source.flush_position() == 150


def test_synchronous_with_every_target_down_holds_at_what_they_applied() -> None:
    source, links = make_k(1, n=2)
    hand(source, links, 150)
    for link in links:
        link.detach(150)
    source.log_since, source.log_durable = 50, 150
    assert source.confirmable() == 150
    assert source.flush_position() == 100  # a commit on the source waits, as with PostgreSQL's own
