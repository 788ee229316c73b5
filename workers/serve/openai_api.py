"""OpenAI-compatible request parsing and response shapes, mirroring vLLM's server.

Kept free of the HTTP framework: turn a request body into engine requests
(:func:`parse_completion`, :func:`parse_chat`), engine results into vLLM-shaped response
objects (:class:`ChoiceText`, the ``*_response`` functions), and tokens, as the engine
makes them, into stream chunks (:class:`TextBuilder`, :class:`StreamChunks`).

What is mirrored from vLLM's OpenAI server (``vllm/entrypoints/openai``), field for field:

- ``return_token_ids``: completions put ``prompt_token_ids`` and ``token_ids`` on each
  choice; chat puts ``prompt_token_ids`` at the top level and ``token_ids`` on each choice.
  Streams send ``prompt_token_ids`` only in the first chunk and ``token_ids`` as deltas.
  Unrequested, these members are present and ``null`` (vLLM sets them explicitly, so
  even its ``exclude_unset`` stream chunks carry them), except where vLLM never sets them.
- ``logprobs``: completions ``{text_offset, token_logprobs, tokens, top_logprobs}`` with
  ``top_logprobs`` a dict of ``token string -> logprob`` holding the sampled token plus the
  top k; chat ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``. Logprobs
  are raw (before temperature and penalties: vLLM's default ``--logprobs-mode
  raw_logprobs``), clamped below at -9999.0 as vLLM does. ``return_tokens_as_token_ids``
  writes tokens as ``"token_id:<id>"``.
- ids ``cmpl-<X-Request-Id or uuid>`` / ``chatcmpl-...``; ``finish_reason`` and
  ``stop_reason`` (the stop token id or stop string; ``null`` for EOS and length); stop
  strings are found on the detokenised text and truncate it (and the token ids after the
  token that completed the stop string); streams hold back text that could start a stop
  string and incomplete UTF-8 sequences.
- the bytes, as vLLM 0.25.0 writes them: whole bodies are ``JSONResponse(model.model_dump())``
  (every member, ``null`` included, compact, Python's float text); stream chunks are
  ``model_dump_json(exclude_unset=True)`` (pydantic's float text, e.g. ``1e-7`` and
  ``0.00001``) and the usage chunk ``exclude_none=True``; ``system_fingerprint`` (vLLM:
  ``vllm-<version>-<hash8>``; here ``ledger-<engine version>-<fingerprint hex8>``) is in
  every body, on the stream's last chunk with a ``finish_reason`` when no usage chunk
  follows, else on the usage chunk; chat's ``top_logprobs`` are the first k of "sampled
  token, then the best others"; a temperature in (0, 0.01) runs at 0.01.

Not supported (a 400 error, never silently ignored): ``n > 1``, beam search, ``echo``,
``logit_bias``, ``allowed_token_ids``, ``bad_words``, ``min_tokens > 0``, structured
output, tools, ``prompt_logprobs``, ``suffix``, ``logprob_token_ids``, custom chat templates.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pydantic_core

from workers.engine.api import GenerationRequest, GenerationResult, SamplingParams
from workers.engine.sampling import validate
from workers.serve.tokenizer import ByteTokenizer, IncrementalDecoder

LOGPROB_FLOOR = -9999.0
MAX_LOGPROBS = 20          # vLLM's --max-logprobs default
SEED_BITS = 63
MIN_TEMPERATURE = 1e-2     # vLLM raises (0, 0.01) to this (vllm/sampling_params.py:449-457)
MAX_TEMPERATURE = 2.0      # and refuses more (sampling_params.py:548-553)


class RequestError(ValueError):
    """A request the server refuses: becomes a 400 (or ``status``) OpenAI error body."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.status}}


