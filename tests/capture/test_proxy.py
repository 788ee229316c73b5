"""Acceptance 2: the official ``openai`` client through ``ledger proxy`` in front of
``ledger engine serve`` gets the upstream's bytes (completions, chat, streaming), and every
call yields one envelope whose prompt, sampling and output a reference-engine replay
reproduces bit for bit.

Byte comparison: each case is sent through the proxy, then directly to the upstream with
the same ``X-Request-Id`` (so the response ids agree) and, when the proxy chose the seed,
with that seed (read back from the envelope). The pair is re-sent if the two calls fell in
different seconds (``created`` is whole seconds).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest
from sqlalchemy import text as sa_text

from ledger.core.envelope import validate_statement
from tests.capture.conftest import CaptureFiles, Process, wait_for_envelope
from tests.helpers import ApiServer
from workers.engine.api import GenerationRequest, SamplingParams

MODEL = "tiny-demo"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]

# (name, endpoint, arguments); streaming is added per case below
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("greedy", "completions", {"prompt": "Hello", "max_tokens": 6, "temperature": 0}),
    ("sampled-no-seed", "completions", {"prompt": "Once upon", "max_tokens": 8,
                                        "temperature": 0.9, "top_p": 0.95,
                                        "extra_body": {"top_k": 40}}),
    ("client-logprobs-top-ids", "completions", {
        "prompt": [256, 1, 2, 3], "max_tokens": 5, "temperature": 0.7, "seed": 11,
        "logprobs": 3, "extra_body": {"return_tokens_as_token_ids": True}}),
    ("client-logprobs-text", "completions", {"prompt": "abc", "max_tokens": 4,
                                             "temperature": 0, "logprobs": 2}),
    ("client-token-ids", "completions", {"prompt": "xyz", "max_tokens": 3,
                                         "extra_body": {"return_token_ids": True}}),
    ("stop-string", "completions", {"prompt": "Hello", "max_tokens": 12, "temperature": 0,
                                    "stop": ["oo"]}),
    ("penalties", "completions", {"prompt": "aaaa", "max_tokens": 8, "temperature": 0.5,
                                  "presence_penalty": 0.5, "frequency_penalty": 0.3,
                                  "extra_body": {"repetition_penalty": 1.2, "min_p": 0.05}}),
    ("chat-greedy", "chat", {"messages": CHAT, "max_tokens": 6, "temperature": 0}),
    ("chat-sampled", "chat", {"messages": CHAT, "max_completion_tokens": 7,
                              "temperature": 1.1}),
    ("chat-logprobs", "chat", {"messages": CHAT, "max_tokens": 5, "temperature": 0,
                               "logprobs": True, "top_logprobs": 2,
                               "extra_body": {"return_tokens_as_token_ids": True}}),
    # tiny-demo answers CHAT greedily with "ggg...": token 103 ends it at once
    ("chat-no-max-tokens", "chat", {"messages": CHAT, "temperature": 0,
                                    "extra_body": {"stop_token_ids": [50, 103]}}),
    ("chat-usage", "chat", {"messages": CHAT, "max_tokens": 4, "temperature": 0,
                            "_usage": True}),
    ("completion-usage", "completions", {"prompt": "b", "max_tokens": 3,
                                         "_usage": True}),
]


def _call(client: openai.OpenAI, endpoint: str, args: dict[str, Any], stream: bool,
          request_id: str, model: str = MODEL) -> bytes:
    resource = client.completions if endpoint == "completions" else client.chat.completions
    kwargs = {k: v for k, v in args.items() if not k.startswith("_")}
    kwargs |= {"model": model, "extra_headers": {"X-Request-Id": request_id}}
    if stream:
        kwargs["stream"] = True
        if args.get("_usage"):
            kwargs["stream_options"] = {"include_usage": True}
        with resource.with_streaming_response.create(**kwargs) as response:
            assert response.http_response.status_code == 200
            return b"".join(response.iter_bytes())
    raw = resource.with_raw_response.create(**kwargs)
    assert raw.http_response.status_code == 200, raw.http_response.text
    return bytes(raw.http_response.content)


def _created(body: bytes) -> set[int]:
    text = body.decode()
    docs = [json.loads(line[6:]) for line in text.split("\n")
            if line.startswith("data: {")] if text.startswith("data:") else [json.loads(text)]
    return {d["created"] for d in docs}


def _response_id(endpoint: str, request_id: str) -> str:
    return ("cmpl-" if endpoint == "completions" else "chatcmpl-") + request_id


@pytest.fixture(scope="module")
def clients(proxy_server: Process, engine_server: Process) -> tuple[openai.OpenAI,
                                                                     openai.OpenAI]:
    via = openai.OpenAI(base_url=proxy_server.base_url + "/v1", api_key="unused",
                        max_retries=0)
    direct = openai.OpenAI(base_url=engine_server.base_url + "/v1", api_key="unused",
                           max_retries=0)
    return via, direct


@pytest.fixture(scope="module")
def reference() -> Any:
    from workers.engine import load_engine

    return load_engine("tiny-demo")


def replay(engine: Any, statement: dict[str, Any]) -> Any:
    p = statement["predicate"]
    request = GenerationRequest(id="replay", prompt_token_ids=tuple(p["prompt_token_ids"]),
                                sampling=SamplingParams.from_mapping(p["sampling"]))
    (result,) = engine.generate([request], max_batch=1)
    return result


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
@pytest.mark.parametrize(("name", "endpoint", "args"), CASES, ids=[c[0] for c in CASES])
def test_proxy_is_transparent_and_records_a_replayable_envelope(
    clients: tuple[openai.OpenAI, openai.OpenAI], api: ApiServer, reference: Any,
    capture_files: CaptureFiles, name: str, endpoint: str, args: dict[str, Any],
    stream: bool,
) -> None:
    via, direct = clients
    for _attempt in range(3):
        request_id = f"{name}-{uuid.uuid4().hex[:12]}"
        while time.time() % 1 > 0.7:          # keep both calls inside one second
            time.sleep(0.05)
        through_proxy = _call(via, endpoint, args, stream, request_id)
        statement = wait_for_envelope(api, _response_id(endpoint, request_id))
        direct_args = dict(args)
        if "seed" not in args:                # the proxy chose one: ask the upstream for it
            direct_args["seed"] = statement["predicate"]["sampling"]["seed"]
        upstream = _call(direct, endpoint, direct_args, stream, request_id)
        if _created(through_proxy) == _created(upstream):
            break
    assert through_proxy == upstream

    # the envelope is valid, names this call, and says what ran
    validate_statement(statement)
    p = statement["predicate"]
    assert p["request_id"] == _response_id(endpoint, request_id)
    assert p["artifacts"] == capture_files.artifacts_doc
    assert p["channel"] == "deterministic" and p["tier"] == "bitwise"
    assert p["sampling"]["seed"] == args.get("seed", p["sampling"]["seed"])
    assert isinstance(p["sampling"]["seed"], int)
    if "temperature" in args:
        assert p["sampling"]["temperature"] == args["temperature"]

    # a replay on the reference engine reproduces the recorded output bit for bit
    result = replay(reference, statement)
    out = p["output"]
    assert result.token_ids == out["token_ids"]
    assert result.finish_reason == out["finish_reason"]
    assert result.logprobs == out["logprobs"]          # float equality: exact bits
    if args.get("extra_body", {}).get("return_tokens_as_token_ids") and (
            args.get("logprobs") if endpoint == "completions" else args.get("top_logprobs")):
        k = p["sampling"]["logprobs"]
        assert k == (args["logprobs"] if endpoint == "completions" else args["top_logprobs"])
        assert out["top_logprobs"] == [[{"token_id": t, "logprob": lp} for t, lp in step[:k]]
                                       for step in result.top_logprobs]
    else:
        assert "top_logprobs" not in out and p["sampling"]["logprobs"] == 0


def test_stop_string_records_the_replayable_prefix(
    clients: tuple[openai.OpenAI, openai.OpenAI], api: ApiServer, reference: Any,
) -> None:
    via, _ = clients
    request_id = f"stop-{uuid.uuid4().hex[:12]}"
    completion = via.completions.create(model=MODEL, prompt="Hello", max_tokens=12,
                                        temperature=0, stop=["oo"],
                                        extra_headers={"X-Request-Id": request_id})
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and choice.text == ""    # tiny-demo says "ooo..."
    p = wait_for_envelope(api, "cmpl-" + request_id)["predicate"]
    assert p["output"]["token_ids"] == [111, 111]          # "o", "o": completes the stop
    assert p["sampling"]["max_tokens"] == 2 and p["output"]["finish_reason"] == "length"
    assert replay(reference, {"predicate": p}).token_ids == [111, 111]


def test_unrecordable_request_is_forwarded_unchanged_and_counted(
    clients: tuple[openai.OpenAI, openai.OpenAI], proxy_server: Process,
) -> None:
    import httpx

    via, _ = clients
    before = httpx.get(proxy_server.base_url + "/ledger/capture/status").json()
    # the upstream's own refusal: vLLM 0.25 runs n=2 when sampling and refuses it only
    # when greedy (vllm/sampling_params.py:623-625); ledger engine serve says the same
    with pytest.raises(openai.BadRequestError) as info:
        via.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=2, temperature=0)
    assert "n must be 1 when using greedy sampling" in str(info.value)
    after = httpx.get(proxy_server.base_url + "/ledger/capture/status").json()
    assert after["unrecordable"] == before["unrecordable"] + 1
    assert any("`n`" in reason for reason in after["unrecordable_reasons"])


def test_other_paths_pass_through(clients: tuple[openai.OpenAI, openai.OpenAI]) -> None:
    via, direct = clients
    assert [m.id for m in via.models.list()] == [m.id for m in direct.models.list()] == [MODEL]


def test_full_spool_fails_closed_and_strict_refuses_unrecordable(
    engine_server: Process, capture_files: CaptureFiles, tmp_path: Any,
) -> None:
    """A 1-byte quota: the first call is served and recorded, then the proxy answers 503
    (before the model runs) until the ledger has taken the spool; ``--strict`` refuses
    what it could not record. The ledger URL is unreachable here on purpose."""
    from tests.capture.conftest import proxy_args, run_process
    from tests.helpers import free_port

    port = free_port()
    args = proxy_args(capture_files, engine_server.base_url, port, tmp_path / "spool",
                      "--spool-max-bytes", "1", "--strict")
    with run_process(args, health_path="/ledger/capture/status", port=port,
                     log_path=tmp_path / "proxy.log",
                     env={"LEDGER_API_URL": "http://127.0.0.1:9", "LEDGER_API_KEY": "x"}) as p:
        client = openai.OpenAI(base_url=p.base_url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="cannot record"):
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=2)
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        deadline = time.monotonic() + 10
        while True:                       # the envelope reaches the spool: it is full
            try:
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            except openai.InternalServerError as exc:
                assert exc.status_code == 503 and "spool" in str(exc)
                assert exc.response.headers["retry-after"] == "5"
                break
            assert time.monotonic() < deadline, "the spool never filled up"
            time.sleep(0.05)


def test_every_proxied_call_is_disputed_and_reproduced(api: ApiServer, tmp_path: Path) -> None:
    """Issue 6, acceptance 2: each call made through the proxy in this module is an
    envelope whose dispute ends ``reproduced`` at the bitwise tier (replayed by a worker
    holding tiny-demo, with the same runtime as `ledger engine serve`)."""
    from ledger.core.keys import generate_private_key
    from ledger.db.session import make_engine, session_scope
    from ledger.replay.records import Signer
    from ledger.settings import Settings
    from workers.replay import ReplayWorker

    settings = Settings(database_url=api.db_url)  # type: ignore[attr-defined]
    db = make_engine(settings, pool_size=2)
    signer = Signer(generate_private_key(), "worker", "capture-test-worker")
    with session_scope(db) as s:
        signer.ensure_registered(s)
        request_ids = [r[0] for r in s.execute(sa_text(
            "SELECT request_id FROM envelopes WHERE request_id LIKE 'cmpl-%' "
            "OR request_id LIKE 'chatcmpl-%' ORDER BY log_index"))]
    assert len(request_ids) >= len(CASES) * 2
    # The `api` fixture provisions keys without registry leaves and writes no trust
    # policy; this test is about capture -> replay, so the worker trusts the database's own
    # keys (the trust-policy paths are tests/replay/test_replay_trust.py's).
    worker = ReplayWorker(settings, db, models=["tiny-demo"], signer=signer, insecure_dev=True)
    worker.register()
    verdicts = {}
    with api.client("reviewer") as c:
        for rid in request_ids:
            r = c.post("/v1/disputes", json={"request_id": rid, "reason": "capture check"})
            assert r.status_code == 201, r.text
            assert r.json()["state"] == "queued", r.json()  # the worker's fingerprint matches
            assert worker.run_job(r.json()["job_id"]) == "done"
            d = c.get(f"/v1/disputes/{r.json()['id']}").json()
            verdicts[rid] = (d["state"], d["verdict"]["outcome"], d["verdict"]["tier"])
    worker.stop()
    db.dispose()
    assert set(verdicts.values()) == {("verdict", "reproduced", "bitwise")}, verdicts
