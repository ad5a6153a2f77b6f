"""The tombstone recorder's pure parts (router.apply.recorder), without a server."""

from __future__ import annotations

from router.apply.recorder import full_xid


def test_full_xid_is_the_one_nearest_the_next_xid() -> None:
    """The recorder widens a decoded 32-bit xid with the next xid of a snapshot taken after it: a commit
    decoded before its backend left the proc array is at or above that, in the same epoch (it was made
    the epoch before: a negative xid8 in epoch 0, seen on PostgreSQL 18)."""
    assert full_xid(847, 840) == 847  # at or above the next xid, epoch 0
    assert full_xid(100, 840) == 100
    epoch = 3 << 32
    assert full_xid(5, epoch + 10) == epoch + 5
    assert full_xid(12, epoch + 10) == epoch + 12
    assert full_xid(0xFFFFFFF0, epoch + 10) == epoch - 16  # the epoch before, across the wrap
    assert full_xid(0xFFFFFFF0, 10) == 0xFFFFFFF0  # never below 0
