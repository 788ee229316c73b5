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


def _depth_ok(data: bytes, limit: int) -> None:
    """Cheap nesting check on the raw bytes: brackets inside strings are skipped."""
    depth = 0
    in_string = False
    escaped = False
    # Fast path: documents with few brackets are common (DSSE wrappers, payloads).
    if data.count(b"[") + data.count(b"{") <= limit:
        return
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                raise FormatError(f"JSON nested deeper than {limit} levels", code="too_deep")
        elif byte in (0x5D, 0x7D):
            depth -= 1


def loads(data: bytes, *, what: str = "document", max_depth: int = MAX_DEPTH) -> Any:
    """Parse ``data`` strictly or raise :class:`FormatError` saying what was wrong."""
    _depth_ok(data, max_depth)
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
    _check_surrogates(value)
    return value


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