def dumps(obj: Any) -> str:
    """JSON as Starlette and pydantic write it: compact, UTF-8, no NaN."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


# ---------------------------------------------------------------------------- requests
@dataclass
class Parsed:
    """One OpenAI request, turned into engine requests (one per prompt)."""

    kind: str                              # "completion" | "chat"
    request_id: str                        # cmpl-... / chatcmpl-...
    model: str
    prompts: list[list[int]]
    sampling: list[SamplingParams]
    stream: bool
    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False
    as_token_ids: bool = False             # return_tokens_as_token_ids
    logprobs: int | None = None            # completions: top-k; chat: top_logprobs if asked
    stop: list[str] = field(default_factory=list)
    include_stop_str: bool = False
    skip_special_tokens: bool = True

    def engine_requests(self) -> list[GenerationRequest]:
        return [GenerationRequest(id=f"{self.request_id}-{i}", prompt_token_ids=tuple(p),
                                  sampling=s)
                for i, (p, s) in enumerate(zip(self.prompts, self.sampling, strict=True))]


_UNSUPPORTED_IF_SET: dict[str, Any] = {
    # parameter -> the value (or values) that mean "not used"
    "n": (None, 1), "best_of": (None, 1), "use_beam_search": (None, False),
    "echo": (None, False), "logit_bias": (None, {}), "allowed_token_ids": (None,),
    "bad_words": (None, []), "min_tokens": (None, 0), "response_format": (None,),
    "structured_outputs": (None,), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "prompt_logprobs": (None,),
    "suffix": (None, ""), "logprob_token_ids": (None,), "tools": (None, []),
    "chat_template": (None,), "prompt_embeds": (None,), "logits_processors": (None,),
    "vllm_xargs": (None,), "thinking_token_budget": (None,),
}


def _check_unsupported(body: Mapping[str, Any]) -> None:
    for name, unused in _UNSUPPORTED_IF_SET.items():
        value = body.get(name)
        if value is None or any(value == u and type(value) is type(u) for u in unused):
            continue
        if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        if name == "n" and body.get("temperature") == 0:
            # vLLM's own refusal (sampling_params.py:623-625); it runs n > 1 otherwise
            raise RequestError(f"n must be 1 when using greedy sampling, got {value}.")
        raise RequestError(f"`{name}` is not supported by ledger engine serve", param=name)


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"`{name}` must be a number", param=name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"`{name}` must be an integer", param=name)
    return value


def _flag(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"`{name}` must be a boolean", param=name)
    return value


def _stop_strings(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise RequestError("`stop` must be a string or a list of strings", param="stop")


def _sampling(body: Mapping[str, Any], max_tokens: int, logprobs: int | None,
              vocab_size: int) -> SamplingParams:
    seed = _integer(body, "seed", None)
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise RequestError("`seed` must fit in a signed 64-bit integer", param="seed")
    temperature = _number(body, "temperature", 1.0)
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise RequestError(f"temperature must be in [0, 2], got {temperature}.",
                           param="temperature")
    if 0 < temperature < MIN_TEMPERATURE:
        temperature = MIN_TEMPERATURE
    if temperature > 0 and seed is None:
        seed = secrets.randbits(SEED_BITS)      # unseeded: the server draws one, like vLLM
    stop_ids = body.get("stop_token_ids") or []
    if not (isinstance(stop_ids, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                               and 0 <= t < vocab_size for t in stop_ids)):
        raise RequestError("`stop_token_ids` must be a list of token ids", param="stop_token_ids")
    top_k = _integer(body, "top_k", 0)
    assert top_k is not None
    params = SamplingParams(
        temperature=temperature,
        top_p=_number(body, "top_p", 1.0),
        top_k=top_k,
        min_p=_number(body, "min_p", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        max_tokens=max_tokens,
        seed=seed,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_flag(body, "ignore_eos"),
        logprobs=logprobs or None,
    )
    try:
        validate(params)
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    return params


def _request_id(prefix: str, header: str | None) -> str:
    return f"{prefix}-{header or uuid.uuid4().hex}"


def _check_model(body: Mapping[str, Any], served: str) -> None:
    model = body.get("model")
    if model is not None and model != served:
        raise RequestError(f"The model `{model}` does not exist.", param="model", status=404,
                           kind="NotFoundError")


def _check_length(prompt: Sequence[int], max_tokens: int, max_model_len: int) -> None:
    if len(prompt) + max_tokens > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.")


def _stream_options(body: Mapping[str, Any], stream: bool) -> tuple[bool, bool]:
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise RequestError("Stream options can only be defined when `stream=True`.",
                           param="stream_options")
    if not isinstance(options, dict):
        raise RequestError("`stream_options` must be an object", param="stream_options")
    include_usage = bool(options.get("include_usage"))
    # vLLM: continuous stats only with include_usage (serve/utils/api_utils.py:276-288)
    return include_usage, include_usage and bool(options.get("continuous_usage_stats"))


def parse_completion(body: Any, *, served_model: str, tokenizer: ByteTokenizer | None,
                     vocab_size: int, max_model_len: int,
                     request_id_header: str | None = None) -> Parsed:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_model(body, served_model)
    _check_unsupported(body)
    prompt = body.get("prompt")
    add_special = _flag(body, "add_special_tokens", True)
    prompts: list[list[int]]
    if isinstance(prompt, str):
        prompts = [_encode(tokenizer, prompt, add_special)]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [_encode(tokenizer, p, add_special) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise RequestError("`prompt` must be a non-empty string, token list, or list of "
                           "either", param="prompt")
    for p in prompts:
        if not p or min(p) < 0 or max(p) >= vocab_size:
            raise RequestError(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    max_tokens = _integer(body, "max_tokens", 16)
    assert max_tokens is not None
    if max_tokens < 1:
        raise RequestError("`max_tokens` must be at least 1", param="max_tokens")
    for p in prompts:
        _check_length(p, max_tokens, max_model_len)
    logprobs = _integer(body, "logprobs", None)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise RequestError(f"`logprobs` must be in [0, {MAX_LOGPROBS}]", param="logprobs")
    stream = _flag(body, "stream")
    include_usage, continuous = _stream_options(body, stream)
    return Parsed(
        kind="completion", request_id=_request_id("cmpl", request_id_header),
        model=served_model, prompts=prompts,
        sampling=[_sampling(body, max_tokens, logprobs, vocab_size) for _ in prompts],
        stream=stream, include_usage=include_usage, continuous_usage=continuous,
        return_token_ids=_flag(body, "return_token_ids"),
        as_token_ids=_flag(body, "return_tokens_as_token_ids") or tokenizer is None,
        logprobs=logprobs, stop=_stop_strings(body),
        include_stop_str=_flag(body, "include_stop_str_in_output"),
        skip_special_tokens=_flag(body, "skip_special_tokens", True),
    )


def parse_chat(body: Any, *, served_model: str, tokenizer: ByteTokenizer | None,
               vocab_size: int, max_model_len: int,
               request_id_header: str | None = None) -> Parsed:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_model(body, served_model)
    _check_unsupported(body)
    if tokenizer is None:
        raise RequestError("this model has no tokenizer here: use /v1/completions with "
                           "token-ID prompts")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("`messages` must be a non-empty list", param="messages")
    if not all(isinstance(m, dict) for m in messages):
        raise RequestError("each message must be an object", param="messages")
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final = _flag(body, "continue_final_message")
    if add_generation_prompt and continue_final and "add_generation_prompt" in body:
        raise RequestError("Cannot set both `continue_final_message` and "
                           "`add_generation_prompt` to True.")
    try:
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt and not continue_final,
            continue_final_message=continue_final)
    except ValueError as exc:
        raise RequestError(str(exc), param="messages") from None
    if _flag(body, "add_special_tokens"):
        prompt = [tokenizer.bos_token_id, *prompt]
    max_tokens = _integer(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", None)
    if max_tokens is None:
        max_tokens = max_model_len - len(prompt)    # vLLM: whatever the context leaves
        if max_tokens < 1:
            _check_length(prompt, 1, max_model_len)
    if max_tokens < 1:
        raise RequestError("`max_tokens` must be at least 1", param="max_tokens")
    _check_length(prompt, max_tokens, max_model_len)
    top = None
    if _flag(body, "logprobs"):
        top = _integer(body, "top_logprobs", 0) or 0
        if not 0 <= top <= MAX_LOGPROBS:
            raise RequestError(f"`top_logprobs` must be in [0, {MAX_LOGPROBS}]",
                               param="top_logprobs")
    elif body.get("top_logprobs"):
        raise RequestError("when using `top_logprobs`, `logprobs` must be set to true.",
                           param="top_logprobs")
    stream = _flag(body, "stream")
    include_usage, continuous = _stream_options(body, stream)
    return Parsed(
        kind="chat", request_id=_request_id("chatcmpl", request_id_header),
        model=served_model, prompts=[prompt],
        sampling=[_sampling(body, max_tokens, top, vocab_size)],
        stream=stream, include_usage=include_usage, continuous_usage=continuous,
        return_token_ids=_flag(body, "return_token_ids"),
        as_token_ids=_flag(body, "return_tokens_as_token_ids"),
        logprobs=top, stop=_stop_strings(body),
        include_stop_str=_flag(body, "include_stop_str_in_output"),
        skip_special_tokens=_flag(body, "skip_special_tokens", True),
    )


def _encode(tokenizer: ByteTokenizer | None, text: str, add_special: bool) -> list[int]:
    if tokenizer is None:
        raise RequestError("this model has no tokenizer here: send token-ID prompts",
                           param="prompt")
    return tokenizer.encode(text, add_special_tokens=add_special)


# ---------------------------------------------------------------------------- results
@dataclass
class ChoiceText:
    """One generated sequence after stop strings: tokens kept, text, per-token deltas."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str
    stop_reason: int | str | None
    text: str
    deltas: list[str]          # one per kept token; "".join(deltas) == text


