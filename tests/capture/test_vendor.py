"""Issue 20: the vendor channel and the semantic tier, end to end on real parts.

``ledger engine serve`` stands in for a hosted vendor: sampled (temperature > 0, no
seed), its own ``system_fingerprint``, nothing asked of it that a client did not ask.

- Acceptance 1: calls through ``ledger proxy --vendor`` and the SDK (``wrap_openai`` with
  ``Recorder.for_vendor``) are vendor envelopes (v2) holding the request as sent and the
  answer as received, the client gets the upstream's bytes, and nothing claims the token
  or bitwise tier.
- Acceptance 2: disputes of those records end ``semantic`` verdicts signed by a vendor
  worker (which holds the vendor key in a file, never in the database): an assertion that
  always holds passes every sample, one that never holds none, and one that holds with a
  probability ``p`` computed from the model's own next-token distribution passes a share
  whose Wilson interval (99.9 %) contains ``p``; a worker whose vendor answers with
  another ``system_fingerprint`` reports the drift. The audit and the offline bundle
  verification accept the new leaves, and a third party re-evaluates the verdict from the
  bundle alone (:func:`ledger.core.assertions.reevaluate`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select
from sqlalchemy import text as sa_text

from ledger.core import dsse
from ledger.core.assertions import assertion_set_json, parse_assertion_set, reevaluate
from ledger.core.keys import generate_private_key, private_pem, public_raw
from ledger.core.vendor import json_sha256, vendor_fingerprint_id
from tests.capture.conftest import Process, ledger_env, run_process, wait_for_envelope
from tests.helpers import ApiServer, free_port

MODEL = "tiny-demo"
VENDOR = "acme-test"
CHAT = [{"role": "user", "content": "Approve the refund?"}]
PROMPT = "Hi"
SAMPLES = 60
CONFIDENCE = 0.999
VENDOR_KEY = "sk-vendor-secret-0123456789"

ALWAYS_SET = {"version": 1, "assertions": [
    {"id": "object", "kind": "one_of", "select": {"path": "$.object"},
     "values": ["chat.completion", "text_completion"]},
    {"id": "choice-shape", "kind": "json_schema", "select": {"path": "$.choices[0]"},
     "schema": {"type": "object", "required": ["index", "finish_reason"]}}]}


@dataclass
class Recorded:
    request_id: str
    client_bytes: bytes
    request: dict[str, Any]


def _post(client: openai.OpenAI, endpoint: str, args: dict[str, Any],
          request_id: str) -> bytes:
    resource = client.completions if endpoint == "completions" else client.chat.completions
    raw = resource.with_raw_response.create(model=MODEL, **args,
                                            extra_headers={"X-Request-Id": request_id})
    assert raw.http_response.status_code == 200, raw.http_response.text
    return bytes(raw.http_response.content)


def _stream(client: openai.OpenAI, args: dict[str, Any], request_id: str) -> bytes:
    with client.chat.completions.with_streaming_response.create(
            model=MODEL, stream=True, **args,
            extra_headers={"X-Request-Id": request_id}) as response:
        return b"".join(response.iter_bytes())


@pytest.fixture(scope="module")
def producer_key(api: ApiServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vendor") / "producer.pem"
    path.write_bytes(private_pem(api.producer))  # type: ignore[attr-defined]
    return path


@pytest.fixture(scope="module")
def vendor_proxy(api: ApiServer, engine_server: Process, producer_key: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    d = tmp_path_factory.mktemp("vendor-proxy")
    (d / "assertions.json").write_text(json.dumps(ALWAYS_SET))
    port = free_port()
    with run_process(["proxy", "--upstream", engine_server.base_url, "--port", str(port),
                      "--key", str(producer_key), "--vendor", VENDOR, "--assertions",
                      str(d / "assertions.json"), "--spool", str(d / "spool"),
                      "--max-backoff", "1"],
                     health_path="/ledger/capture/status", port=port,
                     log_path=d / "proxy.log", env=ledger_env(api)) as p:
        yield p


@pytest.fixture(scope="module")
def next_token_distribution(engine_server: Process) -> dict[int, float]:
    """The model's first-token distribution for PROMPT at temperature 1 (raw logprobs are
    the sampling distribution there): the top 20, from the server itself."""
    r = httpx.post(engine_server.base_url + "/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 20,
        "return_tokens_as_token_ids": True}, timeout=30)
    assert r.status_code == 200, r.text
    top = r.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    return {int(k.removeprefix("token_id:")): math.exp(v) for k, v in top.items()}


@pytest.fixture(scope="module")
def half_set(next_token_distribution: dict[int, float]) -> tuple[dict[str, Any], float]:
    """An assertion set with one member that always holds, one that never does, and one
    that holds with probability p (the first token is one of a set of ids of mass p)."""
    chosen, mass = [], 0.0
    for token, prob in sorted(next_token_distribution.items(), key=lambda kv: -kv[1]):
        if mass >= 0.45:
            break
        chosen.append(token)
        mass += prob
    assert 0.3 < mass < 0.7, next_token_distribution
    return {"version": 1, "assertions": [
        {"id": "always", "kind": "one_of", "select": {"path": "$.object"},
         "values": ["text_completion"]},
        {"id": "never", "kind": "equals", "select": {"path": "$.choices[0].text"},
         "expected": {"value": "a sentence that one token cannot spell"}},
        {"id": "half", "kind": "one_of", "select": {"path": "$.choices[0].token_ids[0]"},
         "values": sorted(chosen)}]}, mass


@pytest.fixture(scope="module")
def records(api: ApiServer, vendor_proxy: Process, engine_server: Process,
            producer_key: Path, half_set: tuple[dict[str, Any], float],
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Recorded]:
    """Sampled calls through the proxy (chat, completions) and the SDK (the half set)."""
    from ledger.capture import Recorder, wrap_openai

    via = openai.OpenAI(base_url=vendor_proxy.base_url + "/v1", api_key="client-key",
                        max_retries=0)
    out: dict[str, Recorded] = {}
    for name, endpoint, args in [
            ("proxy-chat", "chat", {"messages": CHAT, "max_tokens": 6, "temperature": 0.9}),
            ("proxy-completion", "completions", {"prompt": "Once upon", "max_tokens": 5,
                                                 "temperature": 1.2, "top_p": 0.9})]:
        body = _post(via, endpoint, args, f"{name}-{uuid.uuid4().hex[:8]}")
        out[name] = Recorded(json.loads(body)["id"], body, {"model": MODEL, **args})
    recorder = Recorder.for_vendor(
        key=producer_key, name=VENDOR, base_url=engine_server.base_url + "/v1",
        assertions=half_set[0], spool_dir=tmp_path_factory.mktemp("sdk-spool"),
        ledger_url=api.base_url, api_key=api.keys["ingester"], max_backoff=1)
    try:
        sdk = wrap_openai(openai.OpenAI(base_url=engine_server.base_url + "/v1",
                                        api_key="client-key", max_retries=0), recorder)
        args = {"prompt": PROMPT, "max_tokens": 1, "temperature": 1.0,
                "extra_body": {"return_token_ids": True}}
        body = _post(sdk, "completions", args, f"sdk-half-{uuid.uuid4().hex[:8]}")
        out["sdk-half"] = Recorded(json.loads(body)["id"], body, {
            "model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 1.0,
            "return_token_ids": True})
        assert recorder.wait_delivered(30)
        assert recorder.stats()["tier"] == "semantic"
    finally:
        recorder.close()
    for rec in out.values():
        wait_for_envelope(api, rec.request_id)
    return out


# ---------------------------------------------------------------------- acceptance 1
def test_vendor_calls_are_recorded_as_sent_and_received(
        api: ApiServer, records: dict[str, Recorded],
        half_set: tuple[dict[str, Any], float]) -> None:
    for name, rec in records.items():
        statement = wait_for_envelope(api, rec.request_id)
        p = statement["predicate"]
        v = p["vendor"]
        answer = json.loads(rec.client_bytes)
        assert statement["predicateType"] == "urn:inference-ledger:envelope:v2", name
        assert (p["channel"], p["tier"]) == ("vendor", "semantic")
        # the request exactly as the client sent it: no seed, token IDs or logprobs added
        assert v["request"] == rec.request, name
        assert v["response"] == answer
        assert v["response_body_sha256"] == hashlib.sha256(rec.client_bytes).hexdigest()
        assert v["response_sha256"] == json_sha256(answer) == \
            statement["subject"][0]["digest"]["sha256"]
        assert v["identifiers"]["system_fingerprint"] == answer["system_fingerprint"]
        assert answer["system_fingerprint"].startswith("ledger-")
        assert v["identifiers"]["model"] == MODEL and v["model_alias"] == MODEL
        # what a vendor record cannot offer, said out loud
        assert {"seed", "logprobs", "runtime"} <= set(v["missing"])
        assert ("token_ids" in v["missing"]) == (name != "sdk-half")
        wanted = ALWAYS_SET if name.startswith("proxy") else half_set[0]
        assert p["assertions"] == assertion_set_json(parse_assertion_set(wanted))
    with api.client("reviewer") as c:
        for rec in records.values():
            got = c.get(f"/v1/envelopes/{rec.request_id}").json()["index"]
            assert (got["channel"], got["tier"], got["fingerprint_id"]) == (
                "vendor", "semantic", vendor_fingerprint_id(VENDOR)), got
    import psycopg

    url = api.db_url.replace("postgresql+psycopg://", "postgresql://")  # type: ignore[attr-defined]
    with psycopg.connect(url) as conn:
        tiers = conn.execute("SELECT DISTINCT channel, tier FROM envelopes WHERE "
                             "fingerprint_id = %s", (vendor_fingerprint_id(VENDOR),)).fetchall()
    assert tiers == [("vendor", "semantic")]


def test_the_client_gets_the_vendors_bytes_and_streams_pass_unrecorded(
        vendor_proxy: Process, engine_server: Process) -> None:
    via = openai.OpenAI(base_url=vendor_proxy.base_url + "/v1", api_key="x", max_retries=0)
    direct = openai.OpenAI(base_url=engine_server.base_url + "/v1", api_key="x",
                           max_retries=0)
    status = vendor_proxy.base_url + "/ledger/capture/status"
    before = httpx.get(status).json()
    assert (before["channel"], before["tier"]) == ("vendor", "semantic")
    greedy = {"messages": CHAT, "max_tokens": 6, "temperature": 0}
    proxied_calls = []
    for kind, call in (("body", lambda c, rid: _post(c, "chat", greedy, rid)),
                       ("stream", lambda c, rid: _stream(c, greedy, rid))):
        for _attempt in range(3):
            rid = f"bytes-{uuid.uuid4().hex[:10]}"
            while time.time() % 1 > 0.7:           # both calls inside one second
                time.sleep(0.05)
            proxied, upstream = call(via, rid), call(direct, rid)
            proxied_calls.append(kind)
            if proxied == upstream:
                break
        assert proxied == upstream
    after = httpx.get(status).json()
    # every body recorded, every stream forwarded unrecorded (and counted)
    assert after["recorded"] - before["recorded"] == proxied_calls.count("body")
    assert after["unrecordable"] - before["unrecordable"] == proxied_calls.count("stream")
    assert after["unrecordable_reasons"] == {
        "streamed vendor answers are not recorded (stream: true)": after["unrecordable"]}


# ---------------------------------------------------------------------- acceptance 2
class HeaderTap(httpx.HTTPTransport):
    """The vendor worker's real HTTP transport, noting the headers it sends."""

    def __init__(self) -> None:
        super().__init__()
        self.authorizations: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.authorizations.append(request.headers.get("authorization", ""))
        return super().handle_request(request)


