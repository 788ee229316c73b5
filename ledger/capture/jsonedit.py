"""Read an OpenAI response object and null some of its members without re-serialising it.

The recording proxy asks the upstream for fields the client did not ask for (token IDs,
logprobs). It must hand the client the bytes the upstream would have sent without them,
and vLLM writes those members as ``null`` when they are not asked for. So the proxy keeps
the upstream's bytes and only replaces the value text of those members by ``null``:
key order, number formatting, escapes and whitespace stay exactly the upstream's.

:func:`scan` walks the top-level object and the objects in its ``choices`` array (the
two levels where these members live), parsing every value with the C JSON scanner (fast
for long logprob arrays) and remembering where each value's text starts and ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any

_decoder = json.JSONDecoder()
_WS = " \t\n\r"


class JSONEditError(ValueError):
    """The text is not a JSON object of the expected shape."""


@dataclass
class Member:
    key: str
    value: Any
    start: int          # index of the value's first character
    end: int            # index just past the value


@dataclass
class Scanned:
    """A top-level object: its members, and the members of each object in ``choices``."""

    text: str
    members: dict[str, Member]
    choices: list[dict[str, Member]] = field(default_factory=list)

    def value(self, key: str, default: Any = None) -> Any:
        m = self.members.get(key)
        return default if m is None else m.value


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _expect(text: str, pos: int, char: str) -> int:
    if pos >= len(text) or text[pos] != char:
        raise JSONEditError(f"expected {char!r} at {pos}")
    return pos + 1


def _object(text: str, pos: int, nested_key: str | None,
            nested: list[dict[str, Member]] | None) -> tuple[dict[str, Member], int]:
    """Members of the object starting at ``pos``; returns (members, index past it).

    The value of member ``nested_key`` (an array of objects) is scanned member by member
    into ``nested`` instead of being parsed whole.
    """
    pos = _skip_ws(text, _expect(text, pos, "{"))
    members: dict[str, Member] = {}
    if pos < len(text) and text[pos] == "}":
        return members, pos + 1
    while True:
        pos = _expect(text, pos, '"')
        try:
            key, pos = scanstring(text, pos, True)
        except ValueError as exc:
            raise JSONEditError(str(exc)) from None
        pos = _skip_ws(text, _expect(text, _skip_ws(text, pos), ":"))
        start = pos
        if key == nested_key and nested is not None and text.startswith("[", pos):
            items, pos = _array_of_objects(text, pos, nested)
            value: Any = items
        else:
            try:
                value, pos = _decoder.raw_decode(text, pos)
            except ValueError as exc:
                raise JSONEditError(str(exc)) from None
        members[key] = Member(key, value, start, pos)
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
            continue
        return members, _expect(text, pos, "}")


def _array_of_objects(text: str, pos: int,
                      out: list[dict[str, Member]]) -> tuple[list[dict[str, Any]], int]:
    pos = _skip_ws(text, _expect(text, pos, "["))
    values: list[dict[str, Any]] = []
    if pos < len(text) and text[pos] == "]":
        return values, pos + 1
    while True:
        if not text.startswith("{", pos):
            raise JSONEditError(f"expected an object in the array at {pos}")
        members, pos = _object(text, pos, None, None)
        out.append(members)
        values.append({k: m.value for k, m in members.items()})
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
            continue
        return values, _expect(text, pos, "]")


def scan(text: str) -> Scanned:
    """Scan a JSON object (and the objects of its ``choices`` array)."""
    choices: list[dict[str, Member]] = []
    pos = _skip_ws(text, 0)
    members, pos = _object(text, pos, "choices", choices)
    if _skip_ws(text, pos) != len(text):
        raise JSONEditError("trailing data after the JSON object")
    return Scanned(text, members, choices)


def null_values(text: str, members: list[Member]) -> str:
    """``text`` with each given member's value replaced by ``null`` (nothing else moves)."""
    out, last = [], 0
    for m in sorted(members, key=lambda m: m.start):
        out.append(text[last:m.start])
        out.append("null")
        last = m.end
    out.append(text[last:])
    return "".join(out)
