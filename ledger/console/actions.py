"""Reviewer actions from the console, recorded exactly as the REST API records them: the
same service calls (:mod:`ledger.replay.disputes`, :mod:`ledger.replay.jobs`,
:mod:`ledger.services.audit`, :mod:`ledger.log.export`), the same actor string
(``"<key name> (<role>)"``), the same audit actions, signed events and log leaves.

Each function commits at the end (it is called from a request handler, the boundary) and
publishes replay jobs only after the commit, as the API does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ledger.db.models import Dispute
from ledger.replay import jobs as job_service
from ledger.replay.broker import Publisher
from ledger.replay.records import Signer, require_signer
from ledger.services import audit, disputes
from ledger.services.apikeys import Principal
from ledger.settings import Settings


def open_dispute(session: Session, engine: Engine, publisher: Publisher | None,
                 signer: Signer | None, settings: Settings, principal: Principal, *,
                 request_id: str, reason: str, priority: str) -> tuple[Dispute, bool]:
    """As ``POST /v1/disputes`` (the same service call): the dispute, its replay job, the
    routing event, the audit event; then the job is published. (dispute, created)."""
    opened = disputes.open_dispute(
        session, principal, require_signer(signer, "opening a dispute"), settings,
        request_id=request_id, reason=reason, priority=priority)
    session.commit()
    if publisher is not None and opened.to_publish:
        job_service.publish(engine, publisher, opened.to_publish)
    return opened.dispute, opened.outcome is disputes.OpenOutcome.CREATED


def comment(session: Session, signer: Signer | None, principal: Principal, dispute_id: str,
            text: str) -> None:
    """As ``POST /v1/disputes/{id}/comments``."""
    disputes.comment(session, principal, require_signer(signer, "commenting"), dispute_id,
                     text=text)
    session.commit()


def resolve(session: Session, signer: Signer | None, principal: Principal, dispute_id: str,
            resolution: str, note: str) -> None:
    """As ``POST /v1/disputes/{id}/resolve``."""
    disputes.resolve(session, principal, require_signer(signer, "resolving"), dispute_id,
                     resolution=resolution, note=note)
    session.commit()


def export(session: Session, engine: Engine, signer: Signer | None, principal: Principal,
           request_ids: list[str], limit: int | None) -> Iterator[bytes]:
    """As ``GET /v1/export``: a signed bundle for ``ledger verify``, as JSON Lines."""
    import itertools

    from ledger.log.export import Selection, bundle_lines

    selection = Selection(request_ids=tuple(request_ids), limit=limit)
    audit.record(session, principal, "export", None, selection=selection.to_json())
    lines = bundle_lines(engine, selection,
                         require_signer(signer, "an export (its manifest is signed)"))
    first = next(lines)  # no checkpoint yet: an error page, not a broken download
    session.commit()
    return _as_bytes(itertools.chain([first], lines))


def _as_bytes(lines: Iterator[Any]) -> Iterator[bytes]:
    for line in lines:
        yield line if isinstance(line, bytes) else str(line).encode()
