"""The words of a config error: msgspec's refusal, or a rule's, as the one line an operator reads.

Owns the step from msgspec's `ValidationError` ("Expected `int` >= 0 - at `$.conflicts.window_ms`") to
pgmesh's `ConfigError` ("config.toml:15: conflicts.window_ms: must be >= 0"): the key from msgspec's
path, the line that sets it (router.config.lines), and for a value a declared constraint refuses, the
words of `WORDS` (per key, with `[]` for any index), else "must be >= N" from the declared bound. A wrong
type or a missing key keeps msgspec's words; an unknown key names the table it is in. `rule_error` gives
router.config.rules' errors ("key: message") their line the same way.

Must not: decide what is valid (router.config.sections declares it, router.config.rules checks the rest),
or put a node's dsn in a message.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Final

import msgspec

from router.config.lines import line_of
from router.config.sections import (
    CONFLICT_TYPES,
    DDL_MODES,
    RESOLVER_NAMES,
    SEQUENCE_MODES,
    SYNCHRONOUS_COMMIT,
    ConflictTypeName,
    ResolverName,
)
from router.errors import ConfigError

__all__ = ["WORDS", "decode_error", "rule_error"]

Words = str | Callable[[Any], str]  # a template of the refused `value`, or a function of it

# msgspec's "... - at `$.a.b`", or "... - at `key` in `$.a.b`" for a dict's key
_AT: Final = re.compile(r"(?s)(?P<detail>.*) - at `(?:(?P<member>key)` in `)?(?P<path>\$[^`]*)`")
# a declared constraint refused the value ("Expected `int` >= 0", "Invalid enum value 'yes'"), as opposed
# to a wrong type ("Expected `int`, got `str`")
_CONSTRAINT: Final = re.compile(r"^(?:Expected `[^`]+` |Invalid enum value )")
_BOUND: Final = re.compile(r"^Expected `(?:int|float)` (?P<bound>[<>]=? \S+)$")


def _resolver(value: str) -> str:
    if ":" in value:
        return f"custom resolver {value!r}: expected 'module:function'"
    return f"unknown resolver {value!r}; use one of {', '.join(RESOLVER_NAMES)} or 'module:function'"


def _conflict_type(value: str) -> str:
    return f"unknown conflict type {value!r}; use one of {', '.join(CONFLICT_TYPES)}"


# The words for a refused value, by key ("[]": any index; "[key]", "[value]": a `types` table's entry).
# A bound without an entry reads "must be >= N", as msgspec's `Meta` says it.
WORDS: Final[dict[str, Words]] = {
    "cluster.name": "use lower-case letters, digits and _ (start with a letter, at most 30)",
    "nodes": "a cluster needs at least two [[nodes]]",
    "nodes[].name": "node name {value!r}: use lower-case letters, digits and _",
    "nodes[].dsn": "empty dsn",
    "replication.tables": "must list at least one pattern",
    "replication.apply_lanes": "must be between 1 and 16",
    "replication.apply_synchronous_commit": "must be one of " + ", ".join(SYNCHRONOUS_COMMIT),
    "replication.apply_transport": 'must be "pipeline" or "script"',
    "replication.spill_mb": "must be >= 0 (0: never spill to disk)",
    "replication.new_table_without_key": "{value!r} is not full, warn or refuse",
    "ddl.mode": "{value!r} is not one of " + ", ".join(DDL_MODES),
    "ha.drift": "must be >= 0 and < 0.5",
    "conflicts.resolver": _resolver,
    "conflicts.keep": "{value!r} is not a duration: a number and ms, s, m, h or d, e.g. '12h' or '7d'",
    "conflicts.types[key]": _conflict_type,
    "conflicts.types[value]": _resolver,
    "tables[].name": "{value!r} is not schema.table (or a bare table name)",
    "tables[].resolver": _resolver,
    "tables[].types[key]": _conflict_type,
    "tables[].types[value]": _resolver,
    "sequences.mode": "{value!r} is not one of " + ", ".join(SEQUENCE_MODES),
}

# The tables with constrained entries: msgspec's path names the table, not the entry (`$.x.types[...]`).
_ENTRIES: Final[dict[str, tuple[Any, Any]]] = {
    "conflicts.types": (ConflictTypeName, ResolverName),
    "tables[].types": (ConflictTypeName, ResolverName),
}


def _pattern(key: str) -> str:
    return re.sub(r"\[\d+\]", "[]", key)


def _value_at(raw: Any, key: str) -> Any:
    """The decoded TOML's value at `key` (`nodes[1].name`), or None."""
    for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", key):
        try:
            raw = raw[name] if name else raw[int(index)]
        except (KeyError, IndexError, TypeError):
            return None
    return raw


def _fits(value: Any, kind: Any) -> bool:
    try:
        msgspec.convert(value, kind)
    except msgspec.ValidationError:
        return False
    return True


def _refused_entry(raw: Any, key: str, member: str) -> tuple[str, str, Any] | None:
    """The first entry of the table at `key` that msgspec refused: (its key, WORDS' key, the value)."""
    kinds = _ENTRIES.get(_pattern(key))
    mapping = _value_at(raw, key)
    if kinds is None or not isinstance(mapping, dict):
        return None
    for name, value in mapping.items():
        refused = name if member == "key" else value
        if not _fits(refused, kinds[0] if member == "key" else kinds[1]):
            return f"{key}.{name}", f"{_pattern(key)}[{member}]", refused
    return None


def _worded(key: str, member: str, detail: str, raw: Any) -> tuple[str, str]:
    """(key, words) for a value a declared constraint refused."""
    words_key, value = _pattern(key), None
    if key.endswith("[...]") or member == "key":
        entry = _refused_entry(raw, key.removesuffix("[...]"), member or "value")
        if entry is None:
            return key, detail
        key, words_key, value = entry
    else:
        value = _value_at(raw, key)
    words = WORDS.get(words_key)
    if callable(words):
        return key, words(value)
    if words is not None:
        return key, words.format(value=value)
    bound = _BOUND.match(detail)
    return key, f"must be {bound['bound']}" if bound else detail


def _located(key: str, message: str, text: str, source: str) -> ConfigError:
    line = line_of(text, "$." + key)
    where = f"{source}:{line}" if line else source
    return ConfigError(f"{where}: {message}")


def decode_error(exc: msgspec.ValidationError, raw: dict[str, Any], text: str, source: str) -> ConfigError:
    """msgspec's refusal of `raw` (decoded from `text`) as one line: `source:line: key: words`."""
    message = str(exc)
    at = _AT.fullmatch(message)
    detail, member, path = (at["detail"], at["member"] or "", at["path"]) if at else (message, "", "")
    key = path.removeprefix("$.") or "?"
    if detail.startswith("Object contains unknown field"):
        unknown = detail.split("`")[1] if "`" in detail else "?"
        line = line_of(text, f"{path}.{unknown}" if path else unknown)
        where = f"{source}:{line}" if line else source
        scope = f" in [{key}]" if key != "?" else ""
        return ConfigError(f"{where}: unknown key {unknown!r}{scope}")
    if _CONSTRAINT.match(detail):
        key, detail = _worded(key, member, detail, raw)
    return _located(key, f"{key}: {detail}", text, source)


def rule_error(exc: ConfigError, text: str, source: str) -> ConfigError:
    """A rule's "key: message" with the file and the line that sets the key in front."""
    return _located(exc.message.partition(":")[0], exc.message, text, source)