def vendor_worker(api: ApiServer, base_url: str, key_file: Path) -> Any:
    from ledger.db.session import make_engine, session_scope
    from ledger.replay.records import Signer
    from ledger.settings import Settings
    from workers.semantic import VendorReplayWorker

    settings = Settings(database_url=api.db_url,  # type: ignore[attr-defined]
                        vendor_name=VENDOR, vendor_base_url=base_url + "/v1",
                        vendor_api_key_file=key_file, semantic_samples=SAMPLES,
                        semantic_confidence=CONFIDENCE)
    db = make_engine(settings, pool_size=2)
    signer = Signer(generate_private_key(), "worker", f"vendor-worker-{uuid.uuid4().hex[:6]}")
    with session_scope(db) as s:
        signer.ensure_registered(s)
    tap = HeaderTap()
    # `api` provisions keys without registry leaves and writes no trust policy (as in
    # test_proxy.py); the trust-policy paths are the replay worker's, shared by this one
    worker = VendorReplayWorker(settings, db, signer=signer, insecure_dev=True, transport=tap)
    worker.register()
    return worker, tap


def dispute(api: ApiServer, worker: Any, request_id: str) -> dict[str, Any]:
    """Open a dispute, let ``worker`` run its job, return the signed verdict's view."""
    from ledger.db.models import Verdict
    from ledger.db.session import session_scope
    from ledger.replay.views import verdict_view

    with api.client("reviewer") as c:
        r = c.post("/v1/disputes", json={"request_id": request_id, "reason": "semantic"})
        assert r.status_code == 201, r.text
        assert r.json()["state"] == "queued", r.json()   # routed to the vendor's queue
        assert worker.run_job(r.json()["job_id"]) == "done"
        d = c.get(f"/v1/disputes/{r.json()['id']}").json()
    assert d["state"] == "verdict"
    with session_scope(worker.db) as s:
        row = s.scalar(select(Verdict).where(Verdict.verdict_id == d["verdict_id"]))
        assert row is not None
        signed = bytes(row.dsse)
    env = dsse.envelope_from_json(signed)
    dsse.verify_envelope(env, lambda kid: public_raw(worker.signer.key))  # the worker key
    return verdict_view(signed)


