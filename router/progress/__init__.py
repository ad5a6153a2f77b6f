"""Progress flows back: a target's commit -> the link's position -> how far the source's slot may confirm.

  positions.py  per-link durable positions, and the position each source's slot may be confirmed to
  applied.py    the applied mark a target commits with each transaction, and the SQL that reads it back
"""