def finish_text(result: GenerationResult, sampling: SamplingParams, parsed: Parsed,
                tokenizer: ByteTokenizer | None) -> ChoiceText:
    """Detokenise, apply stop strings (truncating after the completing token), and split
    the text into stream deltas the way vLLM's incremental detokenizer emits them (a
    :class:`TextBuilder` fed the whole result)."""
    builder = TextBuilder(sampling, parsed, tokenizer)
    ids, n = result.token_ids, len(result.token_ids)
    for j, token in enumerate(ids):
        top = result.top_logprobs[j] if result.top_logprobs is not None else None
        if builder.add(token, result.logprobs[j], top,
                       result.finish_reason if j == n - 1 else None) is None:
            break                              # a stop string ended it
    choice = builder.choice
    if not n:
        choice.finish_reason = result.finish_reason
    if choice.top_logprobs is None and result.top_logprobs is not None:
        choice.top_logprobs = []
    return choice


class TextBuilder:
    """One choice's text, a token at a time, as a stream needs it: :meth:`add` each token
    as the engine makes it and send the delta it returns. ``choice`` is everything so far
    (the :class:`ChoiceText` :func:`finish_text` gives once the last token is in); ``done``
    once the last token came or a stop string ended the text (the tokens after the one
    that completed it are dropped, as the whole answer drops them)."""

    def __init__(self, sampling: SamplingParams, parsed: Parsed,
                 tokenizer: ByteTokenizer | None) -> None:
        self.sampling, self.parsed, self.tokenizer = sampling, parsed, tokenizer
        self.choice = ChoiceText([], [], None, "length", None, "", [])
        self.done = False
        self._decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self._longest = max((len(s) for s in parsed.stop), default=0)
        self._holdback = (self._longest - 1 if self._longest and not parsed.include_stop_str
                          else 0)
        self._emitted = 0

    def add(self, token: int, logprob: float, top: list[tuple[int, float]] | None,
            finish: str | None) -> str | None:
        """Take the next token (``finish``: its finish reason if it is the last, else
        None); the text delta it releases, or None when the choice had already ended."""
        if self.done:
            return None
        c = self.choice
        c.token_ids.append(token)
        c.logprobs.append(logprob)
        if top is not None:
            if c.top_logprobs is None:
                c.top_logprobs = []
            c.top_logprobs.append(top)
        last = finish is not None
        if finish is not None:
            self.done, c.finish_reason = True, finish
            if finish == "stop" and token in self.sampling.stop_token_ids:
                c.stop_reason = token
        if self._decoder is None:
            c.deltas.append("")
            return ""
        return self._text(token, last)

    def _text(self, token: int, last: bool) -> str:
        c, parsed, decoder = self.choice, self.parsed, self._decoder
        assert decoder is not None and self.tokenizer is not None
        if self.tokenizer.token_bytes(token) or parsed.skip_special_tokens:
            piece = decoder.step(token)
        else:
            piece = decoder.flush() + self.tokenizer.token_text(token)
        if last:
            piece += decoder.flush()
        searched_from = max(0, len(c.text) - self._longest + 1)
        c.text += piece
        hit = _find_stop(c.text, parsed.stop, searched_from)
        if hit is not None:
            position, stop = hit
            c.text = c.text[:position + len(stop)] if parsed.include_stop_str \
                else c.text[:position]
            c.finish_reason, c.stop_reason, self.done = "stop", stop, True
            delta = c.text[self._emitted:]
        else:
            visible = len(c.text) if last else max(self._emitted, len(c.text) - self._holdback)
            delta = c.text[self._emitted:visible]
            self._emitted = visible
        c.deltas.append(delta)
        return delta


