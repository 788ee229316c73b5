"""Reading envelopes back: one by request_id, or a filtered, keyset-paginated search."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from ledger.db.models import Envelope
from ledger.errors import BadRequest, NotFound

INDEX_COLUMNS = (
    Envelope.request_id, Envelope.log_index, Envelope.recorded_at, Envelope.ingested_at,
    Envelope.channel, Envelope.tier, Envelope.model_sha256, Envelope.model_name,
    Envelope.fingerprint_id, Envelope.prompt_tokens, Envelope.output_tokens, Envelope.keyids,
    Envelope.dsse_sha256,
)


def _index_dict(row: Any) -> dict[str, Any]:
    d = dict(row._mapping)
    d["dsse_sha256"] = bytes(d["dsse_sha256"]).hex()
    return d


def get_envelope(session: Session, request_id: str) -> tuple[bytes, dict[str, Any]]:
    """(stored DSSE bytes, index fields) of one envelope."""
    row = session.execute(select(Envelope.dsse, *INDEX_COLUMNS)
                          .where(Envelope.request_id == request_id)).first()
    if row is None:
        raise NotFound(f"no envelope with request_id {request_id!r}")
    fields = _index_dict(row)
    return bytes(fields.pop("dsse")), fields


@dataclass(frozen=True, slots=True)
class SearchFilters:
    model_sha256: str | None = None
    model_name: str | None = None
    fingerprint_id: str | None = None
    channel: str | None = None
    recorded_after: datetime | None = None
    recorded_before: datetime | None = None
    order: str = "asc"

    def digest(self) -> str:
        blob = json.dumps(asdict(self), default=str, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def encode_cursor(last_index: int, filters: SearchFilters) -> str:
    raw = json.dumps({"after": last_index, "q": filters.digest()}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str, filters: SearchFilters) -> int:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        obj = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")))
        after, q = obj["after"], obj["q"]
    except (ValueError, KeyError, TypeError, binascii.Error, UnicodeError) as exc:
        raise BadRequest("cursor is not one this API issued", code="bad_cursor") from exc
    if (not isinstance(after, int) or isinstance(after, bool) or not -1 <= after < 2**63
            or q != filters.digest()):
        raise BadRequest("cursor belongs to a different query; start again without it",
                         code="bad_cursor")
    return after


def search(session: Session, filters: SearchFilters, *, limit: int,
           cursor: str | None) -> tuple[list[dict[str, Any]], str | None]:
    stmt: Select[Any] = select(*INDEX_COLUMNS)
    if filters.model_sha256:
        stmt = stmt.where(Envelope.model_sha256 == filters.model_sha256)
    if filters.model_name:
        stmt = stmt.where(Envelope.model_name == filters.model_name)
    if filters.fingerprint_id:
        stmt = stmt.where(Envelope.fingerprint_id == filters.fingerprint_id)
    if filters.channel:
        stmt = stmt.where(Envelope.channel == filters.channel)
    if filters.recorded_after:
        stmt = stmt.where(Envelope.recorded_at >= filters.recorded_after)
    if filters.recorded_before:
        stmt = stmt.where(Envelope.recorded_at < filters.recorded_before)
    descending = filters.order == "desc"
    if cursor:
        after = decode_cursor(cursor, filters)
        stmt = stmt.where(Envelope.log_index < after if descending else Envelope.log_index > after)
    stmt = stmt.order_by(Envelope.log_index.desc() if descending else Envelope.log_index)
    rows = session.execute(stmt.limit(limit + 1)).all()
    items = [_index_dict(r) for r in rows[:limit]]
    next_cursor = encode_cursor(items[-1]["log_index"], filters) if len(rows) > limit else None
    return items, next_cursor