def test_disputes_end_semantic_verdicts_with_the_right_pass_rates(
        api: ApiServer, engine_server: Process, records: dict[str, Recorded],
        half_set: tuple[dict[str, Any], float], tmp_path: Path) -> None:
    key_file = tmp_path / "vendor.key"
    key_file.write_text(VENDOR_KEY + "\n")
    worker, tap = vendor_worker(api, engine_server.base_url, key_file)
    try:
        view = dispute(api, worker, records["sdk-half"].request_id)
        assert (view["outcome"], view["tier"]) == ("diverged", "semantic"), view["details"]
        sem = view["details"]["semantic"]
        rates = sem["assertions"]
        assert sem["n"] == SAMPLES and len(sem["samples"]) == SAMPLES
        assert rates["always"]["passes"] == SAMPLES
        assert rates["never"]["passes"] == 0
        p = half_set[1]
        half = rates["half"]
        assert 0 < half["passes"] < SAMPLES
        assert half["interval"]["confidence"] == CONFIDENCE
        assert half["interval"]["low"] <= p <= half["interval"]["high"], (half, p)
        assert rates["always"]["interval"]["low"] > 0.8
        assert rates["never"]["interval"]["high"] < 0.2
        assert sem["passes"] == 0 and sem["failing_samples"] == list(range(SAMPLES))
        assert view["details"]["runtime_drift"]["changed"] is False
        # the vendor key went to the vendor as a Bearer token, and into no database row
        assert tap.authorizations == [f"Bearer {VENDOR_KEY}"] * SAMPLES
        reproduced = dispute(api, worker, records["proxy-chat"].request_id)
        assert (reproduced["outcome"], reproduced["tier"]) == ("reproduced", "semantic")
        assert reproduced["details"]["semantic"]["pass_rate"] == 1.0
    finally:
        worker.stop()
        worker.close()
        worker.db.dispose()
    import psycopg

    url = api.db_url.replace("postgresql+psycopg://", "postgresql://")  # type: ignore[attr-defined]
    with psycopg.connect(url) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]
        for table in tables:
            hit = conn.execute(f'SELECT count(*) FROM "{table}" t WHERE t::text LIKE %s '
                               "OR encode(convert_to(t::text, 'UTF8'), 'escape') LIKE %s",
                               (f"%{VENDOR_KEY}%", f"%{VENDOR_KEY}%")).fetchone()
            assert hit is not None and hit[0] == 0, table