def _find_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, start)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best


def _token_str(token_id: int, parsed: Parsed, tokenizer: ByteTokenizer | None) -> str:
    if parsed.as_token_ids or tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.token_text(token_id)


def _completion_logprobs(choice: ChoiceText, start: int, stop: int, parsed: Parsed,
                         tokenizer: ByteTokenizer | None, text_offset: int) -> dict[str, Any]:
    k = parsed.logprobs or 0
    offsets: list[int] = []
    token_lps: list[float] = []
    tokens: list[str] = []
    tops: list[dict[str, float]] = []
    last_len = 0
    for j in range(start, stop):
        token = choice.token_ids[j]
        s = _token_str(token, parsed, tokenizer)
        tokens.append(s)
        token_lps.append(max(choice.logprobs[j], LOGPROB_FLOOR))
        step: dict[int, float] = {token: choice.logprobs[j]}      # sampled token first
        for tid, lp in (choice.top_logprobs[j] if choice.top_logprobs else []):
            step.setdefault(tid, lp)
        tops.append({_token_str(t, parsed, tokenizer): max(lp, LOGPROB_FLOOR)
                     for i, (t, lp) in enumerate(step.items()) if k >= i})
        offsets.append(text_offset if not offsets else offsets[-1] + last_len)
        last_len = len(s)
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens,
            "top_logprobs": tops}


