"""`config.toml`, from text to an immutable `Config`: `model` (the whole `Config`, the names pgmesh derives
from it, the conflict policy of a table, and `parse_config` / `load_config`; callers import from here) is
built of `sections` (each `[section]` and `[[nodes]]` entry as msgspec types that carry their own bounds
and vocabularies, refused at decode), checked by `rules` (what weighs one value against another: bounds
that depend on the nodes, distinct names, pairs of keys, resolvers that need node_priority or can
diverge) and `parts` (a receive-only node's `tables`, `rows`, `columns`), with every refusal worded by
`messages` (msgspec's error or a rule's as one line naming the key) at the line `lines` finds (a key's
line in the file's text).

Must not: import anything but `router.errors`, `router.conflicts.resolve` and (to read a password file)
`router.nodes.dsn`, connect anywhere, or import a custom resolver (the applier loads it).
"""