def test_a_changed_system_fingerprint_is_reported_as_runtime_drift(
        api: ApiServer, records: dict[str, Recorded], tmp_path: Path) -> None:
    """The vendor "moved its backend": another ``ledger engine serve`` (two threads: another
    runtime, so another ``system_fingerprint``) answers the worker's re-sent requests."""
    port = free_port()
    key_file = tmp_path / "vendor.key"
    key_file.write_text(VENDOR_KEY)
    with run_process(["engine", "serve", "--model", MODEL, "--port", str(port),
                      "--threads", "2"], health_path="/health", port=port,
                     log_path=tmp_path / "engine2.log") as moved:
        worker, _ = vendor_worker(api, moved.base_url, key_file)
        try:
            view = dispute(api, worker, records["proxy-completion"].request_id)
        finally:
            worker.stop()
            worker.close()
            worker.db.dispose()
    recorded = json.loads(records["proxy-completion"].client_bytes)["system_fingerprint"]
    drift = view["details"]["runtime_drift"]
    assert (view["outcome"], view["tier"]) == ("reproduced", "semantic")
    assert drift["changed"] is True
    assert drift["recorded_system_fingerprint"] == recorded
    assert drift["samples_with_other_fingerprint"] == SAMPLES
    (other,) = drift["replayed_system_fingerprints"]
    assert other["system_fingerprint"] != recorded and other["samples"] == SAMPLES