def _chat_logprobs(choice: ChoiceText, start: int, stop: int, parsed: Parsed,
                   tokenizer: ByteTokenizer | None) -> dict[str, Any]:
    """As vLLM 0.25 (chat_completion/serving.py:1093-1179): per step a dict of the sampled
    token first, then the top k (vllm/logprobs.py:175-206), of which ``top_logprobs`` are
    the first k entries, so a sampled token ranked below k displaces the k-th best. The
    chosen token's ``bytes`` are those of its decoded text even when ``token`` is
    ``token_id:<id>`` (``null`` without a tokenizer); an alternative's are its ``token``'s.
    """
    k = parsed.logprobs or 0
    content = []
    for j in range(start, stop):
        token = choice.token_ids[j]
        s = _token_str(token, parsed, tokenizer)
        step: dict[int, float] = {token: choice.logprobs[j]}
        for tid, lp in (choice.top_logprobs[j] if choice.top_logprobs else []):
            step.setdefault(tid, lp)
        top = list(step.items())[:k]
        decoded = tokenizer.token_text(token) if tokenizer is not None else None
        content.append({
            "token": s, "logprob": max(choice.logprobs[j], LOGPROB_FLOOR),
            "bytes": None if decoded is None else list(decoded.encode("utf-8", "replace")),
            "top_logprobs": [
                {"token": (ts := _token_str(t, parsed, tokenizer)),
                 "logprob": max(lp, LOGPROB_FLOOR),
                 "bytes": list(ts.encode("utf-8", "replace"))}
                for t, lp in top],
        })
    return {"content": content}


