"""Conflicts: `resolve` decides (pure functions of two row versions and a policy); `causality` says
whether a remote change was made on top of the local version (pure); `symmetry` checks that a custom
resolver decides alike on every node; `catalog` installs what the decisions need on every node (history,
tombstones, the guards; PL/pgSQL in `sql/`); `given_up` names secondary unique keys and reads the unique
values rows gave up; `pruning` cuts the tombstones (and given-up values) behind a safe horizon;
`history` keeps the conflict history and resolved quarantine entries for `[conflicts] keep`.

Must not: apply rows (router.apply.careful.transaction does, calling `resolve`).
"""
