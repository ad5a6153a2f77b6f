"""The careful path: one source transaction applied row by row, each conflict detected, decided and recorded.

The applier sends a transaction here when its guarded statements met a conflict they could not decide in
the round trip (router.apply.decide), or when it carries DDL.

  transaction.py  `CarefulApplier`: the transaction walked change by change through one dispatch table
                  (protocol.changes), in its own target transaction; each change decided
                  (router.conflicts.resolve) against what it meets, written and recorded
  local.py        what a change meets on the target: the local row or tombstone, with its version, and
                  the check that a tombstone a decision rests on is still the one read
  rows.py         a row image as a dict of column text, what an update leaves at the source, one
                  decided conflict (`ConflictRecord`): pure
  sql.py          the SQL of its reads and writes: a row with its version, a tombstone, the check that a
                  tombstone is still the one a decision read, the row written

Must not: retry or pause a link (the applier does), or read the source but for unchanged TOAST values
(router.apply.toast).
"""
