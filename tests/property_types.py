"""The column types of the property test's tables (issue 17): random values and key encodings.

Owns: for each type the property test's tables use, a random value in its text input form (NULL-free;
the tables add NULLs), and for the types that can be keys the n-th key value, injective and keeping the
order of n (so that a RANGE partition of n is one of the column, and a node's own keys are a range).
Must not: read randomness other than the `random.Random` it is handed, or talk to a server.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

FRESH = 1_000_000  # node i's own keys start at (i + 1) * FRESH

ENUM_LABELS = ["sad", "ok", "happy", "with space", "quo'te", "ünï"]

EPOCH = datetime(2001, 2, 3, 4, 5, 6, tzinfo=UTC)


# --------------------------------------------------------------------------------------------- value types


def _text(rng: random.Random) -> str:
    if rng.random() < 0.25:  # TOASTed: random hex compresses to about half, still over 2 kB
        return rng.randbytes(rng.randint(2_000, 12_000)).hex()
    return "".join(rng.choices("abc xyz'\"\\,{}()ü€\t", k=rng.randint(0, 30)))


def _numeric(rng: random.Random) -> str:
    if rng.random() < 0.05:
        return rng.choice(["NaN", "Infinity", "-Infinity"])
    return f"{rng.randint(-10**20, 10**20)}.{rng.randint(0, 10**6):06d}"


def _float8(rng: random.Random) -> str:
    if rng.random() < 0.1:
        return rng.choice(["NaN", "Infinity", "-Infinity", "-0", "1e308", "5e-324"])
    return repr(rng.uniform(-1e6, 1e6))


def _timestamptz(rng: random.Random) -> str:
    if rng.random() < 0.05:
        return rng.choice(["infinity", "-infinity"])
    moment = EPOCH + timedelta(seconds=rng.randint(-10**9, 10**9), microseconds=rng.randint(0, 999_999))
    return moment.isoformat()


def _jsonb_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.random()
    if depth > 2 or kind < 0.3:
        return rng.choice([None, True, 1, -2.5, "s", "ü\"'", 10**20])
    if kind < 0.6:
        return [_jsonb_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["k", "key", "a b", "€"]) + str(i): _jsonb_value(rng, depth + 1)
            for i in range(rng.randint(0, 4))}


def _jsonb(rng: random.Random) -> str:
    if rng.random() < 0.1:  # TOASTed
        return json.dumps({"big": [_text(rng) for _ in range(3)], "n": rng.random()})
    return json.dumps(_jsonb_value(rng))


def _array_element(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _int_array(rng: random.Random) -> str:
    if rng.random() < 0.2:  # two dimensions
        pairs = (f"{{{rng.randint(-9, 9)},{rng.randint(-9, 9)}}}" for _ in range(2))
        return "{" + ",".join(pairs) + "}"
    items = ["NULL" if rng.random() < 0.2 else str(rng.randint(-10**9, 10**9))
             for _ in range(rng.randint(0, 6))]
    return "{" + ",".join(items) + "}"


def _text_array(rng: random.Random) -> str:
    items = ["NULL" if rng.random() < 0.2 else _array_element(_text(rng)) for _ in range(rng.randint(0, 4))]
    return "{" + ",".join(items) + "}"


def _bytea(rng: random.Random) -> str:
    size = rng.randint(3_000, 20_000) if rng.random() < 0.2 else rng.randint(0, 40)
    return "\\x" + rng.randbytes(size).hex()


def _interval(rng: random.Random) -> str:
    return f"{rng.randint(-400, 400)} days {rng.randint(0, 86_399)} seconds"


def _int4range(rng: random.Random) -> str:
    if rng.random() < 0.1:
        return "empty"
    lo = rng.randint(-1000, 1000)
    return f"[{lo},{lo + rng.randint(1, 100)})"


def _numrange(rng: random.Random) -> str:
    lo = rng.uniform(-1e3, 1e3)
    return rng.choice([f"({lo:.3f},{lo + 5:.3f}]", f"[{lo:.3f},)", "(,)"])


def _tstzrange(rng: random.Random) -> str:
    start = EPOCH + timedelta(seconds=rng.randint(-10**8, 10**8), microseconds=rng.randint(0, 999_999))
    return f'["{start.isoformat()}","{(start + timedelta(hours=rng.randint(1, 99))).isoformat()}")'


def _pair(rng: random.Random) -> str:
    """The schedule's composite type (a int4, b text, c int4[]): NULL fields are empty."""
    a = "" if rng.random() < 0.2 else str(rng.randint(-9, 9))
    b = "" if rng.random() < 0.2 else _array_element(_text(rng))
    c = "" if rng.random() < 0.2 else _array_element(_int_array(rng))
    return f"({a},{b},{c})"