def test_audit_and_bundle_accept_vendor_records_and_a_third_party_reevaluates(
        api: ApiServer, records: dict[str, Recorded]) -> None:
    """Runs after the disputes above: their verdicts are leaves of the log."""
    from ledger.core.bundle import verify_bundle
    from ledger.db.session import make_engine
    from ledger.log.audit import audit
    from ledger.settings import Settings

    settings = Settings(database_url=api.db_url)  # type: ignore[attr-defined]
    engine = make_engine(settings, pool_size=1)
    try:
        deadline = time.monotonic() + 20
        while True:       # the API's integrator folds the last verdicts into a checkpoint
            report = audit(engine, settings.log_name)
            with engine.connect() as conn:
                pending = conn.execute(sa_text(
                    "SELECT (SELECT count(*) FROM log_entries) - "
                    "(SELECT size FROM log_tree)")).scalar()
            if pending == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert report.ok, report.problems[:5]
        assert report.records_checked.get("verdict", 0) >= 3, report.records_checked
    finally:
        engine.dispose()
    from ledger.replay.jobs import no_worker_reason

    reason = no_worker_reason(vendor_fingerprint_id(VENDOR), {"engine": f"vendor:{VENDOR}"})
    assert f"LEDGER_VENDOR_NAME={VENDOR}" in reason and "ledger worker --vendor" in reason
    with api.client("reviewer") as c:
        r = c.get("/v1/semantic/pass-rates", params={"vendor": VENDOR, "bucket": "day"})
        assert r.status_code == 200, r.text
        items = r.json()["items"]        # one (vendor, alias, day), two across a midnight
        assert c.get("/v1/semantic/pass-rates", params={
            "vendor": "nobody"}).json()["items"] == []
        by_hour = c.get("/v1/semantic/pass-rates", params={"vendor": VENDOR,
                                                           "bucket": "hour"}).json()["items"]
    assert sum(i["records"] for i in by_hour) == sum(i["records"] for i in items) == 3
    assert all(len(i["bucket"]) == 13 for i in by_hour)
    totals = {k: sum(i[k] for i in items) for k in (
        "records", "samples", "passes", "reproduced", "diverged", "records_with_drift")}
    assert {(i["fingerprint_id"], i["model_alias"]) for i in items} == {
        (vendor_fingerprint_id(VENDOR), MODEL)}
    # three records judged: the half set (no sample passes all), two always-true sets
    assert totals == {"records": 3, "samples": 3 * SAMPLES, "passes": 2 * SAMPLES,
                      "reproduced": 2, "diverged": 1, "records_with_drift": 1}
    if len(items) == 1:                  # (not when the verdicts straddle a midnight)
        assert items[0]["interval"]["low"] < 2 / 3 < items[0]["interval"]["high"]
    rid = records["sdk-half"].request_id
    with api.client("auditor") as c:
        r = c.get("/v1/export", params={"request_id": rid})
        assert r.status_code == 200, r.text
    summary = verify_bundle(r.content)
    assert summary is not None
    # the third party: nothing but the bundle's lines and ledger.core (or docs/semantic.md)
    lines = [json.loads(line) for line in r.content.splitlines()[1:]]
    payloads = {rec["kind"]: json.loads(base64.b64decode(rec["dsse"]["payload"]))
                for rec in lines if rec["kind"] in ("envelope", "verdict")}
    envelope = payloads["envelope"]["predicate"]
    verdict = payloads["verdict"]["predicate"]
    sem = verdict["semantic"]
    assert sem["assertion_set"] == envelope["assertions"]
    assert sem["assertion_set_sha256"] == json_sha256(envelope["assertions"])
    assert sem["recorded"]["response_sha256"] == envelope["vendor"]["response_sha256"]
    jcs = [base64.b64decode(s["response_jcs_b64"]) for s in sem["samples"]]
    assert [hashlib.sha256(b).hexdigest() for b in jcs] == [
        s["response_sha256"] for s in sem["samples"]]
    answers = [json.loads(b) for b in jcs]
    assert [json_sha256(a) for a in answers] == [s["response_sha256"] for s in sem["samples"]]
    again = reevaluate(envelope["assertions"], envelope["vendor"]["response"], answers,
                       confidence=sem["interval"]["confidence"],
                       min_pass_rate=sem["decision"]["min_pass_rate"])
    assert again["outcome"] == verdict["outcome"]
    for key in ("passes", "n", "pass_rate", "interval", "assertions", "failing_samples"):
        assert again[key] == sem[key], key


