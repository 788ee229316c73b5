"""Console page latency with 1,000,000 envelopes stored.

Builds a log of N envelopes (default 1,000,000) in a scratch database: every 500th is a
real signed envelope (ingest's columns, a producer key in the registry, the tiny-demo
tokenizer registered and named, 256 prompt / 64 output tokens); the rest are written by
one ``INSERT ... SELECT generate_series`` with their own log entries and leaf hashes
(eight model names, four fingerprints, both channels, a recorded time every 0.5 s), then
the whole log is integrated into tiles and a signed checkpoint. A few hundred disputes
give the dispute-state filter something to find.

Then `ledger serve`'s app (in this process, uvicorn on loopback) answers, over HTTP with a
signed-in console session, each console page and, in the same run, the plain API call a
script would make for the same thing (the baseline): the request page against
``GET /v1/envelopes/{id}``, searches against ``GET /v1/envelopes?...``. Latency is
client-observed on loopback (server time plus a local round trip), p50/p95/p99 over
``--samples`` requests each, interleaved.

    python benchmarks/console.py [--envelopes 1000000] [--samples 300]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import re
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine, pct, scratch_database, table

REAL_EVERY = 500
MODELS = ["Llama-3.1-8B-Instruct", "Qwen2.5-7B-Instruct", "Mistral-7B-Instruct-v0.3",
          "gemma-2-9b-it", "Phi-3.5-mini-instruct", "tiny-demo", "Llama-3.1-70B-Instruct",
          "DeepSeek-V2-Lite-Chat"]
T0 = datetime(2026, 11, 1, tzinfo=UTC)
LOG_NAME = "bench.example/console"


def _runtime(i: int) -> dict[str, Any]:
    from tests.helpers import RUNTIME

    return {**RUNTIME, "cpu_threads": 1 + i}  # four fingerprints


def build(url: str, n: int, tmp: Path) -> dict[str, Any]:
    """Write the log; returns what the server and the samplers need."""

    from pydantic import SecretStr

    from ledger.console.tokenizers import TINY_DEMO_TOKENIZER_SHA256, tiny_demo_tokenizer_json
    from ledger.core.envelope import index_fields, validate_statement
    from ledger.core.keys import generate_private_key, key_id, private_pem, public_raw
    from ledger.core.logentry import log_entry_bytes
    from ledger.core.merkle import leaf_hash
    from ledger.core.trust import format_trust_policy
    from ledger.db.session import make_engine, session_scope
    from ledger.log.integrator import integrate_all
    from ledger.log.signer import LogSigner
    from ledger.producer import build_statement, sign_statement
    from ledger.services.apikeys import create_api_key
    from ledger.services.keys import register_key
    from ledger.settings import Settings

    producer, log_key, service_key = (generate_private_key() for _ in range(3))
    for name, key in (("log", log_key), ("service", service_key)):
        (tmp / f"{name}.pem").write_bytes(private_pem(key))
    (tmp / "trust.toml").write_text(format_trust_policy(LOG_NAME, [public_raw(log_key)],
                                                        [public_raw(service_key)]))
    settings = Settings(database_url=url, log_name=LOG_NAME, log_key_file=tmp / "log.pem",
                        service_key_file=tmp / "service.pem", trust_policy_file=tmp / "trust.toml",
                        api_key_pepper=SecretStr("bench-pepper"), integrate_in_api=False,
                        metrics_port=0)
    engine = make_engine(settings, pool_size=2)
    signer = LogSigner(LOG_NAME, log_key)
    with session_scope(engine) as s:
        signer.ensure_registered(s)
        register_key(s, public_key=public_raw(producer), purpose="producer", name="gateway")
        reviewer = create_api_key(s, name="bench-reviewer", role="reviewer",
                                  pepper="bench-pepper")[1]
    pg = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(pg) as conn:
        conn.execute("INSERT INTO tokenizers (tokenizer_sha256, content, name, vocab_size, "
                     "registered_by) VALUES (%s, %s, 'tiny-demo', 260, 'bench')",
                     (TINY_DEMO_TOKENIZER_SHA256, tiny_demo_tokenizer_json()))
        conn.commit()

    def statement(rid: str, i: int) -> dict[str, Any]:
        text = f"Request {i}: summarise the refund policy for order {i % 9973}. " * 6
        st = build_statement(
            request_id=rid, artifacts={"model_sha256": "ab" * 32,
                                       "tokenizer_sha256": TINY_DEMO_TOKENIZER_SHA256,
                                       "chat_template_sha256": None,
                                       "model_name": MODELS[i % len(MODELS)]},
            prompt_token_ids=[256, *text.encode()[:255]],
            sampling={"temperature": 0.0, "max_tokens": 64, "seed": i, "logprobs": 2},
            runtime=_runtime((i // 7) % 4),
            output={"token_ids": [(7 * j + i) % 256 for j in range(64)],
                    "finish_reason": "length",
                    "logprobs": [-0.5 - j / 1024 for j in range(64)],
                    "top_logprobs": [[{"token_id": (7 * j + i) % 256,
                                       "logprob": -0.5 - j / 1024},
                                      {"token_id": 1, "logprob": -3.0}] for j in range(64)]},
            channel="performance" if i % 10 == 0 else "deterministic")
        st["predicate"]["recorded_at"] = (T0 + timedelta(seconds=i / 2)).isoformat()
        return st

    fps = [index_fields(validate_statement(statement("x", 7 * k))).fingerprint_id
           for k in range(4)]
    template = sign_statement(statement("bench-template", 0), producer).canonical_bytes()
    template_hex = hashlib.sha256(template).hexdigest()
    kid = key_id(public_raw(producer))
    started = time.perf_counter()
    with psycopg.connect(pg) as conn:
        # the synthetic rows: one statement each for entries and envelopes
        conn.execute("""
            INSERT INTO log_entries (idx, kind, ref, entry, leaf_hash)
            SELECT i, 'envelope', r, e, sha256('\\x00'::bytea || e)
            FROM generate_series(0, %(n)s - 1) AS i,
                 LATERAL (SELECT 'bench-' || lpad(i::text, 9, '0') AS r) AS ref,
                 LATERAL (SELECT convert_to(format(
                     '{"dsse_sha256":"%%s","kind":"envelope","ref":"%%s"}', %(hex)s::text, r),
                     'UTF8') AS e) AS entry
            WHERE i %% %(every)s <> 0""", {"n": n, "hex": template_hex, "every": REAL_EVERY})
        conn.execute("""
            INSERT INTO envelopes (log_index, request_id, dsse, dsse_sha256, keyids,
                model_sha256, model_name, fingerprint_id, channel, tier, recorded_at,
                prompt_tokens, output_tokens)
            SELECT i, 'bench-' || lpad(i::text, 9, '0'), %(dsse)s, %(digest)s, %(keyids)s,
                   repeat('ab', 32), (%(models)s::text[])[1 + i %% 8],
                   (%(fps)s::text[])[1 + (i / 7) %% 4],
                   CASE WHEN i %% 10 = 0 THEN 'performance' ELSE 'deterministic' END,
                   'bitwise', %(t0)s + i * interval '0.5 seconds', 256, 64
            FROM generate_series(0, %(n)s - 1) AS i WHERE i %% %(every)s <> 0""",
                     {"n": n, "dsse": template, "digest": bytes.fromhex(template_hex),
                      "keyids": [kid], "models": MODELS, "fps": fps, "t0": T0,
                      "every": REAL_EVERY})
        conn.commit()
        print(f"  synthetic rows: {time.perf_counter() - started:.1f} s", flush=True)
        real = []
        with conn.cursor() as cur:
            entries: list[tuple[Any, ...]] = []
            envs: list[tuple[Any, ...]] = []
            for i in range(0, n, REAL_EVERY):
                rid = f"bench-{i:09d}"
                st = statement(rid, i)
                d = sign_statement(st, producer).canonical_bytes()
                digest = hashlib.sha256(d)
                fields = index_fields(validate_statement(st))
                entry = log_entry_bytes("envelope", rid, digest.hexdigest())
                entries.append((i, "envelope", rid, entry, leaf_hash(entry)))
                envs.append((i, rid, d, digest.digest(), [kid], fields.model_sha256,
                             fields.model_name, fields.fingerprint_id, fields.channel,
                             fields.tier, fields.recorded_at, fields.prompt_tokens,
                             fields.output_tokens))
                real.append(rid)
            with cur.copy("COPY log_entries (idx, kind, ref, entry, leaf_hash) FROM STDIN") as c:
                for row in entries:
                    c.write_row(row)
            with cur.copy("COPY envelopes (log_index, request_id, dsse, dsse_sha256, keyids, "
                          "model_sha256, model_name, fingerprint_id, channel, tier, "
                          "recorded_at, prompt_tokens, output_tokens) FROM STDIN") as c:
                for row in envs:
                    c.write_row(row)
            # disputes on a few hundred records: resolved and awaiting a worker
            import uuid

            for j, rid in enumerate(real[::5]):
                i = int(rid.split("-")[1])
                cur.execute(
                    "INSERT INTO disputes (id, request_id, envelope_index, fingerprint_id, "
                    "reason, state, opened_by) VALUES (%s, %s, %s, %s, 'bench', %s, 'bench')",
                    (uuid.uuid4(), rid, i, fps[(i // 7) % 4],
                     "resolved" if j % 2 else "awaiting_worker"))
            cur.execute("UPDATE log_state SET size = %s", (n,))
        conn.commit()
        conn.execute("ANALYZE")
        conn.commit()
    print(f"  real envelopes and disputes: {time.perf_counter() - started:.1f} s", flush=True)
    integrate_all(engine, signer, max_entries=50_000)
    print(f"  integrated: {time.perf_counter() - started:.1f} s", flush=True)
    engine.dispose()
    return {"settings": settings, "reviewer": reviewer, "real": real, "fps": fps,
            "build_s": time.perf_counter() - started}


def serve(settings: Any) -> tuple[str, Any, threading.Thread]:
    import uvicorn

    from ledger.api.app import create_app
    from tests.helpers import free_port

    app = create_app(settings, publisher=None)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, thread


def console_client(url: str, key: str) -> httpx.Client:
    c = httpx.Client(base_url=url, timeout=60)
    form = c.get("/console/sign-in").text
    found = re.search(r'name="csrf_token" value="([^"]+)"', form)
    assert found is not None, form[:500]
    token = found.group(1)
    r = c.post("/console/sign-in", data={"api_key": key, "csrf_token": token})
    assert r.status_code in (200, 303), r.text
    return c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--envelopes", type=int, default=1_000_000)
    ap.add_argument("--samples", type=int, default=300)
    args = ap.parse_args()
    rng = random.Random(15)
    print(machine())
    with scratch_database("ledger_bench_console") as url, \
            tempfile.TemporaryDirectory() as tmp:
        print(f"building {args.envelopes:,} envelopes ...", flush=True)
        built = build(url, args.envelopes, Path(tmp))
        base, server, thread = serve(built["settings"])
        web = console_client(base, built["reviewer"])
        api = httpx.Client(base_url=base, timeout=60,
                           headers={"Authorization": f"Bearer {built['reviewer']}"})
        n = args.envelopes
        real = built["real"]

        def prefix() -> str:
            return f"bench-{rng.randrange(n):09d}"[:rng.choice((10, 11, 12))]

        cases: list[tuple[str, Any, Any]] = [
            ("request page (verified: signature, entry, proof, checkpoint; decoded)",
             lambda: web.get(f"/console/requests/{rng.choice(real)}"),
             lambda: api.get(f"/v1/envelopes/{rng.choice(real)}")),
            ("search: request ID prefix",
             lambda: web.get("/console/search", params={"q": prefix()}),
             lambda: api.get(f"/v1/envelopes/{rng.choice(real)}")),
            ("search: model name, any case",
             lambda: web.get("/console/search", params={"model": rng.choice(MODELS).upper()}),
             lambda: api.get("/v1/envelopes", params={"model_name": rng.choice(MODELS),
                                                       "order": "desc", "limit": 50})),
            ("search: client X-Request-Id",
             lambda: web.get("/console/search", params={"client_request_id": prefix()}),
             lambda: api.get(f"/v1/envelopes/{rng.choice(real)}")),
            ("search: channel + time range",
             lambda: web.get("/console/search", params={
                 "channel": "performance",
                 "after": (T0 + timedelta(hours=rng.randrange(100))).isoformat(),
                 "before": (T0 + timedelta(hours=120)).isoformat()}),
             lambda: api.get("/v1/envelopes", params={
                 "channel": "performance", "order": "desc", "limit": 50,
                 "recorded_after": (T0 + timedelta(hours=rng.randrange(100))).isoformat(),
                 "recorded_before": (T0 + timedelta(hours=120)).isoformat()})),
            ("search: fingerprint",
             lambda: web.get("/console/search", params={"fingerprint": rng.choice(
                 built["fps"])}),
             lambda: api.get("/v1/envelopes", params={"fingerprint_id": rng.choice(
                 built["fps"]), "order": "desc", "limit": 50})),
            ("search: dispute state (resolved)",
             lambda: web.get("/console/search", params={"dispute": "resolved"}),
             lambda: api.get("/v1/disputes", params={"limit": 50})),
            ("search: never disputed",
             lambda: web.get("/console/search", params={"dispute": "none"}),
             lambda: api.get("/v1/envelopes", params={"order": "desc", "limit": 50})),
        ]
        check = web.get(f"/console/requests/{real[len(real) // 2]}").text
        assert "<b>Verified</b>" in check and "Not verified" not in check, check[:2000]
        assert "is not registered" not in check  # decoded with the registered tokenizer
        rows = []
        for name, page, baseline in cases:
            for _ in range(5):  # warm caches and the tokenizer
                page()
                baseline()
            t_page: list[float] = []
            t_base: list[float] = []
            for _ in range(args.samples):
                for fn, out in ((page, t_page), (baseline, t_base)):
                    t = time.perf_counter()
                    r = fn()
                    out.append((time.perf_counter() - t) * 1000)
                    assert r.status_code == 200, (name, r.status_code, r.text[:300])
            rows.append([name, pct(t_page, 50), pct(t_page, 95), pct(t_page, 99),
                         pct(t_base, 50), pct(t_base, 95), pct(t_page, 95) / pct(t_base, 95)])
            print(f"  {name}: p95 {pct(t_page, 95):.1f} ms", flush=True)
        server.should_exit = True
        thread.join(10)
    print()
    print(f"{n:,} envelopes stored (built and integrated in {built['build_s']:.0f} s); "
          f"{args.samples} samples per row, loopback HTTP, one client")
    print(table(["console page", "p50 ms", "p95 ms", "p99 ms", "API baseline p50",
                 "API baseline p95", "p95 ratio"], rows))


if __name__ == "__main__":
    main()
