"""The vendor worker: semantic verification of vendor records (envelope v2).

A hosted vendor API cannot be replayed token for token, so a dispute or re-verification of
one of its records re-sends the recorded request ``semantic_samples`` times to the vendor,
evaluates the record's assertions (:mod:`ledger.core.assertions`) on every answer, and
signs a verdict at tier ``semantic``: ``reproduced`` or ``diverged`` with the pass rate,
Wilson intervals, every answer (so a third party re-evaluates the verdict from the bundle,
``docs/semantic.md``), and the ``system_fingerprint`` drift between the record and the
answers.

It is a :class:`~workers.replay.ReplayWorker` without models or engine: the same claim,
signature, log-inclusion and trust checks, the same verdict leaves. Its fingerprint is the
vendor's (``{"engine": "vendor:<name>"}``), so it consumes exactly the queue its vendor's
records are routed to, and no GPU worker ever takes one. The vendor's API key comes from
``LEDGER_VENDOR_API_KEY_FILE``: it lives with the worker and is never stored in the
database; the URL it calls is the worker's setting, not the one the record names.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine, select

from ledger.core import dsse, jsonstrict
from ledger.core.assertions import (
    AssertionSet,
    assertion_set_json,
    evaluate,
    parse_assertion_set,
    semantic_summary,
)
from ledger.core.canonical import canonical_json
from ledger.core.dsse import Envelope as DsseEnvelope
from ledger.core.envelope import parse_statement
from ledger.core.errors import KeyError_, LedgerError
from ledger.core.keys import key_id
from ledger.core.trust import TrustPolicy
from ledger.core.vendor import (
    VendorEnvelopeStatement,
    json_sha256,
    vendor_fingerprint_id,
    vendor_runtime,
)
from ledger.db.models import DisputeEvent, ReplayJob, ReplayJobItem, SigningKey
from ledger.db.session import session_scope
from ledger.replay.records import Signer
from ledger.replay.trusted import Unverifiable
from ledger.settings import Settings
from workers.replay import READ_LIMITS, Prepared, ReplayWorker, worker_trust

log = logging.getLogger("ledger.worker")


@dataclass(frozen=True)
class _VendorItem:
    """A checked vendor record and the assertion set to evaluate (the record's, or its
    dispute's: ``source``)."""

    statement: VendorEnvelopeStatement
    assertions: AssertionSet
    source: dict[str, Any]


class VendorWorkerConfigError(ValueError):
    """A vendor worker without its vendor settings does not start."""


class VendorReplayWorker(ReplayWorker):
    def __init__(self, settings: Settings, db: Engine, *, signer: Signer,
                 trust: TrustPolicy | None = None, insecure_dev: bool = False,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.trust = worker_trust(settings, trust, insecure_dev=insecure_dev)
        if self.trust is None:
            log.warning("INSECURE: no trust policy; log and producer keys are taken from the "
                        "database this worker reads (--insecure-dev)")
        if not settings.vendor_name or not settings.vendor_base_url:
            raise VendorWorkerConfigError(
                "a vendor worker needs LEDGER_VENDOR_NAME and LEDGER_VENDOR_BASE_URL")
        self.settings = settings
        self.db = db
        self.signer = signer
        self.vendor = settings.vendor_name
        self.base_url = settings.vendor_base_url.rstrip("/")
        self.api_key = _read_api_key(settings.vendor_api_key_file)
        self.engine_name = "vendor"
        self.models = {}
        self._engines = {}
        self.max_batch = 1
        self.runtime = {**vendor_runtime(self.vendor), "base_url": self.base_url}
        self.fingerprint_id = vendor_fingerprint_id(self.vendor)
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._stop = threading.Event()
        self._heartbeat = None
        self._http = httpx.Client(transport=transport,
                                  timeout=httpx.Timeout(settings.vendor_timeout_s))

    def self_check(self, n: int = 6) -> None:
        """Nothing to check: a vendor worker runs no engine."""

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------ per item
    def _read_request(self, prep: Prepared, envelope: DsseEnvelope, *,
                      foreign_ok: bool) -> None:
        try:
            statement = parse_statement(envelope.payload, READ_LIMITS)
        except LedgerError as exc:
            raise Unverifiable(f"the envelope does not parse: {exc.message}") from exc
        if not isinstance(statement, VendorEnvelopeStatement):
            raise Unverifiable("not a vendor record: a vendor worker verifies only the "
                               "semantic tier of vendor envelopes (v2)")
        if statement.predicate.vendor.name != self.vendor:
            raise Unverifiable(f"the record is of vendor {statement.predicate.vendor.name!r}, "
                               f"this worker calls {self.vendor!r}")
        assertions = statement.predicate.assertions
        source: dict[str, Any] = {"from": "record"}
        if prep.item.dispute_id is not None:
            from_dispute = self._dispute_assertions(prep.item)
            if from_dispute is not None:
                assertions, source = from_dispute
        if assertions is None:
            raise Unverifiable("neither the record nor the dispute carries assertions: "
                               "semantic verification has nothing to check (record with "
                               "--assertions, or open the dispute with assertions)")
        prep.statement = _VendorItem(statement, assertions, source)
        prep.tier = "semantic"

    def _service_keys(self, session: Any) -> dict[str, bytes]:
        """Service keys this worker believes (the policy's; insecure: the database's)."""
        if self.trust is not None:
            return {key_id(pk): bytes(pk) for pk in self.trust.service_keys}
        return {k.keyid: bytes(k.public_key) for k in session.scalars(
            select(SigningKey).where(SigningKey.purpose == "ledger"))}

    def _dispute_assertions(self, item: ReplayJobItem
                            ) -> tuple[AssertionSet, dict[str, Any]] | None:
        """The assertion set of the dispute's signed "opened" event, if it has one."""
        with session_scope(self.db) as session:
            event = session.scalar(select(DisputeEvent).where(
                DisputeEvent.dispute_id == item.dispute_id, DisputeEvent.kind == "opened"))
            if event is None:
                raise Unverifiable("the dispute's opened event is missing")
            keys = self._service_keys(session)
            signed, event_id, index = bytes(event.dsse), event.event_id, event.log_index

        def service_key(kid: str) -> bytes:
            if kid not in keys:
                raise KeyError_(f"{kid} is not a service key this worker trusts")
            return keys[kid]

        try:
            env = dsse.envelope_from_json(signed)
            dsse.verify_envelope(env, service_key)
            predicate = jsonstrict.loads(env.payload, what="dispute event")["predicate"]
            if (predicate["kind"], predicate["dispute_id"], predicate["request_id"],
                    predicate["event_id"]) != ("opened", str(item.dispute_id),
                                               item.request_id, event_id):
                raise Unverifiable("the dispute's opened event names another dispute")
            found = predicate["body"].get("assertions")
            if found is None:
                return None
            parsed = parse_assertion_set(found)
        except LedgerError as exc:
            raise Unverifiable(f"the dispute's opened event: {exc.message}") from exc
        except (KeyError, TypeError, AttributeError) as exc:
            raise Unverifiable(f"the dispute's opened event lacks {exc}") from exc
        return parsed, {"from": "dispute", "event_id": event_id, "log_index": index}

    def _replay(self, prepared: list[Prepared]) -> list[Any]:
        """Each verifiable item's recorded request, re-sent ``semantic_samples`` times."""
        return [self._sample(prep.statement.statement) if prep.problem is None
                and isinstance(prep.statement, _VendorItem) else None for prep in prepared]

    def _sample(self, statement: VendorEnvelopeStatement) -> list[dict[str, Any]]:
        v = statement.predicate.vendor
        url = f"{self.base_url}/{v.endpoint}"
        headers = {"content-type": "application/json", "accept-encoding": "identity"}
        if self.api_key is not None:
            headers["authorization"] = f"Bearer {self.api_key}"
        body = canonical_json(v.request)
        answers = []
        for _ in range(self.settings.semantic_samples):
            response = self._http.post(url, content=body, headers=headers)
            if response.status_code != 200:
                # an engine failure in replay terms: retried, then an ``error`` verdict
                raise RuntimeError(f"the vendor answered {response.status_code}: "
                                   f"{response.text[:200]}")
            answers.append(jsonstrict.loads(response.content, what="vendor answer"))
        return answers

    def _verdict_details(self, prep: Prepared, result: Any, duration_ms: float,
                         job: ReplayJob) -> tuple[str, dict[str, Any]]:
        base = {"job_id": str(job.id), "replay_duration_ms": round(duration_ms, 3),
                "replayed_at": datetime.now(UTC).isoformat(),
                "checkpoint": prep.checkpoint,
                "worker": {"worker_id": self.worker_id, "fingerprint_id": self.fingerprint_id,
                           "runtime": self.runtime}}
        item = prep.statement
        if prep.problem is not None or result is None or not isinstance(item, _VendorItem):
            return "unverifiable", {**base, "tier": None, "reason": prep.problem}
        semantic = semantic_details(item.statement, item.assertions, result, self.settings)
        semantic["assertion_source"] = item.source
        outcome = semantic.pop("outcome")
        drift = semantic.pop("runtime_drift")
        return outcome, {**base, "tier": "semantic", "semantic": semantic,
                         "runtime_drift": drift, "reason": None}


def semantic_details(statement: VendorEnvelopeStatement, assertions: AssertionSet,
                     answers: list[dict[str, Any]], settings: Settings) -> dict[str, Any]:
    """What a semantic verdict states (``docs/semantic.md``, "The verdict")."""
    v = statement.predicate.vendor
    recorded = v.response
    results = [evaluate(assertions, recorded, a) for a in answers]
    summary = semantic_summary(assertions, results, confidence=settings.semantic_confidence,
                               min_pass_rate=settings.semantic_min_pass_rate)
    recorded_fp = _text(v.identifiers.system_fingerprint)
    samples = []
    seen: dict[str | None, int] = {}
    for i, (answer, res) in enumerate(zip(answers, results, strict=True)):
        fp = _text(answer.get("system_fingerprint"))
        seen[fp] = seen.get(fp, 0) + 1
        jcs = canonical_json(answer)
        # the answer as base64 of its RFC 8785 bytes: any JSON string survives (a NUL
        # character, which a JSONB column cannot hold, included)
        samples.append({"index": i, "response_jcs_b64": base64.b64encode(jcs).decode(),
                        "response_sha256": hashlib.sha256(jcs).hexdigest(),
                        "system_fingerprint": fp, "model": _text(answer.get("model")),
                        "passed": all(r.passed for r in res),
                        "results": [r.to_json() for r in res]})
    changed = {fp: n for fp, n in seen.items() if fp != recorded_fp}
    drift = {"recorded_system_fingerprint": recorded_fp,
             "replayed_system_fingerprints": [{"system_fingerprint": fp, "samples": n}
                                              for fp, n in sorted(seen.items(),
                                                                  key=lambda x: str(x[0]))],
             "changed": bool(changed),
             "samples_with_other_fingerprint": sum(changed.values())}
    set_json = assertion_set_json(assertions)
    return {**summary, "assertion_set": set_json,
            "assertion_set_sha256": json_sha256(set_json),
            "recorded": {"response_sha256": v.response_sha256,
                         "request_sha256": v.request_sha256,
                         "system_fingerprint": recorded_fp,
                         "model_alias": v.model_alias},
            "endpoint": v.endpoint, "samples": samples, "runtime_drift": drift,
            "samples_sha256": hashlib.sha256(canonical_json(
                [s["response_sha256"] for s in samples])).hexdigest()}


def _text(value: Any) -> str | None:
    """A vendor's identifier as a verdict states it: a string, NUL characters written as
    the six characters ``\\u0000`` (JSONB holds no NUL); None for a non-string."""
    return value.replace("\x00", "\\u0000") if isinstance(value, str) else None


def _read_api_key(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        key = Path(path).read_text("utf-8").strip()
    except OSError as exc:
        raise VendorWorkerConfigError(f"cannot read LEDGER_VENDOR_API_KEY_FILE {path}: "
                                      f"{exc}") from None
    if not key:
        raise VendorWorkerConfigError(f"LEDGER_VENDOR_API_KEY_FILE {path} is empty")
    return key
