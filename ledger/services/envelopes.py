"""Reading envelopes back: one by request_id, or a filtered, keyset-paginated search."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ledger.core.erasure import Tombstone
from ledger.core.sealing import KeyEncryptionKey
from ledger.db.models import Envelope
from ledger.db.session import raw_cursor
from ledger.errors import Gone, NotFound
from ledger.privacy.keys import ErasedContent, Opener
from ledger.replay import views
from ledger.services.pagination import KeyKind, Page, SortKey, page, query_digest

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


def open_stored(session: Session, stored: bytes, fields: dict[str, Any],
                kek: KeyEncryptionKey | None) -> bytes:
    """The DSSE bytes of a stored envelope (its index ``fields`` name digest and index)."""
    with raw_cursor(session) as cur:
        try:
            return Opener(cur, kek).open(stored, bytes.fromhex(fields["dsse_sha256"]),
                                         fields["log_index"])
        except ErasedContent as erased:
            tomb = erased.tombstone
            raise Gone(f"the content of envelope {fields['request_id']!r} was erased: "
                       f"{erased.reason}",
                       tombstone=tomb.served() if tomb is not None else None,
                       index=_jsonable(fields) if tomb is None
                       else _tombstone_index(fields, tomb)) from None


def _jsonable(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in fields.items()}


def _tombstone_index(fields: dict[str, Any], tomb: Tombstone) -> dict[str, Any]:
    """The index fields served with a tombstone: from the signed erasure leaf (the
    columns of an erased record can no longer be checked against its envelope)."""
    out = {k: v for k, v in tomb.fields.items()}
    out["recorded_at"] = tomb.fields["recorded_at"].isoformat()
    out["log_index"] = tomb.log_index
    out["ingested_at"] = fields["ingested_at"].isoformat() if fields.get("ingested_at") \
        else None
    return out


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
        return query_digest(asdict(self))


ENVELOPE_KINDS: tuple[KeyKind, ...] = ("int",)


def search(session: Session, filters: SearchFilters, *, limit: int,
           cursor: str | None) -> Page[dict[str, Any]]:
    """Index fields of the envelopes matching ``filters``, in log order (or reversed), one
    page at a time (:mod:`ledger.services.pagination`; the key is ``log_index``)."""
    stmt = select(*INDEX_COLUMNS)
    for column, value in ((Envelope.model_sha256, filters.model_sha256),
                          (Envelope.model_name, filters.model_name),
                          (Envelope.fingerprint_id, filters.fingerprint_id),
                          (Envelope.channel, filters.channel)):
        if value:
            stmt = stmt.where(column == value)
    if filters.recorded_after:
        stmt = stmt.where(Envelope.recorded_at >= filters.recorded_after)
    if filters.recorded_before:
        stmt = stmt.where(Envelope.recorded_at < filters.recorded_before)
    sort = SortKey(((Envelope.log_index, filters.order == "desc"),), ENVELOPE_KINDS)
    rows, next_cursor = page(session, stmt, sort, limit=limit, cursor=cursor,
                             digest=filters.digest(), key_of=lambda r: (r.log_index,),
                             scalars=False)
    return Page([_index_dict(r) for r in rows], next_cursor)


@dataclass(frozen=True, slots=True)
class EnvelopeView:
    """One stored envelope as served: the DSSE bytes verbatim, the index columns, and
    ``integrity`` naming the columns that disagree with the signed payload."""

    dsse: bytes
    index: dict[str, Any]
    integrity: dict[str, Any]

    def statement(self) -> dict[str, Any]:
        """The decoded in-toto statement (for readers such as the console; the bytes
        above are what was signed)."""
        statement: dict[str, Any] = views.open_signed(self.dsse).statement
        return statement


def envelope_view(session: Session, request_id: str,
                  kek: KeyEncryptionKey | None = None) -> EnvelopeView:
    """The envelope as served; sealed content is opened with ``kek``
    (:mod:`ledger.privacy.keys`). An erased one raises :class:`Gone` with its tombstone."""
    stored, fields = get_envelope(session, request_id)
    dsse_bytes = open_stored(session, stored, fields, kek)
    try:
        integrity = views.integrity(fields, views.envelope_index(dsse_bytes),
                                    views.ENVELOPE_INDEX_FIELDS)
    except views.SignedRecordError as exc:
        integrity = views.unreadable(exc)
    return EnvelopeView(dsse_bytes, fields, integrity)
