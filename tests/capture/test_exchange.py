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
