"""The demo's world for console tests: a real API (uvicorn, in a thread) on a real
PostgreSQL, an in-process replay worker on the tiny-demo engine (as ``ledger demo`` runs
it), records made by ``ledger.demo.record_requests`` (an honest one, one a compromised
gateway altered at token k and re-signed, one with HTML and a script in its prompt), and
an API key for every role."""

from __future__ import annotations

import copy
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from ledger.core.keys import generate_private_key, private_pem, public_raw
from tests.helpers import TEST_PEPPER, free_port

LOG_NAME = "console-test.inference-ledger.local/log"
XSS_PROMPT = ('Is <b>this</b> bold? <script>window.__pwned = 1</script>'
              '<img src=x onerror="window.__pwned=2">')


@dataclass
class ConsoleStack:
    url: str
    keys: dict[str, str]
    honest: str
    altered: str
    xss: str
    k: int
    db: Any
    settings: Any
    publisher: Any
    extra: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="module")
def console_stack(module_db_url: str, tmp_path_factory: pytest.TempPathFactory,
                  tiny_engine: Any) -> Iterator[ConsoleStack]:
    import uvicorn

    from ledger.api.app import create_app
    from ledger.artifacts import artifact_hashes
    from ledger.console.demo import readable_demo_artifacts
    from ledger.core.envelope import output_digest
    from ledger.core.trust import format_trust_policy
    from ledger.db.session import make_engine, session_scope
    from ledger.demo import record_requests
    from ledger.log.signer import LogSigner
    from ledger.producer import (
        build_statement,
        envelope_to_json,
        output_from_result,
        sign_statement,
    )
    from ledger.replay.broker import InProcessPublisher
    from ledger.replay.records import Signer
    from ledger.services.apikeys import create_api_key
    from ledger.services.keys import register_key
    from ledger.settings import Settings
    from workers.engine.api import GenerationRequest, SamplingParams
    from workers.engine.reference import TINY_DEMO_DIR
    from workers.replay import ReplayWorker

    tmp = tmp_path_factory.mktemp("console")
    keys = {n: generate_private_key() for n in ("log", "service", "worker", "gateway")}
    paths = {}
    for name, key in keys.items():
        paths[name] = tmp / f"{name}.pem"
        paths[name].write_bytes(private_pem(key))
    (tmp / "trust.toml").write_text(format_trust_policy(
        LOG_NAME, [public_raw(keys["log"])], [public_raw(keys["service"])]))
    settings = Settings(database_url=module_db_url, log_name=LOG_NAME,
                        log_key_file=paths["log"], service_key_file=paths["service"],
                        worker_key_file=paths["worker"], integrate_interval_ms=50,
                        worker_dead_after_s=30, data_dir=tmp, api_key_pepper=TEST_PEPPER,
                        trust_policy_file=tmp / "trust.toml", metrics_port=0)
    db = make_engine(settings, pool_size=4)
    service = Signer(keys["service"], "ledger", "ledger-service")
    api_keys: dict[str, str] = {}
    with session_scope(db) as s:
        service.ensure_registered(s)
        LogSigner(LOG_NAME, keys["log"]).ensure_registered(s, service)
        # valid from yesterday: the re-verification test records the last hour
        register_key(s, public_key=public_raw(keys["gateway"]), purpose="producer",
                     name="gateway", signer=service, actor="test",
                     not_before=datetime.now(UTC) - timedelta(days=1))
        register_key(s, public_key=public_raw(keys["worker"]), purpose="worker",
                     name="worker", signer=service, actor="test")
        for role in ("ingester", "reviewer", "auditor", "worker", "admin"):
            api_keys[role] = create_api_key(s, name=f"console-{role}", role=role,
                                            pepper=TEST_PEPPER, signer=service)[1]
    worker = ReplayWorker(settings, db, models=["tiny-demo"],
                          signer=Signer(keys["worker"], "worker", "console-worker"))
    worker.self_check()
    worker.register()
    worker.start_heartbeat()
    publisher = InProcessPublisher(worker.run_job, {worker.fingerprint_id})
    app = create_app(settings, db, publisher=publisher)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the API did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    try:
        artifacts = readable_demo_artifacts(
            db, artifact_hashes(TINY_DEMO_DIR, model_name="tiny-demo"))
        recorded = record_requests(tiny_engine, keys["gateway"], tiny_engine.runtime(),
                                   artifacts, "demo-console", 8, random.Random(2026))
        honest = recorded[3]
        k = 4
        altered = copy.deepcopy(recorded[5]["statement"])
        tokens = altered["predicate"]["output"]["token_ids"]
        tokens[k] = (tokens[k] + 17) % 256
        altered["predicate"]["request_id"] = "demo-console-altered"
        altered["subject"] = [{"name": "demo-console-altered",
                               "digest": {"sha256": output_digest(tokens)}}]
        prompt = (256, *XSS_PROMPT.encode())
        sampling = {"temperature": 0.0, "max_tokens": 12, "seed": 1, "logprobs": 2}
        res = tiny_engine.generate([GenerationRequest(
            "demo-console-html", prompt, SamplingParams.from_mapping(sampling))], max_batch=1)[0]
        xss = build_statement(request_id="demo-console-html", artifacts=artifacts,
                              prompt_token_ids=prompt, sampling=sampling,
                              runtime=tiny_engine.runtime(), output=output_from_result(
                                  res.token_ids, res.finish_reason, res.logprobs,
                                  res.top_logprobs, res.logits_sha256))
        envelopes = [r["envelope"] for r in recorded] + [
            sign_statement(altered, keys["gateway"]), sign_statement(xss, keys["gateway"])]
        with httpx.Client(base_url=url, timeout=60, headers={
                "Authorization": f"Bearer {api_keys['ingester']}"}) as c:
            r = c.post("/v1/envelopes/batch", params={"wait": True, "timeout": 30},
                       json={"envelopes": [envelope_to_json(e) for e in envelopes]})
            r.raise_for_status()
            assert all(x.get("receipt") for x in r.json()["results"]), r.text
        yield ConsoleStack(url, api_keys, honest["statement"]["predicate"]["request_id"],
                           "demo-console-altered", "demo-console-html", k, db, settings,
                           publisher, {"original_k": recorded[5]["statement"]["predicate"][
                               "output"]["token_ids"][k], "gateway": keys["gateway"],
                               "statements": [r["statement"] for r in recorded]})
    finally:
        server.should_exit = True
        thread.join(10)
        worker.stop()
        publisher.close()
        db.dispose()
