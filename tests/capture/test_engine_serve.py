"""``ledger engine serve``: vLLM's response shapes over real HTTP, streams that add up to
the whole answer, batching that changes nothing, and the text/stop-string rules."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.capture.conftest import Process
from workers.engine.api import GenerationResult, SamplingParams
from workers.serve import openai_api as oa
from workers.serve.tokenizer import ByteTokenizer

MODEL = "tiny-demo"


def post(server: Process, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60)


def stream_docs(server: Process, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = post(server, path, {**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e[len("data: "):]) for e in events[:-2]]


def test_completion_returns_token_ids_like_vllm(engine_server: Process) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0,
            "logprobs": 2, "return_token_ids": True}
    doc = post(engine_server, "/v1/completions", body, **{"X-Request-Id": "abc"}).json()
    assert doc["id"] == "cmpl-abc" and doc["object"] == "text_completion"
    (choice,) = doc["choices"]
    assert choice["prompt_token_ids"] == [256, *b"Hello"]
    assert len(choice["token_ids"]) == 5 and choice["finish_reason"] == "length"
    assert choice["text"] == ByteTokenizer().decode(choice["token_ids"])
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == 5 and all(1 <= len(t) <= 3 for t in lp["top_logprobs"])
    assert doc["usage"] == {"prompt_tokens": 6, "total_tokens": 11, "completion_tokens": 5,
                            "prompt_tokens_details": None}
    plain = post(engine_server, "/v1/completions", {**body, "return_token_ids": False,
                                                     "logprobs": None}).json()
    assert plain["choices"][0]["token_ids"] is None
    assert plain["choices"][0]["prompt_token_ids"] is None
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["text"] == choice["text"]


def test_streams_add_up_to_the_whole_answer(engine_server: Process) -> None:
    base = {"model": MODEL, "max_tokens": 9, "temperature": 0.8, "seed": 3,
            "return_token_ids": True}
    chat = {**base, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
            "top_logprobs": 2}
    whole = post(engine_server, "/v1/chat/completions", chat).json()
    docs = stream_docs(engine_server, "/v1/chat/completions",
                       {**chat, "stream_options": {"include_usage": True}})
    assert docs[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in d for d in docs[1:])
    tokens = [t for d in docs[1:-1] for t in d["choices"][0]["token_ids"]]
    text = "".join(d["choices"][0]["delta"].get("content", "") for d in docs[:-1])
    content = [c for d in docs[1:-1] for c in d["choices"][0]["logprobs"]["content"]]
    assert tokens == whole["choices"][0]["token_ids"]
    assert text == whole["choices"][0]["message"]["content"]
    assert content == whole["choices"][0]["logprobs"]["content"]
    assert docs[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert docs[-1]["choices"] == [] and docs[-1]["usage"]["completion_tokens"] == 9

    completion = {**base, "prompt": "Hi", "logprobs": 1}
    whole = post(engine_server, "/v1/completions", completion).json()["choices"][0]
    docs = stream_docs(engine_server, "/v1/completions", completion)
    assert docs[0]["choices"][0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all(d["choices"][0]["prompt_token_ids"] is None for d in docs[1:])
    assert [t for d in docs for t in d["choices"][0]["token_ids"]] == whole["token_ids"]
    assert "".join(d["choices"][0]["text"] for d in docs) == whole["text"]
    assert [x for d in docs for x in d["choices"][0]["logprobs"]["token_logprobs"]] == \
        whole["logprobs"]["token_logprobs"]


def test_concurrent_requests_get_the_same_answers_as_alone(engine_server: Process) -> None:
    bodies = [{"model": MODEL, "prompt": f"prompt number {i}" * (1 + i % 3),
               "max_tokens": 4 + i % 5, "temperature": 0.7, "seed": i, "logprobs": 0,
               "return_token_ids": True} for i in range(16)]

    def run(body: dict[str, Any]) -> Any:
        c = post(engine_server, "/v1/completions", body).json()["choices"][0]
        return c["token_ids"], c["logprobs"]["token_logprobs"]

    alone = [run(b) for b in bodies]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, bodies))
    assert together == alone


def test_a_stream_sends_each_token_as_it_is_made(engine_server: Process) -> None:
    """The first chunk comes while the request is still generating (long before the
    last), and a stream of two prompts, one ended by a stop string, adds up per choice to
    the whole answer (choices interleave as the engine makes them)."""
    import time

    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0.0, "stream": True}
    arrived: list[float] = []
    start = time.perf_counter()
    with httpx.stream("POST", engine_server.base_url + "/v1/completions", json=body,
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrived.append(time.perf_counter() - start)
    assert len(arrived) == 400
    assert arrived[0] < 0.5 * arrived[-1], (arrived[0], arrived[-1])

    two = {"model": MODEL, "prompt": ["Once upon", "Hello there"], "max_tokens": 24,
           "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, "logprobs": 1}
    whole = post(engine_server, "/v1/completions", two).json()["choices"]
    stop = whole[1]["text"][5:7]                   # ends choice 1 early in both answers
    two["stop"] = [stop]
    whole = post(engine_server, "/v1/completions", two).json()["choices"]
    assert whole[1]["finish_reason"] == "stop" and whole[1]["stop_reason"] == stop
    docs = stream_docs(engine_server, "/v1/completions", two)
    for i, choice in enumerate(whole):
        mine = [d["choices"][0] for d in docs if d["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + [
            choice["finish_reason"]]
        assert mine[-1]["stop_reason"] == choice["stop_reason"]


# Members, in order, that vLLM 0.25.0 writes (completion/protocol.py:520-594,
# chat_completion/protocol.py:58-166: bodies are ``model_dump()``, chunks
# ``model_dump_json(exclude_unset=True)``, the usage chunk also ``exclude_none=True``).
COMPLETION_KEYS = ["id", "object", "created", "model", "choices", "service_tier",
                   "system_fingerprint", "usage", "kv_transfer_params", "metrics"]
COMPLETION_CHOICE_KEYS = ["index", "text", "logprobs", "finish_reason", "stop_reason",
                          "token_ids", "prompt_logprobs", "prompt_token_ids", "routed_experts"]
CHAT_KEYS = ["id", "object", "created", "model", "choices", "service_tier",
             "system_fingerprint", "usage", "prompt_logprobs", "prompt_token_ids",
             "prompt_text", "kv_transfer_params", "metrics"]
CHAT_CHOICE_KEYS = ["index", "message", "logprobs", "finish_reason", "stop_reason",
                    "token_ids", "routed_experts"]
HEAD = ["id", "object", "created", "model", "choices"]


def test_members_and_fingerprint_are_vllms(engine_server: Process) -> None:
    base = {"model": MODEL, "max_tokens": 3, "temperature": 0}
    doc = post(engine_server, "/v1/completions", {**base, "prompt": "Hi"}).json()
    assert list(doc) == COMPLETION_KEYS and list(doc["choices"][0]) == COMPLETION_CHOICE_KEYS
    fp = doc["system_fingerprint"]
    assert fp.startswith("ledger-") and len(fp.rsplit("-", 1)[1]) == 8
    chat = {**base, "messages": [{"role": "user", "content": "Hi"}]}
    doc = post(engine_server, "/v1/chat/completions", chat).json()
    assert list(doc) == CHAT_KEYS and list(doc["choices"][0]) == CHAT_CHOICE_KEYS
    assert doc["system_fingerprint"] == fp and doc["prompt_text"] is None

    # the fingerprint rides on the last chunk, or on the usage chunk when there is one
    docs = stream_docs(engine_server, "/v1/chat/completions", chat)
    assert list(docs[0]) == [*HEAD, "prompt_token_ids", "prompt_text"]
    assert [list(d) for d in docs[1:-1]] == [HEAD] * (len(docs) - 2)
    assert list(docs[-1]) == [*HEAD, "system_fingerprint"] and docs[-1]["system_fingerprint"] == fp
    assert list(docs[-1]["choices"][0]) == ["index", "delta", "logprobs", "finish_reason",
                                            "stop_reason", "token_ids"]
    docs = stream_docs(engine_server, "/v1/completions",
                       {**base, "prompt": "Hi", "stream_options": {
                           "include_usage": True, "continuous_usage_stats": True}})
    assert [list(d) for d in docs[:-1]] == [[*HEAD, "usage"]] * (len(docs) - 1)
    assert docs[0]["usage"] == {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1}
    assert docs[-1] == {**{k: docs[0][k] for k in HEAD[:4]}, "choices": [],
                        "usage": {"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3},
                        "system_fingerprint": fp}
    # continuous usage stats only come with include_usage (serve/utils/api_utils.py:276-288)
    docs = stream_docs(engine_server, "/v1/completions",
                       {**base, "prompt": "Hi", "stream_options": {
                           "continuous_usage_stats": True}})
    assert all("usage" not in d for d in docs)


def test_chat_top_logprobs_list_the_sampled_token_first(engine_server: Process) -> None:
    """vLLM 0.25: the first k of {sampled token, best others} (vllm/logprobs.py:175-206,
    chat_completion/serving.py:1093-1115); the chosen token's ``bytes`` are its text's."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 12, "temperature": 1.5, "seed": 5, "logprobs": True,
            "top_logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = post(engine_server, "/v1/chat/completions", body).json()["choices"][0]
    for token, entry in zip(choice["token_ids"], choice["logprobs"]["content"], strict=True):
        assert entry["token"] == f"token_id:{token}" and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["bytes"] == list(ByteTokenizer().token_text(token).encode())
        assert entry["top_logprobs"][0]["bytes"] == list(entry["token"].encode())


