"""Strict JSON reading for untrusted bytes.

Rejects what lets two parsers disagree about a document: duplicate object keys,
``NaN``/``Infinity``, invalid UTF-8, lone surrogates, and nesting deeper than a limit.

Two parsers, one answer. The standard library's ``json`` with a duplicate-key hook is the
reference (:func:`_loads_reference`): it decides every document the fast path does not
take, so every rejection, its code and its message come from it. The fast path
(:func:`_loads_fast`, orjson: ~8x faster on an envelope payload, the ingest hot path)
returns a value only for documents on which both parsers provably agree, and hands
everything else to the reference:

- no ``\\u`` escape anywhere (so no surrogate escapes, and no ``:`` made by an escape);
- no float of magnitude 2**63 or more in the value (orjson turns an integer literal
  outside 64 bits into such a float; the reference keeps it an int);
- orjson accepts it (it refuses ``NaN``, ``Infinity``, overflowing numbers, invalid UTF-8
  and byte order marks, which the reference then decides on);
- no duplicate keys, which orjson would silently merge: without ``\\u`` escapes a ``:``
  byte is either a member separator (one per member) or a ``:`` in a string, so the
  document has duplicates exactly when its ``:`` bytes outnumber the parsed members plus
  the ``:`` in the parsed keys and strings (a merged member drops its separator, and its
  key and value can only take ``:`` away);
- nested no deeper than the limit.

``tests/core/test_jsonstrict_fast.py`` checks the two give the same value or the same
error on generated and mutated documents.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from ledger.core.errors import FormatError

MAX_DEPTH = 32

#: orjson reads an integer literal outside [-2**63, 2**64) as a float at least this large
_BIG = float(2**63)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise FormatError(f"duplicate JSON object key {key!r}", code="duplicate_key")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise FormatError(f"{name} is not valid JSON", code="malformed_json")


def loads(data: bytes, *, what: str = "document", max_depth: int = MAX_DEPTH) -> Any:
    """Parse ``data`` strictly or raise :class:`FormatError` saying what was wrong: the
    fast path where it provably agrees with the reference, else the reference."""
    # one backslash searched for first (memchr): most documents have none, and the
    # two-byte search costs ~40 times as much on a payload
    if b"\\" not in data or b"\\u" not in data:
        found, value = _loads_fast(data, max_depth)
        if found:
            return value
    return _loads_reference(data, what=what, max_depth=max_depth)


def _loads_fast(data: bytes, max_depth: int) -> tuple[bool, Any]:
    """(True, value) if orjson reads ``data`` with no duplicate keys within ``max_depth``
    and no float that may have been a long integer; (False, None) for anything else (the
    reference then decides). Only for ``data`` without ``\\u`` escapes (see the module
    docstring)."""
    if max_depth < 1:
        return False, None
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False, None
    members = colons = 0
    if isinstance(value, str):
        colons = value.count(":")
    elif isinstance(value, float) and abs(value) >= _BIG:
        return False, None
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            if depth > max_depth:
                return False, None
            members += len(item)
            colons += "".join(item).count(":")
            children: Any = item.values()
        elif isinstance(item, list):
            if depth > max_depth:
                return False, None
            children = item
            scanned = _scan_uniform(item)
            if scanned is not None:  # all numbers or all strings, told apart at C speed
                if scanned < 0:
                    return False, None
                colons += scanned
                continue
        else:
            continue
        kinds = set(map(type, children))
        if str in kinds:
            strings = children if len(kinds) == 1 else [c for c in children if type(c) is str]
            colons += "".join(strings).count(":")
        if float in kinds:  # perhaps an integer beyond 64 bits: the reference reads it
            floats = children if len(kinds) == 1 else [c for c in children
                                                       if type(c) is float]
            if max(floats) >= _BIG or min(floats) <= -_BIG:
                return False, None
        if dict in kinds or list in kinds:
            stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    if data.count(b":") != members + colons:
        return False, None  # a duplicate key (the reference names it)
    return True, value


def _scan_uniform(items: list[Any]) -> int | None:
    """For a list of numbers only: 0, or -1 if one may have been an integer beyond 64
    bits (a float of magnitude 2**63 or more, or any number that large). For a list of
    strings only: the ``:`` they hold. None for anything else (the caller looks at each
    item's type). Token IDs, logprobs and digests are such lists: ``sum`` and ``join``
    visit them in C, where taking the set of their types costs ~30 ns an item."""
    if not items:
        return 0
    first = type(items[0])
    if first is int or first is float:
        try:
            total = sum(items)  # numbers only (bool is an int), else TypeError
        except TypeError:
            return None
        # an int total: no float among them; else the largest in magnitude decides
        if type(total) is float and (max(items) >= _BIG or min(items) <= -_BIG):
            return -1
        return 0
    if first is str:
        try:
            return "".join(items).count(":")  # strings only, else TypeError
        except TypeError:
            return None
    return None


def _loads_reference(data: bytes, *, what: str = "document",
                     max_depth: int = MAX_DEPTH) -> Any:
    """The reference parser: every document the fast path does not take.

    Nesting is bounded in two steps: the C parser raises RecursionError long before the
    stack is at risk, and the parsed value's container depth is then checked against
    ``max_depth`` (cheaply: only containers are visited, never the items of a list of
    numbers).
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"{what} is not valid UTF-8: {exc.reason} at byte {exc.start}",
                          code="not_utf8") from exc
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicate_keys,
                           parse_constant=_reject_constant)
    except FormatError:
        raise
    except RecursionError as exc:
        raise FormatError(f"{what} is nested too deeply", code="too_deep") from exc
    except ValueError as exc:  # JSONDecodeError, or an integer with too many digits
        raise FormatError(f"{what} is not valid JSON: {exc}", code="malformed_json") from exc
    if b"\\ud" in data or b"\\uD" in data:  # only escapes can produce lone surrogates
        _check_surrogates(value)
    _check_depth(value, max_depth)
    return value


def _check_depth(value: Any, limit: int) -> None:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise FormatError(f"JSON nested deeper than {limit} levels", code="too_deep")
        children: Any
        if isinstance(item, dict):
            children = item.values()
        elif not isinstance(item, list):
            continue  # a scalar document (``1``, ``null``): nothing nested
        else:
            # A list of numbers (token IDs, logprobs) is the common case: tell it apart at
            # C speed instead of visiting every item in Python.
            kinds = set(map(type, item))
            if dict not in kinds and list not in kinds:
                continue
            children = item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def _check_surrogates(value: Any) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise FormatError("JSON string holds a lone surrogate escape",
                                  code="malformed_json") from exc
        elif isinstance(item, dict):
            for key, val in item.items():
                stack.append(key)
                if isinstance(val, (str, dict, list)):
                    stack.append(val)
        elif isinstance(item, list):
            stack.extend(v for v in item if isinstance(v, (str, dict, list)))
