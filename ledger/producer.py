"""Building and signing envelopes, as a gateway (or the capture SDK) does.

Third parties need none of this: ``docs/envelope.md`` specifies the bytes. The statement
is serialised with RFC 8785 here, but the ledger accepts any valid JSON encoding since it
verifies the payload bytes exactly as sent.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.core import dsse
from ledger.core.canonical import canonical_json
from ledger.core.envelope import ENVELOPE_PREDICATE_TYPE, STATEMENT_TYPE, output_digest


def build_statement(
    *,
    request_id: str,
    artifacts: Mapping[str, Any],
    prompt_token_ids: Sequence[int],
    sampling: Mapping[str, Any],
    runtime: Mapping[str, Any],
    output: Mapping[str, Any],
    channel: str = "deterministic",
    tier: str = "bitwise",
    tolerance: Mapping[str, Any] | None = None,
    recorded_at: datetime | None = None,
    data_subject: str | None = None,
) -> dict[str, Any]:
    token_ids = list(output["token_ids"])
    predicate: dict[str, Any] = {
        "request_id": request_id,
        "recorded_at": (recorded_at or datetime.now(UTC)).isoformat(),
        "channel": channel,
        "tier": tier,
        "artifacts": dict(artifacts),
        "prompt_token_ids": list(prompt_token_ids),
        "sampling": dict(sampling),
        "runtime": dict(runtime),
        "output": dict(output),
    }
    if tolerance is not None:
        predicate["tolerance"] = dict(tolerance)
    if data_subject is not None:
        predicate["data_subject"] = data_subject
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": request_id, "digest": {"sha256": output_digest(token_ids)}}],
        "predicateType": ENVELOPE_PREDICATE_TYPE,
        "predicate": predicate,
    }


def sign_statement(statement: Mapping[str, Any], *keys: Ed25519PrivateKey) -> dsse.Envelope:
    return dsse.sign_envelope(canonical_json(dict(statement)), keys)


def envelope_to_json(env: dsse.Envelope) -> dict[str, Any]:
    return {
        "payload": env.payload_b64,
        "payloadType": env.payload_type,
        "signatures": [{"keyid": s.keyid, "sig": s.sig_b64} for s in env.signatures],
    }


def sign_payload_bytes(payload: bytes, *keys: Ed25519PrivateKey) -> dict[str, Any]:
    """Sign arbitrary payload bytes (tests use it to send re-encoded statements)."""
    return envelope_to_json(dsse.sign_envelope(payload, keys))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def output_from_result(token_ids: Sequence[int], finish_reason: str,
                       logprobs: Sequence[float] | None = None,
                       top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None,
                       logits_sha256: Sequence[str] | None = None) -> dict[str, Any]:
    """The envelope's ``output`` object from an engine result (any engine's fields)."""
    out: dict[str, Any] = {"token_ids": list(token_ids), "finish_reason": finish_reason,
                           "logprobs": list(logprobs) if logprobs is not None else None}
    if top_logprobs is not None:
        out["top_logprobs"] = [[{"token_id": int(t), "logprob": float(lp)} for t, lp in step]
                               for step in top_logprobs]
    if logits_sha256 is not None:
        out["logits_sha256"] = list(logits_sha256)
    return out