def test_the_console_shows_vendor_records_and_semantic_verdicts(
        api: ApiServer, records: dict[str, Recorded]) -> None:
    """A reviewer's pages: the vendor call as recorded, and a semantic verdict with its
    rates and drift, never a token diff or a "token IDs matched" claim."""
    import html
    import re

    c = httpx.Client(base_url=api.base_url, timeout=60, follow_redirects=False)
    form = c.get("/console/sign-in")
    token = re.search(r'name="csrf_token" value="([^"]+)"', form.text)
    assert token is not None
    r = c.post("/console/sign-in", data={"api_key": api.keys["reviewer"],
                                         "csrf_token": token.group(1)})
    assert r.status_code == 303, r.text
    rid = records["sdk-half"].request_id
    page = c.get(f"/console/requests/{rid}")
    assert page.status_code == 200, page.text[-2000:]
    text = html.unescape(page.text)
    assert 'id="vendor-call"' in page.text and "tier semantic" in text
    assert '"return_token_ids": true' in text            # the request as sent
    with api.client("reviewer") as api_c:
        disputes = api_c.get("/v1/disputes", params={"request_id": rid}).json()["items"]
    (d,) = disputes
    verdict = c.get(f"/console/verdicts/{d['verdict_id']}")
    assert verdict.status_code == 200, verdict.text[-2000:]
    shown = html.unescape(verdict.text)
    assert 'id="semantic"' in verdict.text and f"0 of {SAMPLES}" in shown
    assert 'id="semantic-assertions"' in verdict.text and 'id="runtime-drift"' in verdict.text
    assert "Every token ID matched" not in shown and 'id="diff"' not in verdict.text
    c.close()


