"""Shared pieces for replay tests: envelopes recorded by the reference engine the way a
gateway would, under varied batch compositions."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Engine

from ledger.artifacts import artifact_hashes
from ledger.core.keys import generate_private_key, public_raw
from ledger.core.trust import TrustPolicy, format_trust_policy, load_trust_policy
from ledger.db.session import make_engine, session_scope
from ledger.log.signer import LogSigner
from ledger.producer import build_statement, envelope_to_json, output_from_result, sign_statement
from ledger.replay.records import Signer
from ledger.services.keys import register_key
from ledger.settings import Settings
from tests.conftest import provision


@dataclass
class Recorded:
    request_id: str
    statement: dict[str, Any]
    envelope: dict[str, Any]


def record(engine: Any, producer: Ed25519PrivateKey, n: int, *, seed: int = 0,
           prefix: str = "rec", max_tokens: int = 12) -> list[Recorded]:
    """Run ``n`` requests through ``engine`` in mixed batches (sizes 1..7, shuffled
    co-tenants, greedy and seeded sampling) and sign an envelope for each."""
    from workers.engine.api import GenerationRequest, SamplingParams
    from workers.engine.reference import TINY_DEMO_DIR

    rng = random.Random(seed)
    artifacts = artifact_hashes(TINY_DEMO_DIR, model_name="tiny-demo")
    runtime = engine.runtime()
    reqs = []
    for i in range(n):
        sampled = i % 3 == 1
        sampling = {"temperature": 0.9 if sampled else 0.0, "top_p": 0.95 if sampled else 1.0,
                    "max_tokens": max_tokens, "seed": 1000 + i, "logprobs": 2,
                    "ignore_eos": i % 4 == 0}
        prompt = tuple(rng.randrange(256) for _ in range(rng.randrange(3, 40)))
        reqs.append((f"{prefix}-{seed}-{i}", prompt, sampling))
    out: list[Recorded] = []
    pos = 0
    while pos < len(reqs):
        size = rng.randrange(1, 8)
        batch = reqs[pos:pos + size]
        pos += size
        results = engine.generate([GenerationRequest(rid, p, SamplingParams.from_mapping(s))
                                   for rid, p, s in batch], max_batch=size)
        for (rid, prompt, sampling), res in zip(batch, results, strict=True):
            st = build_statement(
                request_id=rid, artifacts=artifacts, prompt_token_ids=prompt,
                sampling=sampling, runtime=runtime,
                output=output_from_result(res.token_ids, res.finish_reason, res.logprobs,
                                          res.top_logprobs, res.logits_sha256))
            out.append(Recorded(rid, st, envelope_to_json(sign_statement(st, producer))))
    return out


def tamper(rec: Recorded, producer: Ed25519PrivateKey, k: int, new_request_id: str) -> Recorded:
    """A compromised gateway's edit: change output token k, re-sign with the producer key."""
    from ledger.core.envelope import output_digest

    st = __import__("copy").deepcopy(rec.statement)
    st["predicate"]["request_id"] = new_request_id
    tokens = st["predicate"]["output"]["token_ids"]
    tokens[k] = (tokens[k] + 1) % 256
    st["subject"] = [{"name": new_request_id, "digest": {"sha256": output_digest(tokens)}}]
    return Recorded(new_request_id, st, envelope_to_json(sign_statement(st, producer)))


ORIGIN = "ledger.test/replay"


@dataclass
class Stack:
    settings: Settings
    db: Engine
    producer: Ed25519PrivateKey
    log_signer: LogSigner
    service: Signer
    worker_signer: Signer
    trust: TrustPolicy


@pytest.fixture
def stack(db_url: str, tmp_path: Path) -> Any:
    """A migrated database with log, service, producer and worker keys registered as
    registry leaves, and a trust policy file naming the log and service keys (in-process)."""
    provision(db_url)  # API keys (no registry leaves: the provisioning shortcut)
    log_signer = LogSigner(ORIGIN, generate_private_key())
    service = Signer(generate_private_key(), "ledger", "ledger-service")
    worker_signer = Signer(generate_private_key(), "worker", "test-worker")
    producer = generate_private_key()
    policy = tmp_path / "trust.toml"
    policy.write_text(format_trust_policy(ORIGIN, [log_signer.public_key],
                                          [public_raw(service.key)]))
    settings = Settings(database_url=db_url, log_name=ORIGIN, worker_dead_after_s=30,
                        trust_policy_file=policy)
    db = make_engine(settings, pool_size=4)
    with session_scope(db) as s:
        service.ensure_registered(s)
        log_signer.ensure_registered(s, service)
        worker_signer.ensure_registered(s, service)
        register_key(s, public_key=public_raw(producer), purpose="producer",
                     name="replay-gateway", signer=service)
    yield Stack(settings, db, producer, log_signer, service, worker_signer,
                load_trust_policy(policy))
    db.dispose()


