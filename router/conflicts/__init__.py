"""Conflicts: `resolve` decides (pure functions of two row versions and a policy); `catalog` installs
what the decisions need on every node (history, tombstones, the guards; PL/pgSQL in `sql/`).

Must not: apply rows (router.apply.careful.transaction does, calling `resolve`).
"""