def test_a_dispute_brings_its_own_assertions(api: ApiServer, vendor_proxy: Process,
                                             engine_server: Process, tmp_path: Path) -> None:
    """Runs last (the pass rates above count three verdicts). The reviewer's set is signed
    into the dispute's opened event; the worker checks that signature and evaluates that
    set instead of the record's, and the verdict names the event."""
    from tests.helpers import signed, statement

    via = openai.OpenAI(base_url=vendor_proxy.base_url + "/v1", api_key="x", max_retries=0)
    body = _post(via, "chat", {"messages": CHAT, "max_tokens": 4, "temperature": 0.9},
                 f"reviewer-set-{uuid.uuid4().hex[:8]}")
    rid = json.loads(body)["id"]
    wait_for_envelope(api, rid)
    own = {"version": 1, "assertions": [
        {"id": "is-a-chat", "kind": "one_of", "select": {"path": "$.object"},
         "values": ["chat.completion"]},
        {"id": "same-kind", "kind": "same_decision", "select": {"path": "$.object"},
         "labels": {"chat": ["chat.completion"], "text": ["text_completion"]}}]}
    with api.client("reviewer") as c:
        bad = c.post("/v1/disputes", json={"request_id": rid, "reason": "r",
                                           "assertions": {"version": 1, "assertions": [
                                               {"id": "x", "kind": "equals",
                                                "select": {"path": "no-dollar"}}]}})
        assert bad.status_code == 422 and bad.json()["code"] == "invalid_assertions", bad.text
        v1 = signed(statement(), api.producer)  # type: ignore[attr-defined]
        with api.client("ingester") as ing:
            stored = ing.post("/v1/envelopes", json=v1, params={"wait": True})
        assert stored.status_code == 201, stored.text
        not_vendor = c.post("/v1/disputes", json={
            "request_id": stored.json()["request_id"], "reason": "r", "assertions": own})
        assert not_vendor.status_code == 422, not_vendor.text
        assert not_vendor.json()["code"] == "assertions_not_applicable"
        assert c.get("/v1/disputes", params={"request_id": rid}).json()["items"] == []
    key_file = tmp_path / "vendor.key"
    key_file.write_text(VENDOR_KEY)
    worker, _ = vendor_worker(api, engine_server.base_url, key_file)
    try:
        from ledger.db.models import DisputeEvent
        from ledger.db.session import session_scope

        with api.client("reviewer") as c:
            r = c.post("/v1/disputes", json={"request_id": rid, "reason": "its own set",
                                             "assertions": own})
            assert r.status_code == 201, r.text
            assert worker.run_job(r.json()["job_id"]) == "done"
            d = c.get(f"/v1/disputes/{r.json()['id']}").json()
        with session_scope(worker.db) as s:
            opened = s.scalar(select(DisputeEvent).where(
                DisputeEvent.dispute_id == uuid.UUID(d["id"]), DisputeEvent.kind == "opened"))
            assert opened is not None
            opened_ref = {"from": "dispute", "event_id": opened.event_id,
                          "log_index": opened.log_index}
        from ledger.db.models import Verdict
        from ledger.replay.views import verdict_view

        with session_scope(worker.db) as s:
            row = s.scalar(select(Verdict).where(Verdict.verdict_id == d["verdict_id"]))
            assert row is not None
            view = verdict_view(bytes(row.dsse))
    finally:
        worker.stop()
        worker.close()
        worker.db.dispose()
    sem = view["details"]["semantic"]
    assert sem["assertion_source"] == opened_ref
    assert sem["assertion_set"] == assertion_set_json(parse_assertion_set(own))
    assert (view["outcome"], view["tier"]) == ("reproduced", "semantic")
    assert sem["assertions"]["is-a-chat"]["passes"] == SAMPLES
    assert sem["assertions"]["same-kind"]["passes"] == SAMPLES   # same decision as recorded
