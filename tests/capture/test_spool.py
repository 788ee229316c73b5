"""The spool and the shipper against a real ledger: delivered once, conflicts and refusals
quarantined with the ledger's problem, configuration errors retried, quota policies."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.capture import CaptureConfig, Captured, Recorder, Spool, SpoolFull
from ledger.capture.shipper import retry_after_seconds
from tests.capture.conftest import envelope_count, wait_for_envelope
from tests.helpers import MODEL_SHA, RUNTIME, ApiServer

CONFIG = CaptureConfig(
    artifacts={"model_sha256": MODEL_SHA, "tokenizer_sha256": None,
               "chat_template_sha256": None, "model_name": "tiny-demo"},
    runtime=RUNTIME)


def captured(request_id: str, tokens: tuple[int, ...] = (1, 2, 3)) -> Captured:
    return Captured(
        request_id=request_id, prompt_token_ids=[256, 72, 105], token_ids=list(tokens),
        finish_reason="length",
        sampling={"temperature": 0.0, "max_tokens": len(tokens), "seed": 1, "logprobs": 0},
        logprobs=[-0.5] * len(tokens), top_logprobs=None)


def recorder(api: ApiServer, tmp_path: Path, key: Ed25519PrivateKey | None = None,
             api_key: str | None = None, **kw: Any) -> Recorder:
    return Recorder(CONFIG, key or api.producer,  # type: ignore[attr-defined]
                    spool_dir=tmp_path / "spool", ledger_url=api.base_url,
                    api_key=api_key or api.keys["ingester"], min_backoff=0.05,
                    max_backoff=0.2, **kw)


def test_delivery_conflict_and_local_invalid(api: ApiServer, tmp_path: Path) -> None:
    rid = f"spool-{time.time_ns()}"
    with recorder(api, tmp_path) as rec:
        rec.record(captured(rid))
        assert rec.wait_delivered(20)
        assert wait_for_envelope(api, rid)["predicate"]["output"]["token_ids"] == [1, 2, 3]
        rec.record(captured(rid, (4, 5)))                 # same request_id, other bytes
        bad = captured(rid + "-bad")
        bad.sampling["max_tokens"] = 1                    # output longer than max_tokens
        rec.record(bad)
        assert rec.wait_delivered(20)
        stats = rec.stats()
        quarantined = rec.spool.quarantined()
    assert stats["invalid"] == 1 and stats["spool"]["quarantined"] == 2
    by_id = {(q.request_id, q.status): q for q in quarantined}
    conflict = by_id[(rid, 409)]
    assert conflict.problem["code"] == "request_id_conflict"
    local = by_id[(rid + "-bad", None)]
    assert local.problem["code"] == "invalid_envelope"


def test_unregistered_key_is_quarantined_with_the_problem(api: ApiServer,
                                                          tmp_path: Path) -> None:
    rid = f"unknown-key-{time.time_ns()}"
    with recorder(api, tmp_path, key=Ed25519PrivateKey.generate()) as rec:
        rec.record(captured(rid))
        assert rec.wait_delivered(20)
        (q,) = rec.spool.quarantined()
    assert q.request_id == rid and q.status == 422 and q.problem["code"] == "unknown_key"


def test_same_bytes_twice_count_as_delivered_once(api: ApiServer, tmp_path: Path) -> None:
    rid = f"twice-{time.time_ns()}"
    before = envelope_count(api)
    with recorder(api, tmp_path, ship=False) as rec:
        rec.record(captured(rid))
        assert rec.flush(10)
        (row,) = rec.spool.due(10, 1 << 20)
    spool = Spool(tmp_path / "spool")
    spool.append([(rid, row.body)])                       # a retry of the very same bytes
    with recorder(api, tmp_path) as rec:
        assert rec.wait_delivered(20)
        totals = rec.spool.stats()["totals"]
    assert totals["delivered"] == 2 and totals["delivered_existing"] == 1
    assert envelope_count(api) == before + 1


def test_bad_api_key_is_retried_not_quarantined(api: ApiServer, tmp_path: Path) -> None:
    rid = f"bad-api-key-{time.time_ns()}"
    with recorder(api, tmp_path, api_key="not-a-key") as rec:
        rec.record(captured(rid))
        assert not rec.wait_delivered(1.0)
        stats = rec.stats()
    assert stats["spool"]["pending"] == 1 and stats["spool"]["quarantined"] == 0
    assert stats["shipper"]["last_error"] == "HTTP 401"
    with recorder(api, tmp_path) as rec:                  # fixed configuration: delivered
        assert rec.wait_delivered(20)
    wait_for_envelope(api, rid)


def test_spool_survives_reopen_and_enforces_its_quota(api: ApiServer, tmp_path: Path) -> None:
    with recorder(api, tmp_path, ship=False, max_bytes=4000) as rec:
        rec.admit()
        for i in range(3):
            rec.record(captured(f"quota-{i}"))
        assert rec.flush(10)
        assert rec.spool.used_bytes > 4000
        with pytest.raises(SpoolFull):
            rec.admit()                                   # fail closed: refuse new work
    reopened = Spool(tmp_path / "spool", max_bytes=4000)
    assert reopened.pending_count() == 3 and not reopened.has_room()
    with recorder(api, tmp_path, ship=False, max_bytes=4000, when_full="drop") as rec:
        rec.admit()                                       # drop: never refuses
        rec.record(captured("quota-dropped"))
        assert rec.flush(10)
        assert rec.stats()["dropped_full"] == 1 and rec.spool.pending_count() == 3


def test_retry_after_forms() -> None:
    assert retry_after_seconds("7") == 7.0
    assert retry_after_seconds(None) is None and retry_after_seconds("soon") is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
