"""Strict JSON reading for untrusted bytes.

Rejects what lets two parsers disagree about a document: duplicate object keys,
``NaN``/``Infinity``, invalid UTF-8, lone surrogates, and nesting deeper than a limit.
"""

from __future__ import annotations

import json
from typing import Any

from ledger.core.errors import FormatError

MAX_DEPTH = 32


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
    """Parse ``data`` strictly or raise :class:`FormatError` saying what was wrong.

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
        if isinstance(item, dict):
            children = item.values()
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