def _usage(prompt_tokens: int, completion_tokens: int, *,
           whole: bool = True) -> dict[str, Any]:
    """vLLM's ``UsageInfo`` (openai/engine/protocol.py:111-115); stream chunks carry only
    the three counts (set explicitly, dumped ``exclude_unset``/``exclude_none``)."""
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                             "total_tokens": prompt_tokens + completion_tokens,
                             "completion_tokens": completion_tokens}
    if whole:
        usage["prompt_tokens_details"] = None
    return usage


def completion_response(parsed: Parsed, choices: Sequence[ChoiceText],
                        tokenizer: ByteTokenizer | None, created: int, *,
                        system_fingerprint: str | None = None) -> dict[str, Any]:
    """vLLM 0.25's ``CompletionResponse.model_dump()`` (completion/protocol.py:520-562)."""
    out = []
    for i, (prompt, c) in enumerate(zip(parsed.prompts, choices, strict=True)):
        out.append({
            "index": i, "text": c.text,
            "logprobs": (_completion_logprobs(c, 0, len(c.token_ids), parsed, tokenizer, 0)
                         if parsed.logprobs is not None else None),
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            "token_ids": list(c.token_ids) if parsed.return_token_ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": list(prompt) if parsed.return_token_ids else None,
            "routed_experts": None,
        })
    prompt_tokens = sum(len(p) for p in parsed.prompts)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {"id": parsed.request_id, "object": "text_completion", "created": created,
            "model": parsed.model, "choices": out, "service_tier": None,
            "system_fingerprint": system_fingerprint,
            "usage": _usage(prompt_tokens, completion_tokens), "kv_transfer_params": None,
            "metrics": None}


def chat_response(parsed: Parsed, choice: ChoiceText, tokenizer: ByteTokenizer | None,
                  created: int, *, system_fingerprint: str | None = None) -> dict[str, Any]:
    """vLLM 0.25's ``ChatCompletionResponse.model_dump()`` (chat_completion/protocol.py:
    58-137; ``tool_calls`` is dropped when empty)."""
    prompt = parsed.prompts[0]
    return {
        "id": parsed.request_id, "object": "chat.completion", "created": created,
        "model": parsed.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": choice.text, "refusal": None,
                        "annotations": None, "audio": None, "function_call": None,
                        "reasoning": None},
            "logprobs": (_chat_logprobs(choice, 0, len(choice.token_ids), parsed, tokenizer)
                         if parsed.logprobs is not None else None),
            "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason,
            "token_ids": list(choice.token_ids) if parsed.return_token_ids else None,
            "routed_experts": None,
        }],
        "service_tier": None,
        "system_fingerprint": system_fingerprint,
        "usage": _usage(len(prompt), len(choice.token_ids)),
        "prompt_logprobs": None,
        "prompt_token_ids": list(prompt) if parsed.return_token_ids else None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "metrics": None,
    }


def _sse(obj: Any) -> str:
    """One event as vLLM writes it: ``data: <model_dump_json>\\n\\n`` (pydantic's compact
    JSON, whose float text differs from Python's: ``1e-7``, ``0.00001``)."""
    return f"data: {pydantic_core.to_json(obj).decode('utf-8')}\n\n"


def _usage_chunk(head: dict[str, Any], usage: dict[str, Any],
                 system_fingerprint: str | None) -> str:
    chunk: dict[str, Any] = {**head, "choices": [], "usage": usage}
    if system_fingerprint is not None:              # dumped with exclude_none
        chunk["system_fingerprint"] = system_fingerprint
    return _sse(chunk)


