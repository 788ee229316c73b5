"""One way to page: an opaque keyset cursor over the whole sort key.

Every list endpoint orders by a sort key that ends in a unique column (``log_index``,
``(opened_at, id)``, ``(created_at, id)``), and its cursor carries the last row's full key,
so rows that share a timestamp are neither skipped nor repeated. A cursor also carries a
digest of the query that made it: it is refused (``bad_cursor``) under any other query.

The cursor is ``base64url({"after": <key>, "q": <query digest>})`` with the key a scalar
when it has one column and a list otherwise. Callers treat it as opaque.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from sqlalchemy import ColumnElement, Select, and_, or_
from sqlalchemy.orm import InstrumentedAttribute, Session

from ledger.errors import BadRequest

T = TypeVar("T")
#: How one column of a sort key travels in a cursor.
KeyKind = Literal["int", "time", "uuid", "text"]


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One page of a list: its items and the cursor of the next page (None at the end)."""

    items: list[T]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class SortKey:
    """The order of a list: columns with their direction; the last one must be unique."""

    columns: tuple[tuple[InstrumentedAttribute[Any], bool], ...]  # (column, descending)
    kinds: tuple[KeyKind, ...]

    def order_by(self) -> list[Any]:
        return [c.desc() if desc else c.asc() for c, desc in self.columns]

    def after(self, values: Sequence[Any]) -> ColumnElement[bool]:
        """Rows strictly after ``values`` in this order (lexicographic keyset)."""
        terms = []
        for i, (col, desc) in enumerate(self.columns):
            beyond = col < values[i] if desc else col > values[i]
            terms.append(and_(*[c == v for (c, _), v in zip(self.columns[:i], values,
                                                            strict=False)], beyond))
        return or_(*terms)


def query_digest(query: Mapping[str, Any]) -> str:
    """A short digest of a list's filters: binds a cursor to the query that made it."""
    blob = json.dumps(dict(query), default=str, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _to_json(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def encode_cursor(key: Sequence[Any], digest: str) -> str:
    after = _to_json(key[0]) if len(key) == 1 else [_to_json(v) for v in key]
    raw = json.dumps({"after": after, "q": digest}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _from_json(value: Any, kind: KeyKind) -> Any:
    if kind == "int":
        if not isinstance(value, int) or isinstance(value, bool) or not -1 <= value < 2**63:
            raise ValueError("not a position")
        return value
    if not isinstance(value, str) or len(value) > 100:
        raise ValueError("not a key")
    if kind == "time":
        parsed = datetime.fromisoformat(value)
        if parsed.tzinfo is None:
            raise ValueError("naive time")
        return parsed
    if kind == "uuid":
        return uuid.UUID(value)
    return value


def decode_cursor(cursor: str, digest: str, kinds: Sequence[KeyKind]) -> tuple[Any, ...]:
    """The sort key a cursor carries; ``bad_cursor`` (400) unless this API issued it for
    this very query."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        obj = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")))
        after, q = obj["after"], obj["q"]
    except (ValueError, KeyError, TypeError, binascii.Error, UnicodeError) as exc:
        raise BadRequest("cursor is not one this API issued", code="bad_cursor") from exc
    values = [after] if len(kinds) == 1 else after
    try:
        if not isinstance(values, list) or len(values) != len(kinds):
            raise ValueError("wrong key length")
        key = tuple(_from_json(v, k) for v, k in zip(values, kinds, strict=True))
    except (ValueError, TypeError) as exc:
        raise BadRequest("cursor is not one this API issued", code="bad_cursor") from exc
    if q != digest:
        raise BadRequest("cursor belongs to a different query; start again without it",
                         code="bad_cursor")
    return key


def page(session: Session, stmt: Select[*tuple[Any, ...]], sort: SortKey, *, limit: int,
         cursor: str | None, digest: str, key_of: Callable[[Any], Sequence[Any]],
         scalars: bool = True) -> tuple[list[Any], str | None]:
    """Run ``stmt`` (filters applied) one page at a time in ``sort`` order: the rows of
    this page and the next page's cursor (None when this page is the last)."""
    if cursor:
        stmt = stmt.where(sort.after(decode_cursor(cursor, digest, sort.kinds)))
    stmt = stmt.order_by(*sort.order_by()).limit(limit + 1)
    rows = list(session.scalars(stmt) if scalars else session.execute(stmt))
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, encode_cursor(key_of(rows[-1]), digest) if more and rows else None
