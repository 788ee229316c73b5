"""The pure part of capture: request rewriting, byte-preserving response edits, stream
reassembly at any split, and what is recorded (no servers)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.capture import jsonedit
from ledger.capture.exchange import SamplingDefaults, StreamEditor, edit_response, prepare


def _prepare(kind: str, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    sent, plan = prepare(kind, json.dumps(body).encode(), new_seed=lambda: 424242)
    return json.loads(sent), plan


def test_prepare_adds_token_ids_logprobs_seed_and_explicit_sampling() -> None:
    sent, plan = _prepare("completion", {"model": "m", "prompt": "hi", "max_tokens": 5})
    assert sent["return_token_ids"] is True and sent["logprobs"] == 0
    assert sent["seed"] == 424242 and plan.seed_added
    assert {k: sent[k] for k in ("temperature", "top_p", "top_k", "min_p")} == {
        "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
    assert plan.added_token_ids and plan.added_logprobs and plan.requested_max_tokens == 5
    assert plan.sampling["seed"] == 424242 and plan.sampling["stop_token_ids"] == []


def test_prepare_keeps_what_the_caller_set() -> None:
    sent, plan = _prepare("chat", {
        "messages": [{"role": "user", "content": "x"}], "seed": 9, "temperature": 0.3,
        "logprobs": True, "top_logprobs": 4, "return_token_ids": True,
        "return_tokens_as_token_ids": True, "max_completion_tokens": 7})
    assert sent["seed"] == 9 and not plan.seed_added and sent["temperature"] == 0.3
    assert not plan.added_token_ids and not plan.added_logprobs
    assert plan.top_k == 4 and plan.top_ids and plan.requested_max_tokens == 7


def test_sampling_defaults_mirror_a_generation_config() -> None:
    defaults = SamplingDefaults.from_mapping({"temperature": 0.6, "top_p": 0.9})
    sent, plan = prepare("completion", b'{"prompt": "a"}', defaults)
    assert json.loads(sent)["temperature"] == 0.6 and plan.sampling["top_p"] == 0.9
    with pytest.raises(ValueError, match="unknown"):
        SamplingDefaults.from_mapping({"temprature": 1})


@pytest.mark.parametrize(("kind", "extra", "reason"), [
    ("completion", {"n": 2}, "`n`"),
    ("completion", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("completion", {"min_tokens": 3}, "min_tokens"),
    ("completion", {"echo": True}, "echo"),
    ("completion", {"seed": -1}, "seed"),
    ("completion", {"seed": 2**53}, "seed"),
    ("completion", {"temperature": "hot"}, "temperature"),
    ("completion", {"brand_new_sampler": 1}, "unknown parameter"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "non-text"),
])
def test_unrecordable_requests_pass_untouched(kind: str, extra: dict[str, Any],
                                              reason: str) -> None:
    body = {"prompt": "a"} if kind == "completion" else {
        "messages": [{"role": "user", "content": "a"}]}
    raw = json.dumps({**body, **extra}).encode()
    sent, plan = prepare(kind, raw)
    assert sent == raw and not plan.recordable and reason in (plan.unrecordable or "")


def test_neutral_values_stay_recordable() -> None:
    _, plan = _prepare("chat", {"messages": [{"role": "user", "content": "a"}], "n": 1,
                                "logit_bias": {}, "response_format": {"type": "text"},
                                "tools": [], "min_tokens": 0})
    assert plan.recordable


# ------------------------------------------------------------------ whole bodies
UPSTREAM = (
    '{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
    '"text":"h\\u00e9 \\"x\\"","logprobs":{"text_offset":[0,1],"token_logprobs":'
    '[-0.25,-1.0000000000000002e-07],"tokens":["token_id:104","token_id:233"],'
    '"top_logprobs":[{"token_id:104":-0.25,"token_id:7":-2.5},{"token_id:233":'
    '-1.0000000000000002e-07}]},"finish_reason":"length","stop_reason":null,'
    '"token_ids":[104,233],"prompt_logprobs":null,"prompt_token_ids":[256,1]}],'
    '"usage":{"prompt_tokens":2,"total_tokens":4,"completion_tokens":2}}')


def test_edit_response_nulls_only_the_added_members_byte_for_byte() -> None:
    _, plan = _prepare("completion", {"prompt": "x", "max_tokens": 2})
    edited, captured = edit_response(plan, UPSTREAM.encode())
    expected = (UPSTREAM.replace('"token_ids":[104,233]', '"token_ids":null')
                .replace('"prompt_token_ids":[256,1]', '"prompt_token_ids":null'))
    start = expected.index('"logprobs":{') + len('"logprobs":')
    end = expected.index(',"finish_reason"')
    expected = expected[:start] + "null" + expected[end:]
    assert edited.decode() == expected
    (c,) = captured
    assert c.request_id == "cmpl-1" and c.prompt_token_ids == [256, 1]
    assert c.token_ids == [104, 233] and c.logprobs == [-0.25, -1.0000000000000002e-07]
    assert c.top_logprobs is None and c.sampling["logprobs"] == 0
    assert c.sampling["max_tokens"] == 2 and c.finish_reason == "length"


def test_caller_asked_for_everything_gets_the_upstream_bytes_verbatim() -> None:
    _, plan = _prepare("completion", {"prompt": "x", "logprobs": 1, "return_token_ids": True,
                                      "return_tokens_as_token_ids": True})
    edited, (c,) = edit_response(plan, UPSTREAM.encode())
    assert edited == UPSTREAM.encode()
    # the sampled token and the top-1 agree: one alternative recorded, best first
    assert c.top_logprobs == [[(104, -0.25)], [(233, -1.0000000000000002e-07)]]
    assert c.sampling["logprobs"] == 1


def test_stop_string_records_the_tightest_contract() -> None:
    body = json.loads(UPSTREAM)
    body["choices"][0] |= {"finish_reason": "stop", "stop_reason": "\n"}
    _, plan = _prepare("completion", {"prompt": "x", "max_tokens": 50, "stop": ["\n"]})
    _, (c,) = edit_response(plan, json.dumps(body).encode())
    assert c.stop_string and c.finish_reason == "length" and c.sampling["max_tokens"] == 2
    body["choices"][0] |= {"finish_reason": "stop", "stop_reason": None}     # EOS
    _, (c,) = edit_response(plan, json.dumps(body).encode())
    assert not c.stop_string and c.finish_reason == "stop" and c.sampling["max_tokens"] == 50


def test_clamped_logprobs_are_not_recorded_as_values() -> None:
    body = json.loads(UPSTREAM)
    body["choices"][0]["logprobs"]["token_logprobs"][1] = -9999.0
    _, plan = _prepare("completion", {"prompt": "x"})
    _, (c,) = edit_response(plan, json.dumps(body).encode())
    assert c.logprobs is None and c.sampling["logprobs"] is None


def test_not_json_passes_through_and_records_nothing() -> None:
    _, plan = _prepare("completion", {"prompt": "x"})
    assert edit_response(plan, b"<html>oops</html>") == (b"<html>oops</html>", [])


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(max_size=5), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                                                          allow_infinity=False)
    | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8), max_size=6),
       st.sampled_from([(",", ":"), (", ", ": ")]), st.booleans())
def test_scan_and_null_values_touch_nothing_else(doc: dict[str, Any],
                                                 separators: tuple[str, str],
                                                 ascii_only: bool) -> None:
    text = json.dumps({**doc, "choices": [doc, {"x": doc}]}, separators=separators,
                      ensure_ascii=ascii_only)
    scanned = jsonedit.scan(text)
    assert {k: m.value for k, m in scanned.members.items() if k != "choices"} == \
        {k: v for k, v in json.loads(text).items() if k != "choices"}
    targets = [m for m in scanned.choices[0].values()][:2]
    edited = jsonedit.null_values(text, targets)
    expected = json.loads(text)
    for m in targets:
        expected["choices"][0][m.key] = None
    assert json.loads(edited) == expected
    untouched = [m for m in scanned.members.values() if m.key != "choices"]
    for m in untouched:          # members before the choices keep their exact text
        if m.end <= scanned.members["choices"].start:
            assert edited[m.start:m.end] == text[m.start:m.end]


# ------------------------------------------------------------------ streams
def _chat_stream() -> bytes:
    head = '"id":"chatcmpl-9","object":"chat.completion.chunk","created":5,"model":"m"'
    events = [
        '{' + head + ',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        '"logprobs":null,"finish_reason":null}],"prompt_token_ids":[256,7,8]}',
        '{' + head + ',"choices":[{"index":0,"delta":{"content":"\\u00e9"},"logprobs":'
        '{"content":[{"token":"\\u00e9","logprob":-0.5,"bytes":[195,169],"top_logprobs":[]}]},'
        '"finish_reason":null,"token_ids":[195]}]}',
        '{' + head + ',"choices":[{"index":0,"delta":{},"logprobs":{"content":[{"token":"",'
        '"logprob":-0.125,"bytes":[],"top_logprobs":[]}]},"finish_reason":null,'
        '"token_ids":[169]}]}',
        '{' + head + ',"choices":[{"index":0,"delta":{"content":"!"},"logprobs":{"content":'
        '[{"token":"!","logprob":-1.5,"bytes":[33],"top_logprobs":[]}]},"finish_reason":'
        '"stop","stop_reason":null,"token_ids":[257]}]}',
    ]
    return "".join(f"data: {e}\n\n" for e in events).encode() + b"data: [DONE]\n\n"


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(_chat_stream()) - 1), max_size=12))
def test_stream_edits_are_the_same_at_any_split(cuts: list[int]) -> None:
    _, plan = _prepare("chat", {"messages": [{"role": "user", "content": "a"}],
                                "max_tokens": 8})
    data = _chat_stream()
    editor = StreamEditor(plan)
    out = b""
    last = 0
    for cut in sorted(set(cuts)):
        out += editor.feed(data[last:cut])
        last = cut
    out += editor.feed(data[last:]) + editor.finish()
    assert out == _chat_stream_without_added_fields()
    (c,) = editor.captured()
    assert c.request_id == "chatcmpl-9" and c.prompt_token_ids == [256, 7, 8]
    assert c.token_ids == [195, 169, 257] and c.logprobs == [-0.5, -0.125, -1.5]
    assert c.finish_reason == "stop" and c.sampling["max_tokens"] == 8


def _chat_stream_without_added_fields() -> bytes:
    """The expected bytes, derived by text substitution (not re-serialisation)."""
    text = _chat_stream().decode()
    events = text.split("\n\n")
    kept = []
    for e in events:
        if '"delta":{}' in e:
            continue
        e = e.replace('"prompt_token_ids":[256,7,8]', '"prompt_token_ids":null')
        for ids in ("[195]", "[169]", "[257]"):
            e = e.replace(f'"token_ids":{ids}', '"token_ids":null')
        if '"logprobs":{' in e:
            start = e.index('"logprobs":{') + len('"logprobs":')
            end = e.index(',"finish_reason"')
            e = e[:start] + "null" + e[end:]
        kept.append(e)
    return "\n\n".join(kept).encode()


def test_incomplete_stream_records_nothing() -> None:
    _, plan = _prepare("chat", {"messages": [{"role": "user", "content": "a"}]})
    editor = StreamEditor(plan)
    data = _chat_stream()
    editor.feed(data[: data.index(b'"finish_reason":"stop"')])
    editor.finish()
    assert not editor.done and editor.captured() == []


# ------------------------------------------------------------------ vLLM 0.25.0's own bytes
# Byte strings as vLLM 0.25.0 writes them (read from its wheel's source):
# - whole bodies: ``JSONResponse(content=response.model_dump())`` (completion/api_router.py:
#   60-64, chat_completion/api_router.py:68-72): every field in declaration order, ``null``
#   included (completion/protocol.py:520-562, chat_completion/protocol.py:58-137), compact,
#   Python's float text;
# - stream chunks: ``chunk.model_dump_json(exclude_unset=True)`` (completion/serving.py:440,
#   chat_completion/serving.py:525,743): only members the server set (to ``None`` too),
#   pydantic's float text (``-1e-7``, ``0.00001``); the usage chunk adds
#   ``exclude_none=True`` (completion/serving.py:483-485, chat_completion/serving.py:786-788);
# - ``system_fingerprint`` (default ``--fingerprint-mode full``: ``vllm-<version>-<hash8>``,
#   serve/utils/fingerprint.py) in every body, on the last chunk with a ``finish_reason``
#   when no usage chunk follows (chat_completion/serving.py:723-732), else on the usage chunk.
FP = "vllm-0.25.0-1a2b3c4d"
VLLM_COMPLETION = (
    '{"id":"cmpl-rq","object":"text_completion","created":1764590000,"model":"tiny-demo",'
    '"choices":[{"index":0,"text":" w\u00f6","logprobs":{"text_offset":[0,13],'
    '"token_logprobs":[-0.6931471805599453,-1.0000000000000002e-07],'
    '"tokens":["token_id:1917","token_id:269"],"top_logprobs":[{"token_id:1917":'
    '-0.6931471805599453},{"token_id:269":-1.0000000000000002e-07}]},"finish_reason":"length",'
    '"stop_reason":null,"token_ids":[1917,269],"prompt_logprobs":null,'
    '"prompt_token_ids":[128000,9906],"routed_experts":null}],"service_tier":null,'
    f'"system_fingerprint":"{FP}","usage":{{"prompt_tokens":2,"total_tokens":4,'
    '"completion_tokens":2,"prompt_tokens_details":null},"kv_transfer_params":null,'
    '"metrics":null}')
VLLM_CHAT = (
    '{"id":"chatcmpl-rq","object":"chat.completion","created":1764590000,"model":"tiny-demo",'
    '"choices":[{"index":0,"message":{"role":"assistant","content":"Hi","refusal":null,'
    '"annotations":null,"audio":null,"function_call":null,"reasoning":null},"logprobs":'
    '{"content":[{"token":"token_id:13347","logprob":-0.25,"bytes":[72,105],'
    '"top_logprobs":[]},{"token":"token_id:128009","logprob":-1.5,"bytes":[60,124,101,111,'
    '116,95,105,100,124,62],"top_logprobs":[]}]},"finish_reason":"stop","stop_reason":null,'
    '"token_ids":[13347,128009],"routed_experts":null}],"service_tier":null,'
    f'"system_fingerprint":"{FP}","usage":{{"prompt_tokens":3,"total_tokens":5,'
    '"completion_tokens":2,"prompt_tokens_details":null},"prompt_logprobs":null,'
    '"prompt_token_ids":[128000,9906,271],"prompt_text":null,"kv_transfer_params":null,'
    '"metrics":null}')


def _null_logprobs(text: str) -> str:
    """``text`` with every ``"logprobs":{...}`` value replaced by ``null`` (bracket match)."""
    out, pos = [], 0
    while (at := text.find('"logprobs":{', pos)) >= 0:
        start = at + len('"logprobs":')
        depth, end = 0, start
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                break
        out += [text[pos:start], "null"]
        pos = end + 1
    return "".join(out) + text[pos:]


def test_vllm_completion_body_gets_back_its_unasked_bytes() -> None:
    sent, plan = _prepare("completion", {"prompt": "Hello", "max_tokens": 2})
    assert sent["return_tokens_as_token_ids"] is True     # only the proxy reads those names
    edited, (c,) = edit_response(plan, VLLM_COMPLETION.encode())
    expected = _null_logprobs(VLLM_COMPLETION.replace('"token_ids":[1917,269]',
                                                      '"token_ids":null').replace(
        '"prompt_token_ids":[128000,9906]', '"prompt_token_ids":null'))
    assert edited.decode() == expected and '"routed_experts":null' in expected
    assert c.request_id == "cmpl-rq" and c.prompt_token_ids == [128000, 9906]
    assert c.token_ids == [1917, 269] and c.logprobs == [-0.6931471805599453,
                                                         -1.0000000000000002e-07]


def test_vllm_chat_body_gets_back_its_unasked_bytes() -> None:
    _, plan = _prepare("chat", {"messages": [{"role": "user", "content": "a"}]})
    edited, (c,) = edit_response(plan, VLLM_CHAT.encode())
    expected = _null_logprobs(VLLM_CHAT.replace('"token_ids":[13347,128009]',
                                                '"token_ids":null').replace(
        '"prompt_token_ids":[128000,9906,271]', '"prompt_token_ids":null'))
    assert edited.decode() == expected and '"prompt_text":null' in expected
    # EOS ends the output and is in token_ids (vLLM: v1/engine/detokenizer.py:107-126
    # keeps a stop-terminating token in the ids and out of the text)
    assert c.token_ids == [13347, 128009] and c.finish_reason == "stop"
    assert c.prompt_token_ids == [128000, 9906, 271] and c.logprobs == [-0.25, -1.5]


def _vllm_chat_stream(usage: bool) -> bytes:
    head = '"id":"chatcmpl-s","object":"chat.completion.chunk","created":7,"model":"tiny-demo"'
    events = [
        # first chunk: prompt_token_ids and prompt_text are set (to None when unasked)
        '{' + head + ',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        '"logprobs":null,"finish_reason":null}],"prompt_token_ids":[128000,9906],'
        '"prompt_text":null}',
        '{' + head + ',"choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":{"content":'
        '[{"token":"token_id:13347","logprob":-0.00001,"bytes":[72,105],"top_logprobs":[]}]},'
        '"finish_reason":null,"token_ids":[13347]}]}',
        '{' + head + ',"choices":[{"index":0,"delta":{"content":""},"logprobs":{"content":'
        '[{"token":"token_id:128009","logprob":-1.0000000000000002e-7,"bytes":[60,47,115,62],'
        '"top_logprobs":[]}]},"finish_reason":"stop","stop_reason":null,"token_ids":[128009]}]'
        + ('' if usage else f',"system_fingerprint":"{FP}"') + '}',
    ]
    if usage:
        events.append('{' + head + ',"choices":[],"usage":{"prompt_tokens":2,"total_tokens":4,'
                      f'"completion_tokens":2}},"system_fingerprint":"{FP}"}}')
    return "".join(f"data: {e}\n\n" for e in events).encode() + b"data: [DONE]\n\n"


@pytest.mark.parametrize("usage", [False, True], ids=["plain", "usage"])
def test_vllm_chat_stream_gets_back_its_unasked_bytes(usage: bool) -> None:
    _, plan = _prepare("chat", {"messages": [{"role": "user", "content": "a"}],
                                "max_tokens": 5, "stream": True})
    data = _vllm_chat_stream(usage)
    editor = StreamEditor(plan)
    out = b"".join(editor.feed(data[i:i + 37]) for i in range(0, len(data), 37))
    out += editor.finish()
    expected = _null_logprobs(data.decode().replace('"prompt_token_ids":[128000,9906]',
                                                    '"prompt_token_ids":null'))
    for ids in ("[13347]", "[128009]"):
        expected = expected.replace(f'"token_ids":{ids}', '"token_ids":null')
    assert out.decode() == expected and editor.done
    (c,) = editor.captured()
    assert c.request_id == "chatcmpl-s" and c.prompt_token_ids == [128000, 9906]
    assert c.token_ids == [13347, 128009] and c.logprobs == [-0.00001, -1.0000000000000002e-7]
    assert c.finish_reason == "stop" and c.sampling["max_tokens"] == 5


def test_vllm_completion_stream_with_continuous_usage() -> None:
    head = '"id":"cmpl-s","object":"text_completion","created":7,"model":"tiny-demo"'

    def chunk(text: str, lp: str, finish: str, prompt: str, ids: str, done: int) -> str:
        return ('{' + head + f',"choices":[{{"index":0,"text":"{text}","logprobs":{lp},'
                f'"finish_reason":{finish},"stop_reason":null,"prompt_token_ids":{prompt},'
                f'"token_ids":{ids}}}],"usage":{{"prompt_tokens":2,"total_tokens":{2 + done},'
                f'"completion_tokens":{done}}}}}')

    lp1 = ('{"text_offset":[0],"token_logprobs":[-0.5],"tokens":["token_id:72"],'
           '"top_logprobs":[{"token_id:72":-0.5}]}')
    lp2 = ('{"text_offset":[11],"token_logprobs":[-2.5e-8],"tokens":["token_id:105"],'
           '"top_logprobs":[{"token_id:105":-2.5e-8}]}')
    events = [chunk("H", lp1, "null", "[128000,9906]", "[72]", 1),
              chunk("i", lp2, '"length"', "null", "[105]", 2),
              '{' + head + ',"choices":[],"usage":{"prompt_tokens":2,"total_tokens":4,'
              f'"completion_tokens":2}},"system_fingerprint":"{FP}"}}']
    data = "".join(f"data: {e}\n\n" for e in events).encode() + b"data: [DONE]\n\n"
    _, plan = _prepare("completion", {"prompt": "Hello", "max_tokens": 2, "stream": True,
                                      "stream_options": {"include_usage": True,
                                                         "continuous_usage_stats": True}})
    editor = StreamEditor(plan)
    out = editor.feed(data) + editor.finish()
    expected = _null_logprobs(data.decode().replace("[128000,9906]", "null").replace(
        '"token_ids":[72]', '"token_ids":null').replace('"token_ids":[105]',
                                                        '"token_ids":null'))
    assert out.decode() == expected
    (c,) = editor.captured()
    assert c.token_ids == [72, 105] and c.logprobs == [-0.5, -2.5e-8]
    assert c.prompt_token_ids == [128000, 9906] and c.finish_reason == "length"


def test_chunk_sent_only_for_token_ids_is_dropped_even_when_logprobs_were_asked() -> None:
    """With a tool/reasoning parser holding text back, vLLM 0.25 sends a chunk with an
    empty delta only when ``return_token_ids`` is on (chat_completion/serving.py:632-640)."""
    head = '"id":"chatcmpl-p","object":"chat.completion.chunk","created":7,"model":"m"'
    held = ('{' + head + ',"choices":[{"index":0,"delta":{},"logprobs":{"content":[{"token":'
            '"<","logprob":-0.5,"bytes":[60],"top_logprobs":[]}]},"finish_reason":null,'
            '"token_ids":[27]}]}')
    _, plan = _prepare("chat", {"messages": [{"role": "user", "content": "a"}],
                                "logprobs": True})
    editor = StreamEditor(plan)
    assert editor.feed(f"data: {held}\n\n".encode()) == b""


def _chat_top_body(steps: list[tuple[int, float, list[tuple[int, float]]]]) -> bytes:
    content = [{"token": f"token_id:{t}", "logprob": lp, "bytes": [],
                "top_logprobs": [{"token": f"token_id:{a}", "logprob": alp, "bytes": []}
                                 for a, alp in tops]} for t, lp, tops in steps]
    return json.dumps({"id": "chatcmpl-t", "choices": [{
        "index": 0, "logprobs": {"content": content}, "finish_reason": "length",
        "stop_reason": None, "token_ids": [t for t, _, _ in steps]}],
        "prompt_token_ids": [1, 2]}).encode()


def test_chat_top_logprobs_are_recorded_only_when_they_are_the_top_k() -> None:
    """vLLM 0.25 lists the sampled token first, then the best others, k in all
    (vllm/logprobs.py:175-206; chat_completion/serving.py:1093-1115)."""
    asked = {"messages": [{"role": "user", "content": "a"}], "logprobs": True,
             "top_logprobs": 3, "return_tokens_as_token_ids": True, "temperature": 0.8}
    _, plan = _prepare("chat", asked)
    exact = [(5, -0.1, [(5, -0.1), (7, -2.0), (2, -2.5)]),   # the sampled token ranks 1
             (9, -1.0, [(9, -1.0), (4, -0.5), (6, -1.5)])]   # ranks 2: still the top 3
    _, (c,) = edit_response(plan, _chat_top_body(exact))
    assert c.top_logprobs == [[(5, -0.1), (7, -2.0), (2, -2.5)],
                              [(4, -0.5), (9, -1.0), (6, -1.5)]]
    assert c.sampling["logprobs"] == 3
    # least likely of the list: ranks 3 (the top 3) or worse (the 3rd best is missing)
    ambiguous = [*exact, (8, -3.0, [(8, -3.0), (4, -0.2), (6, -0.9)])]
    _, (c,) = edit_response(plan, _chat_top_body(ambiguous))
    assert c.top_logprobs is None and c.sampling["logprobs"] == 0
    assert c.logprobs == [-0.1, -1.0, -3.0]
    # k = 1: only greedy sampling says the sampled token is the best one
    for temperature, recorded in ((0.8, False), (0, True)):
        _, plan = _prepare("chat", {**asked, "top_logprobs": 1, "temperature": temperature})
        _, (c,) = edit_response(plan, _chat_top_body([(5, -0.1, [(5, -0.1)])]))
        assert (c.top_logprobs is not None) is recorded


def test_temperature_below_vllms_floor_is_sent_and_recorded_as_it_runs() -> None:
    """vLLM 0.25 runs a temperature in (0, 0.01) at 0.01 (vllm/sampling_params.py:449-457)."""
    sent, plan = _prepare("completion", {"prompt": "a", "temperature": 0.004})
    assert sent["temperature"] == 0.01 and plan.sampling["temperature"] == 0.01
    sent, plan = _prepare("completion", {"prompt": "a", "temperature": 0})
    assert sent["temperature"] == 0 and plan.sampling["temperature"] == 0.0