class StreamChunks:
    """The SSE events of one streamed request, made as its tokens come: :meth:`start`,
    then :meth:`token` for each token the engine makes (choices interleaved, each in its
    own order), then :meth:`end`. vLLM 0.25's shapes: a completion sends one chunk per
    token, then usage, then [DONE] (completion/serving.py:282-497); a chat first sends
    the role chunk (with prompt_token_ids and prompt_text; chat_completion/serving.py:
    408-824). Each choice's text follows :class:`TextBuilder` (stop strings, held-back
    text); a choice's last chunk has its ``finish_reason``."""

    def __init__(self, parsed: Parsed, tokenizer: ByteTokenizer | None, created: int, *,
                 system_fingerprint: str | None = None) -> None:
        self.parsed, self.tokenizer = parsed, tokenizer
        self.system_fingerprint = system_fingerprint
        self.builders = [TextBuilder(s, parsed, tokenizer) for s in parsed.sampling]
        self._offsets = [0] * len(self.builders)
        self.head = {"id": parsed.request_id,
                     "object": ("chat.completion.chunk" if parsed.kind == "chat"
                                else "text_completion"),
                     "created": created, "model": parsed.model}

    def start(self) -> list[str]:
        parsed = self.parsed
        if parsed.kind != "chat":
            return []
        first: dict[str, Any] = {**self.head, "choices": [{
            "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}]}
        if parsed.continuous_usage:
            first["usage"] = _usage(len(parsed.prompts[0]), 0, whole=False)
        first["prompt_token_ids"] = list(parsed.prompts[0]) if parsed.return_token_ids \
            else None
        first["prompt_text"] = None                 # set (to None) unless return_prompt_text
        return [_sse(first)]

    def token(self, i: int, token: int, logprob: float,
              top: list[tuple[int, float]] | None, finish: str | None) -> list[str]:
        """The chunk of choice ``i``'s next token (none once a stop string ended it)."""
        builder = self.builders[i]
        delta = builder.add(token, logprob, top, finish)
        if delta is None:
            return []
        c, j, last = builder.choice, len(builder.choice.deltas) - 1, builder.done
        chunk = (self._chat(c, j, last) if self.parsed.kind == "chat"
                 else self._completion(i, c, j, last))
        self._offsets[i] += len(delta)
        if self.parsed.continuous_usage:
            chunk["usage"] = _usage(len(self.parsed.prompts[i]), j + 1, whole=False)
        if last and not self.parsed.include_usage and self.system_fingerprint is not None:
            chunk["system_fingerprint"] = self.system_fingerprint
        return [_sse(chunk)]

    def _completion(self, i: int, c: ChoiceText, j: int, last: bool) -> dict[str, Any]:
        parsed = self.parsed
        return {**self.head, "choices": [{
            "index": i, "text": c.deltas[j],
            "logprobs": (_completion_logprobs(c, j, j + 1, parsed, self.tokenizer,
                                              self._offsets[i])
                         if parsed.logprobs is not None else None),
            "finish_reason": c.finish_reason if last else None,
            "stop_reason": c.stop_reason if last else None,
            "prompt_token_ids": list(parsed.prompts[i]) if parsed.return_token_ids and j == 0
            else None,
            "token_ids": [c.token_ids[j]] if parsed.return_token_ids else None,
        }]}

    def _chat(self, c: ChoiceText, j: int, last: bool) -> dict[str, Any]:
        parsed = self.parsed
        body: dict[str, Any] = {
            "index": 0, "delta": {"content": c.deltas[j]},
            "logprobs": (_chat_logprobs(c, j, j + 1, parsed, self.tokenizer)
                         if parsed.logprobs is not None else None),
            "finish_reason": c.finish_reason if last else None,
        }
        if last:
            body["stop_reason"] = c.stop_reason
        body["token_ids"] = [c.token_ids[j]] if parsed.return_token_ids else None
        return {**self.head, "choices": [body]}

    def end(self) -> list[str]:
        """The usage chunk (if asked for) and [DONE]."""
        events = []
        if self.parsed.include_usage:
            events.append(_usage_chunk(self.head, _usage(
                sum(len(p) for p in self.parsed.prompts),
                sum(len(b.choice.token_ids) for b in self.builders), whole=False),
                self.system_fingerprint))
        return [*events, "data: [DONE]\n\n"]

    @staticmethod
    def error(exc: RequestError) -> list[str]:
        """A failure after the stream began, as vLLM sends it: an error event, [DONE]."""
        return [f"data: {dumps(exc.body())}\n\n", "data: [DONE]\n\n"]


def now() -> int:
    return int(time.time())
