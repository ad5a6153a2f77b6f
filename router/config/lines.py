"""Where a key is in a TOML file's text: the line a config error names (best effort, text only).

Owns the lookup from a msgspec error path (`$.nodes[1].name`) to a line of the file. Must not decode TOML
or know the config's keys (router.config.sections and router.config.messages do).
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["line_of"]

_HEADER_RE: Final = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.\-\"' ]+?)\s*\]")


def _headers(lines: list[str]) -> list[tuple[int, bool, tuple[str, ...]]]:
    """Every table header: (line index, is an [[array]] header, its dotted path)."""
    found = []
    for i, line in enumerate(lines):
        match = _HEADER_RE.match(line)
        if match:
            path = tuple(part.strip().strip("\"'") for part in match.group(2).split("."))
            found.append((i, match.group(1) == "[[", path))
    return found


def line_of(text: str, path: str) -> int | None:
    """Best effort: the line that sets the key a msgspec path names (`$.nodes[1].name`, `$.admin.listen`,
    `$.tables[0].types.delete_missing`), else the header of the innermost table found."""
    segments = re.findall(r"([A-Za-z0-9_-]+)(?:\[(\d+)\])?", path.removeprefix("$"))
    if not segments:
        return None
    lines = text.splitlines()
    headers = _headers(lines)

    def header(prefix: tuple[str, ...], index: str, after: int) -> int | None:
        if index:  # the (index+1)-th [[prefix]] table
            arrays = [i for i, array, p in headers if array and p == prefix]
            return arrays[int(index)] if int(index) < len(arrays) else None
        return next((i for i, _array, p in headers if i >= after and p == prefix), None)

    start: int = 0
    found: int | None = None
    prefix: tuple[str, ...] = ()
    for key, index in segments[:-1]:
        prefix += (key,)
        hit = header(prefix, index, start)
        if hit is not None:
            start = found = hit
    last, last_index = segments[-1]
    hit = header((*prefix, last), last_index, start)
    if hit is not None:
        return hit + 1
    # The key inside its table: from the table's header to the next header (top level: to the first).
    end = next((i for i, _array, _p in headers if i > (-1 if found is None else found)), len(lines))
    wanted = re.compile(rf"^\s*[\"']?{re.escape(last)}[\"']?\s*=")
    for i in range(start, end):
        if wanted.match(lines[i]):
            return i + 1
    return None if found is None else found + 1