def _day(n: int) -> int:
    """Key n as a day count within the date range: each node's keys (well under 100k) in their own span."""
    return n // FRESH * 100_000 + n % FRESH


@dataclass(frozen=True)
class ColumnType:
    """One column type: its SQL name, a random value (text input form), and, if it can be a key, the n-th
    key value (injective and order-preserving in n, so range partitions of n are range partitions of
    the column; `None` for a type that is no key, 'enum' for one that is no injective key)."""

    sql: str
    value: Callable[[random.Random], str]
    key: Callable[[int], str] | None = None
    range_ok: bool = True  # a RANGE partition key


TYPES: dict[str, ColumnType] = {
    "int4": ColumnType("int4", lambda r: str(r.randint(-2**31, 2**31 - 1)), str),
    "int8": ColumnType("int8", lambda r: str(r.randint(-2**63, 2**63 - 1)), lambda n: str(n * 1_000_003)),
    "numeric": ColumnType("numeric", _numeric, lambda n: f"{n}.25"),
    "text": ColumnType("text", _text, lambda n: f"k{n:08d}"),
    "timestamptz": ColumnType("timestamptz", _timestamptz,
                              lambda n: (EPOCH + timedelta(seconds=n)).isoformat()),
    "date": ColumnType("date", lambda r: (EPOCH + timedelta(days=r.randint(-9999, 9999))).date().isoformat(),
                       lambda n: (EPOCH + timedelta(days=_day(n))).date().isoformat()),
    "uuid": ColumnType("uuid", lambda r: str(uuid.UUID(int=r.getrandbits(128))),
                       lambda n: str(uuid.UUID(int=n))),
    "bytea": ColumnType("bytea", _bytea, lambda n: "\\x" + n.to_bytes(8, "big").hex()),
    "int4[]": ColumnType("int4[]", _int_array, lambda n: f"{{{n},{n % 5}}}", range_ok=False),
    "float8": ColumnType("float8", _float8),
    "jsonb": ColumnType("jsonb", _jsonb),
    "text[]": ColumnType("text[]", _text_array),
    "interval": ColumnType("interval", _interval),
    "bool": ColumnType("bool", lambda r: r.choice(["true", "false"])),
    "int4range": ColumnType("int4range", _int4range),
    "numrange": ColumnType("numrange", _numrange),
    "tstzrange": ColumnType("tstzrange", _tstzrange),
    "pair": ColumnType("pair", _pair),  # the schedule's composite type
    "word": ColumnType("word", _text),  # the schedule's domain over text
}
USER_TYPES = ("enum", "pair", "word")  # made by the schedule's DDL, named after its seed
KEY_TYPES = [name for name, t in TYPES.items() if t.key is not None]
_ENUM = ColumnType("enum", lambda r: r.choice(ENUM_LABELS))


def enum_type() -> ColumnType:
    """The schedule's enum: its labels are ENUM_LABELS (no key of its own: n-th label repeats)."""
    return _ENUM
VALUE_TYPES = [*TYPES, "text", "text", "enum"]  # text thrice: more TOAST