def test_temperature_follows_vllms_bounds(engine_server: Process) -> None:
    """vLLM 0.25 runs (0, 0.01) at 0.01 and refuses more than 2 (sampling_params.py)."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 6, "seed": 1, "logprobs": 0}
    parsed = oa.parse_completion({**body, "temperature": 0.001}, served_model=MODEL,
                                 tokenizer=ByteTokenizer(), vocab_size=512, max_model_len=64)
    assert parsed.sampling[0].temperature == 0.01
    r = post(engine_server, "/v1/completions", {**body, "temperature": 2.5})
    assert r.status_code == 400 and "[0, 2]" in r.json()["error"]["message"]
    r = post(engine_server, "/v1/completions", {**body, "temperature": 0, "n": 2})
    assert r.json()["error"]["message"] == "n must be 1 when using greedy sampling, got 2."


@pytest.mark.parametrize(("path", "body", "status", "fragment"), [
    ("/v1/completions", {"prompt": "a", "n": 2}, 400, "`n`"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"1": 2}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "model": "other"}, 404, "does not exist"),
    ("/v1/completions", {"prompt": "a" * 1020, "max_tokens": 10}, 400, "context length"),
    ("/v1/completions", {"prompt": [300]}, 400, "token ids"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "top_logprobs": 2}, 400, "logprobs"),
])
def test_refusals_use_openai_error_bodies(engine_server: Process, path: str,
                                          body: dict[str, Any], status: int,
                                          fragment: str) -> None:
    r = post(engine_server, path, body)
    assert r.status_code == status
    error = r.json()["error"]
    assert fragment in error["message"] and error["code"] == status


# ------------------------------------------------------------------ text rules (no server)
def _choice(tokens: list[int], stop: list[str], include: bool = False,
            finish: str = "length") -> oa.ChoiceText:
    parsed = oa.Parsed(kind="completion", request_id="cmpl-x", model=MODEL, prompts=[[256]],
                       sampling=[SamplingParams(max_tokens=len(tokens))], stream=True,
                       stop=stop, include_stop_str=include)
    result = GenerationResult(id="x", token_ids=tokens, finish_reason=finish,
                              logprobs=[-1.0] * len(tokens), top_logprobs=None,
                              logits_sha256=[])
    return oa.finish_text(result, parsed.sampling[0], parsed, ByteTokenizer())


def test_incomplete_utf8_is_held_back_and_deltas_join_to_the_text() -> None:
    c = _choice([*"aé".encode(), 0xE2, 0x82, 0xAC, 0xFF], [])     # a, é, €, invalid byte
    assert c.text == "aé€\ufffd" and "".join(c.deltas) == c.text
    assert c.deltas == ["a", "", "é", "", "", "€", "\ufffd"]


def test_stop_string_truncates_text_and_tokens() -> None:
    c = _choice(list(b"abXYcd"), ["XY"])
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == ("ab", list(b"abXY"),
                                                                     "stop", "XY")
    assert c.deltas == ["", "a", "b", ""]       # one character held back: "XY" may start
    kept = _choice(list(b"abXYcd"), ["XY"], include=True)
    assert kept.text == "abXY"
    assert _choice(list(b"abc"), ["zz"]).finish_reason == "length"


def test_a_client_that_leaves_mid_stream_aborts_its_request() -> None:
    """In process (to see the batcher): a stream of 900 tokens whose client closes the
    connection after two chunks is aborted (its slot freed at its next token), long
    before it would have finished; the server goes on answering."""
    import threading
    import time

    import uvicorn

    from tests.helpers import free_port
    from workers.engine import load_engine
    from workers.serve.app import create_app

    app = create_app(load_engine("tiny-demo"), served_model_name=MODEL,
                     tokenizer=ByteTokenizer(), max_batch=2)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 900,
                "ignore_eos": True, "temperature": 0.0, "stream": True}
        batcher = app.state.batcher
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
        left = time.monotonic()
        while batcher.aborts < 1:
            assert time.monotonic() - left < 10, "the request was not aborted"
            time.sleep(0.01)
        # the abort is counted when the batcher takes it; the request leaves at its next
        # token, and is counted as finished after that step (checking at once raced it)
        steps = batcher.batches
        while batcher.requests < 1:
            assert time.monotonic() - left < 10, "the aborted request did not finish"
            time.sleep(0.01)
        assert batcher.requests == 1          # it finished: as aborted, not at 900 tokens
        assert batcher.batches - steps < 50, (steps, batcher.batches)
        short = httpx.post(url, json={**body, "stream": False, "max_tokens": 3}, timeout=60)
        assert short.status_code == 200 and short.json()["choices"][0]["text"]

        # a stop string ends a stream's text: its generation stops too (as vLLM's), and
        # the text is the whole answer's
        text = httpx.post(url, json={**body, "stream": False, "max_tokens": 12},
                          timeout=60).json()["choices"][0]["text"]
        stopped = {**body, "stop": [text[6:9]]}
        whole = httpx.post(url, json={**stopped, "stream": False}, timeout=120).json()
        assert whole["choices"][0]["finish_reason"] == "stop"
        before = batcher.aborts
        with httpx.stream("POST", url, json=stopped, timeout=60) as r:
            docs = [json.loads(line[6:]) for line in r.iter_lines()
                    if line.startswith("data: {")]
        assert "".join(d["choices"][0]["text"] for d in docs) == whole["choices"][0]["text"]
        assert docs[-1]["choices"][0]["finish_reason"] == "stop"
        assert batcher.aborts == before + 1
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.mark.parametrize("collect_less", [True, False])
def test_the_collector_is_tuned_while_the_engine_serves(collect_less: bool) -> None:
    """``ledger engine serve`` freezes what start-up made (model, framework, warm-up) and
    collects the young generation less often while it serves, as the ledger API does, and
    puts the collector back when it stops; ``collect_less=False`` leaves it alone."""
    import gc

    from starlette.testclient import TestClient

    from ledger.core.collector import YOUNG_COLLECTION_EVERY
    from workers.engine import load_engine
    from workers.serve.app import create_app

    before = gc.get_threshold()
    assert before[0] != YOUNG_COLLECTION_EVERY
    app = create_app(load_engine("tiny-demo"), served_model_name=MODEL,
                     tokenizer=ByteTokenizer(), max_batch=2, warm_up_len=64,
                     collect_less=collect_less)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once",
                                                 "max_tokens": 3, "temperature": 0.0})
        assert r.status_code == 200, r.text
        assert (gc.get_threshold()[0] == YOUNG_COLLECTION_EVERY) == collect_less
        assert (gc.get_freeze_count() > 0) == collect_less
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
