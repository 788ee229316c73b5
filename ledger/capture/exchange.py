"""One OpenAI-compatible exchange, seen by the recorder: pure functions over bytes.

Shared by the SDK (an httpx transport under the official ``openai`` client) and the
recording proxy, so both add the same fields and record the same envelopes:

1. :func:`prepare` rewrites a ``/v1/completions`` or ``/v1/chat/completions`` request body:
   it asks for ``return_token_ids`` and logprobs when absent (logprobs it adds named by
   token ID: ``return_tokens_as_token_ids``), sets a random ``seed`` when
   the caller gave none, and states every sampling value it records explicitly (absent
   ones from :class:`SamplingDefaults`), so the record can never disagree with the
   upstream's own defaults. It returns a :class:`Plan` of what it changed.
2. :func:`edit_response` (whole bodies) and :class:`StreamEditor` (SSE streams, fed in
   arbitrary pieces) give the client the upstream's bytes with the members the proxy
   asked for set back to ``null`` (vLLM writes unrequested ones as ``null``), and collect
   one :class:`Captured` sequence per choice.

What a :class:`Captured` records (so that a replay on the reference engine reproduces it):

- ``prompt_token_ids``: exactly what the upstream reports it ran (after templating).
- ``sampling.max_tokens``: the tightest contract that reproduces the output. ``max_tokens``
  and stop strings only ever *end* a generation; they never change which token is
  sampled at a step. So when the output ended by length, by a text ``stop`` string, or
  when the caller set no ``max_tokens`` (chat: whatever the context leaves), the record
  says ``max_tokens = len(output)``; otherwise the caller's value.
- text ``stop`` strings: not in the envelope (a replay works on token IDs). A stop string
  that never fired changed nothing. One that fired ended the output after the token that
  completed it: the record is that prefix with ``max_tokens = len(output)`` and
  ``finish_reason = "length"`` (what a replay of the recorded contract returns), and
  ``stop_string`` on the :class:`Captured` says so.
- ``output.logprobs``: the chosen token's raw logprob per step. ``top_logprobs`` only when
  the caller asked for top-k *with* ``return_tokens_as_token_ids`` (otherwise the upstream
  names alternatives by text, which does not identify a token) and, for chat, only when
  every step's list is provably the top k (vLLM lists the sampled token first and then
  the best others, see :func:`_chat_top_is_exact`), else ``null``; and
  ``sampling.logprobs`` says how many alternatives were recorded (0: chosen token only).
- ``sampling.temperature``: what the upstream ran: vLLM raises a value in (0, 0.01) to
  0.01, so the proxy sends and records 0.01.

Requests that no envelope can describe are forwarded untouched and not recorded; the
plan's ``unrecordable`` says why (``n > 1``, beam search, ``logit_bias``, ``min_tokens``,
structured output, ``echo``, non-text message parts, unknown parameters, a seed outside
the envelope's range, ...).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ledger.capture import jsonedit

CAPTURE_PATHS: dict[str, str] = {"/v1/completions": "completion",
                                 "/v1/chat/completions": "chat"}
MAX_SEED = 2**53 - 1                      # the envelope's (I-JSON safe) seed range
SEED_BITS = 53
CLAMPED_LOGPROB = -9999.0                 # vLLM's floor for -inf: not a real value
# vLLM 0.25 raises a temperature in (0, 0.01) to 0.01 (vllm/sampling_params.py:449-457,
# _MAX_TEMP = 1e-2), so only 0 is greedy; the proxy sends and records the raised value.
MIN_SAMPLING_TEMPERATURE = 1e-2

# Parameters that do not change which tokens are generated from the prompt token IDs
# the upstream reports (templating and tokenisation are already in those IDs).
_HARMLESS = frozenset({
    "model", "prompt", "messages", "stream", "stream_options", "user", "stop",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
    "return_token_ids", "return_tokens_as_token_ids", "request_id", "session_id", "priority",
    "cache_salt", "prompt_logprobs", "add_special_tokens", "truncate_prompt_tokens",
    "truncation_side", "tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt",
    "continue_final_message", "chat_template", "chat_template_kwargs", "documents",
    "reasoning_effort", "include_reasoning", "metadata", "store", "service_tier",
    "stream_interval", "kv_transfer_params", "return_prompt_text",
    # vLLM 0.25: offsets and masks of the /render endpoints (ignored when generating),
    # multimodal processing options (the prompt IDs the upstream reports include them)
    "return_token_offsets", "return_assistant_tokens_mask", "media_io_kwargs",
    "mm_processor_kwargs",
})
_SAMPLING_KEYS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "max_tokens", "max_completion_tokens", "seed", "stop_token_ids",
    "ignore_eos", "logprobs", "top_logprobs",
})
# Parameters that would change generation, allowed only at a value meaning "not used".
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "use_beam_search": (False,), "echo": (False,),
    "logit_bias": ({},), "allowed_token_ids": (), "bad_words": ([],), "min_tokens": (0,),
    "response_format": ({"type": "text"},), "structured_outputs": (), "guided_json": (),
    "guided_regex": (), "guided_choice": (), "guided_grammar": (), "logprob_token_ids": (),
    "watermarking": (False,), "length_penalty": (1.0, 1), "logits_processors": (),
    "vllm_xargs": (), "thinking_token_budget": (-1,), "repetition_detection": (),
    "suffix": ("",), "prompt_embeds": (), "functions": (), "function_call": (),
}


@dataclass(frozen=True)
class SamplingDefaults:
    """What the upstream uses for a sampling value the caller left out.

    These are vLLM's fallbacks (``--generation-config vllm``). vLLM's default
    ``--generation-config auto`` takes them from the model's ``generation_config.json``
    instead: configure the same values here. The proxy sends them explicitly, so the
    record and the run always agree.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> SamplingDefaults:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown sampling defaults: {sorted(unknown)}")
        return cls(**data)


@dataclass
class Plan:
    """What :func:`prepare` did to one request, and how to read its response."""

    kind: str                                   # "completion" | "chat"
    stream: bool = False
    unrecordable: str | None = None             # why no envelope can describe it
    added_token_ids: bool = False
    added_logprobs: bool = False
    seed: int | None = None
    seed_added: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)   # without max_tokens, logprobs
    requested_max_tokens: int | None = None
    top_k: int = 0                              # alternatives the caller asked for
    top_ids: bool = False                       # ... named by token id (recordable)
    data_subject: str | None = None             # from the X-Ledger-Data-Subject header

    @property
    def recordable(self) -> bool:
        return self.unrecordable is None


@dataclass
class Captured:
    """One generated sequence, everything an envelope needs but the static config."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    sampling: dict[str, Any]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    stop_string: bool = False                   # ended by a text stop string
    data_subject: str | None = None             # X-Ledger-Data-Subject (docs/privacy.md)

    def output(self) -> dict[str, Any]:
        out: dict[str, Any] = {"token_ids": self.token_ids, "finish_reason": self.finish_reason,
                               "logprobs": self.logprobs}
        if self.top_logprobs is not None:
            out["top_logprobs"] = [[{"token_id": t, "logprob": lp} for t, lp in step]
                                   for step in self.top_logprobs]
        return out


# ---------------------------------------------------------------------------- request
def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    return value is None or any(value == a and type(value) is type(a) for a in allowed)


def _why_unrecordable(kind: str, body: Mapping[str, Any]) -> str | None:
    for key, value in body.items():
        if key in _HARMLESS or key in _SAMPLING_KEYS:
            continue
        if key in _NEUTRAL:
            if not _neutral(value, _NEUTRAL[key]):
                return f"`{key}` changes generation in a way the envelope cannot record"
            continue
        if value is not None:
            return f"unknown parameter `{key}`"
    for key in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty"):
        if body.get(key) is not None and not _is_number(body[key]):
            return f"`{key}` is not a number"
    for key in ("top_k", "max_tokens", "max_completion_tokens", "seed"):
        if body.get(key) is not None and not _is_int(body[key]):
            return f"`{key}` is not an integer"
    seed = body.get("seed")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        return f"seed {seed} is outside the envelope's range 0..2**53-1"
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not (isinstance(stop_ids, list) and all(map(_is_int, stop_ids))):
        return "`stop_token_ids` is not a list of integers"
    if body.get("ignore_eos") is not None and not isinstance(body["ignore_eos"], bool):
        return "`ignore_eos` is not a boolean"
    if kind == "completion":
        if body.get("logprobs") is not None and not _is_int(body["logprobs"]):
            return "`logprobs` is not an integer"
    else:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return "`messages` is not a list"
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list) and any(
                    not (isinstance(p, dict) and p.get("type") == "text") for p in content):
                return "a message has non-text content (not recordable as token IDs)"
        if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
            return "`logprobs` is not a boolean"
        if body.get("top_logprobs") and not body.get("logprobs"):
            return "`top_logprobs` without `logprobs` (the upstream refuses it)"
        if body.get("top_logprobs") is not None and not _is_int(body["top_logprobs"]):
            return "`top_logprobs` is not an integer"
    return None


def prepare(kind: str, body: bytes, defaults: SamplingDefaults | None = None,
            new_seed: Callable[[], int] | None = None) -> tuple[bytes, Plan]:
    """The request body to send upstream, and the plan for its response.

    An unrecordable request comes back byte for byte unchanged.
    """
    defaults = defaults or SamplingDefaults()
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body, Plan(kind, unrecordable="the request body is not JSON")
    if not isinstance(data, dict):
        return body, Plan(kind, unrecordable="the request body is not a JSON object")
    plan = Plan(kind, stream=data.get("stream") is True)
    plan.unrecordable = _why_unrecordable(kind, data)
    if plan.unrecordable:
        return body, plan

    if data.get("seed") is None:
        data["seed"] = (new_seed or (lambda: secrets.randbits(SEED_BITS)))()
        plan.seed_added = True
    plan.seed = data["seed"]
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty"):
        if data.get(name) is None:
            data[name] = getattr(defaults, name)
    if 0 < data["temperature"] < MIN_SAMPLING_TEMPERATURE:
        data["temperature"] = MIN_SAMPLING_TEMPERATURE
    if data.get("return_token_ids") is not True:
        data["return_token_ids"] = True
        plan.added_token_ids = True
    plan.top_ids = data.get("return_tokens_as_token_ids") is True
    if kind == "completion":
        if data.get("logprobs") is None:
            data["logprobs"] = 0
            plan.added_logprobs = True
        else:
            plan.top_k = data["logprobs"]
        plan.requested_max_tokens = data.get("max_tokens")
    else:
        if data.get("logprobs") is not True:
            data["logprobs"] = True
            plan.added_logprobs = True
        else:
            plan.top_k = data.get("top_logprobs") or 0
        plan.requested_max_tokens = (data.get("max_completion_tokens")
                                     if data.get("max_completion_tokens") is not None
                                     else data.get("max_tokens"))
    if plan.added_logprobs and not plan.top_ids:
        # Names only the proxy sees (the client gets ``logprobs: null``): token IDs need
        # no detokenising, and vLLM started with ``skip_tokenizer_init`` refuses logprobs
        # named by text ("Unable to get tokenizer", entrypoints/generate/base/serving.py).
        data["return_tokens_as_token_ids"] = True
    plan.sampling = {
        "temperature": float(data["temperature"]),
        "top_p": float(data["top_p"]),
        "top_k": int(data["top_k"]),
        "min_p": float(data["min_p"]),
        "repetition_penalty": float(data["repetition_penalty"]),
        "presence_penalty": float(data["presence_penalty"]),
        "frequency_penalty": float(data["frequency_penalty"]),
        "seed": int(data["seed"]),
        "stop_token_ids": list(data.get("stop_token_ids") or []),
        "ignore_eos": bool(data.get("ignore_eos") or False),
    }
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8"), plan


# ---------------------------------------------------------------------------- response
def _token_id(name: Any) -> int | None:
    """``"token_id:123"`` -> 123 (vLLM's ``return_tokens_as_token_ids`` form)."""
    if isinstance(name, str) and name.startswith("token_id:"):
        rest = name[len("token_id:"):]
        if rest.isdigit():
            return int(rest)
    return None


def _chat_top_is_exact(step: list[tuple[int, float]], sampled: int | None, k: int, *,
                       greedy: bool) -> bool:
    """Whether a chat step's ``top_logprobs`` are the k most likely tokens.

    vLLM 0.25 keeps per step a dict of the sampled token first, then the top k
    (vllm/logprobs.py:175-206, ``append_logprobs_for_next_position``), and chat lists its
    first k entries (chat_completion/serving.py:1093-1115, ``_get_top_logprobs``). So the
    list is the top k only when the sampled token is among them; when it ranks below k
    the list is the sampled token plus the top k-1. That shows when the sampled token
    (listed first) is more likely than some other entry (it ranks above k), or when
    sampling is greedy (it ranks first); otherwise (k = 1, or the sampled token is the
    least likely entry) the two cases look the same and nothing is recorded.
    """
    if len(step) != k or sampled is None or step[0][0] != sampled:
        return False
    if greedy:
        return True
    others = [lp for _, lp in step[1:]]
    return bool(others) and step[0][1] > min(others)


@dataclass
class _Sequence:
    """Token IDs and logprobs of one choice, gathered from a body or from stream chunks."""

    prompt_token_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    top: list[list[tuple[int, float]]] | None = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    saw_token_ids: bool = False

    def add_tokens(self, ids: Any) -> None:
        if isinstance(ids, list) and all(map(_is_int, ids)):
            self.token_ids += ids
            self.saw_token_ids = True

    def add_logprobs(self, plan: Plan, logprobs: Any) -> None:
        """Append a logprobs object (whole, or a stream chunk's part)."""
        if self.logprobs is None:
            return
        steps: list[tuple[Any, list[tuple[Any, Any]]]] = []
        sampled: list[int | None] = []          # chat: the sampled token of each step
        if plan.kind == "completion":
            if not isinstance(logprobs, dict):
                self.logprobs = self.top = None
                return
            chosen = logprobs.get("token_logprobs") or []
            tops = logprobs.get("top_logprobs") or [None] * len(chosen)
            if not isinstance(chosen, list) or not isinstance(tops, list) \
                    or len(tops) != len(chosen):
                self.logprobs = self.top = None
                return
            for lp, alternatives in zip(chosen, tops, strict=True):
                pairs = list(alternatives.items()) if isinstance(alternatives, dict) else []
                steps.append((lp, pairs))
        else:
            content = logprobs.get("content") if isinstance(logprobs, dict) else None
            if not isinstance(content, list):
                self.logprobs = self.top = None
                return
            for entry in content:
                if not isinstance(entry, dict):
                    self.logprobs = self.top = None
                    return
                alternatives = entry.get("top_logprobs") or []
                pairs = [(a.get("token"), a.get("logprob")) for a in alternatives
                         if isinstance(a, dict)]
                steps.append((entry.get("logprob"), pairs))
                sampled.append(_token_id(entry.get("token")))
        for position, (lp, pairs) in enumerate(steps):
            if not _is_number(lp) or lp == CLAMPED_LOGPROB:
                self.logprobs = self.top = None
                return
            self.logprobs.append(float(lp))
            if self.top is not None:
                if not (plan.top_ids and plan.top_k > 0):
                    self.top = None
                    continue
                step: list[tuple[int, float]] = []
                for name, value in pairs:
                    tid = _token_id(name)
                    if tid is None or not _is_number(value) or value == CLAMPED_LOGPROB:
                        self.top = None
                        break
                    step.append((tid, float(value)))
                if self.top is not None and plan.kind == "chat" and not _chat_top_is_exact(
                        step, sampled[position], plan.top_k,
                        greedy=plan.sampling.get("temperature") == 0):
                    self.top = None
                if self.top is not None:
                    # best first, ties to the smaller id (the reference engine's order);
                    # completions also list the sampled token: keep the top k only
                    step = sorted(set(step), key=lambda p: (-p[1], p[0]))[:plan.top_k]
                    self.top.append(step)

    def captured(self, plan: Plan, request_id: str) -> Captured | None:
        if self.prompt_token_ids is None or not self.saw_token_ids:
            return None
        finish = self.finish_reason
        if finish == "tool_calls":
            finish = "stop"                     # a tool call ends on EOS / a stop token
        if finish not in ("stop", "length"):
            return None
        n = len(self.token_ids)
        stop_string = finish == "stop" and isinstance(self.stop_reason, str)
        if stop_string:
            finish = "length"
        requested = plan.requested_max_tokens
        tightest = finish == "length" or requested is None or requested < n
        max_tokens = n if tightest else requested
        logprobs = self.logprobs if self.logprobs is not None and len(self.logprobs) == n \
            else None
        top = self.top if logprobs is not None and self.top is not None \
            and len(self.top) == n else None
        sampling = {**plan.sampling, "max_tokens": max_tokens,
                    "logprobs": plan.top_k if top is not None else
                    (0 if logprobs is not None else None)}
        return Captured(request_id=request_id, prompt_token_ids=list(self.prompt_token_ids),
                        token_ids=list(self.token_ids), finish_reason=finish,
                        sampling=sampling, logprobs=logprobs, top_logprobs=top,
                        stop_string=stop_string, data_subject=plan.data_subject)


def _choice_request_id(response_id: Any, index: int, choices: int) -> str | None:
    if not isinstance(response_id, str) or not response_id:
        return None
    return response_id if choices == 1 else f"{response_id}-{index}"


def _added_members(choice: dict[str, jsonedit.Member], plan: Plan) -> list[jsonedit.Member]:
    """The members of a choice that the proxy added to the request (so the client, which
    did not ask for them, gets them as null)."""
    asked = {"token_ids": plan.added_token_ids,
             "prompt_token_ids": plan.added_token_ids and plan.kind == "completion",
             "logprobs": plan.added_logprobs}
    return [m for name, wanted in asked.items()
            if wanted and (m := choice.get(name)) is not None and m.value is not None]


def edit_response(plan: Plan, body: bytes) -> tuple[bytes, list[Captured]]:
    """The client's body (the upstream's bytes, asked-for members nulled) and what to record.

    A body that is not the expected JSON passes through unchanged and records nothing.
    """
    try:
        scanned = jsonedit.scan(body.decode("utf-8"))
    except (UnicodeDecodeError, jsonedit.JSONEditError):
        return body, []
    nulls: list[jsonedit.Member] = []
    top_prompt = scanned.members.get("prompt_token_ids")
    if plan.added_token_ids and top_prompt is not None and top_prompt.value is not None:
        nulls.append(top_prompt)
    captured: list[Captured] = []
    for position, choice in enumerate(scanned.choices):
        seq = _Sequence()
        prompt = choice.get("prompt_token_ids") if plan.kind == "completion" else top_prompt
        if prompt is not None and isinstance(prompt.value, list) \
                and all(map(_is_int, prompt.value)):
            seq.prompt_token_ids = prompt.value
        if "token_ids" in choice:
            seq.add_tokens(choice["token_ids"].value)
        if "logprobs" in choice:
            seq.add_logprobs(plan, choice["logprobs"].value)
        else:
            seq.logprobs = seq.top = None
        seq.finish_reason = choice["finish_reason"].value if "finish_reason" in choice else None
        seq.stop_reason = choice["stop_reason"].value if "stop_reason" in choice else None
        nulls += _added_members(choice, plan)
        index = choice["index"].value if "index" in choice else position
        rid = _choice_request_id(scanned.value("id"), index if _is_int(index) else position,
                                 len(scanned.choices))
        if plan.recordable and rid is not None:
            got = seq.captured(plan, rid)
            if got is not None:
                captured.append(got)
    if not nulls:
        return body, captured
    return jsonedit.null_values(scanned.text, nulls).encode("utf-8"), captured


class StreamEditor:
    """Edits an SSE stream event by event (fed in arbitrary byte pieces) and gathers each
    choice's tokens; :meth:`captured` gives the sequences once the stream has ended."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._buffer = b""
        self._response_id: str | None = None
        self._sequences: dict[int, _Sequence] = {}
        self._chat_prompt: list[int] | None = None
        self.done = False                       # saw "data: [DONE]"
        self.broken: str | None = None          # why the stream cannot be recorded

    def feed(self, data: bytes) -> bytes:
        self._buffer += data
        out: list[bytes] = []
        while True:
            cut, sep = _event_end(self._buffer)
            if cut < 0:
                break
            event, self._buffer = self._buffer[:cut], self._buffer[cut + sep:]
            edited = self._event(event)
            if edited is not None:
                out.append(edited + self._separator(sep))
        return b"".join(out)

    def finish(self) -> bytes:
        """Whatever is left in the buffer (an incomplete event), unchanged."""
        rest, self._buffer = self._buffer, b""
        if rest.strip():
            self.broken = self.broken or "the stream ended inside an event"
        return rest

    @staticmethod
    def _separator(length: int) -> bytes:
        return b"\n\n" if length == 2 else b"\r\n\r\n"

    def _event(self, event: bytes) -> bytes | None:
        if not event.startswith(b"data:") or b"\n" in event:
            return event                        # comments, other fields: pass through
        payload = event[5:].lstrip(b" ")
        if payload.strip() == b"[DONE]":
            self.done = True
            return event
        try:
            scanned = jsonedit.scan(payload.decode("utf-8"))
        except (UnicodeDecodeError, jsonedit.JSONEditError):
            self.broken = self.broken or "a stream event is not a JSON object"
            return event
        if "error" in scanned.members:
            self.broken = self.broken or "the upstream reported an error in the stream"
            return event
        return self._chunk(event, payload, scanned)

    def _chunk(self, event: bytes, payload: bytes,
               scanned: jsonedit.Scanned) -> bytes | None:
        plan = self.plan
        rid = scanned.value("id")
        if isinstance(rid, str):
            self._response_id = self._response_id or rid
        nulls: list[jsonedit.Member] = []
        top_prompt = scanned.members.get("prompt_token_ids")
        if top_prompt is not None and top_prompt.value is not None:
            if isinstance(top_prompt.value, list) and all(map(_is_int, top_prompt.value)):
                self._chat_prompt = top_prompt.value
            if plan.added_token_ids:
                nulls.append(top_prompt)
        droppable = plan.kind == "chat" and bool(scanned.choices) and plan.added_token_ids
        for choice in scanned.choices:
            index = choice["index"].value if "index" in choice else 0
            seq = self._sequences.setdefault(index if _is_int(index) else 0, _Sequence())
            prompt = choice.get("prompt_token_ids")
            if prompt is not None and isinstance(prompt.value, list) \
                    and all(map(_is_int, prompt.value)):
                seq.prompt_token_ids = prompt.value
            if "token_ids" in choice:
                seq.add_tokens(choice["token_ids"].value)
            lp = choice.get("logprobs")
            if lp is not None and lp.value is not None:
                seq.add_logprobs(plan, lp.value)
            elif "token_ids" in choice and choice["token_ids"].value:
                seq.logprobs = seq.top = None   # tokens without their logprobs
            finish = choice.get("finish_reason")
            if finish is not None and finish.value is not None:
                seq.finish_reason = finish.value
                stop = choice.get("stop_reason")
                seq.stop_reason = stop.value if stop is not None else None
            nulls += _added_members(choice, plan)
            delta = choice.get("delta")
            if not (delta is not None and delta.value == {} and
                    (finish is None or finish.value is None)):
                droppable = False
        if droppable:
            # vLLM sends a chunk with an empty delta before the last one only because token
            # IDs were asked for (a tool/reasoning parser held the text back; 0.25:
            # chat_completion/serving.py:632-640, whatever logprobs say): the client, who
            # did not ask for them, would not have received it.
            return None
        if not nulls:
            return event
        edited = jsonedit.null_values(scanned.text, nulls).encode("utf-8")
        return event[:len(event) - len(payload)] + edited

    def captured(self) -> list[Captured]:
        if not self.plan.recordable or self.broken or self._response_id is None:
            return []
        out: list[Captured] = []
        for index, seq in sorted(self._sequences.items()):
            if self.plan.kind == "chat":
                seq.prompt_token_ids = self._chat_prompt
            rid = _choice_request_id(self._response_id, index, len(self._sequences))
            got = seq.captured(self.plan, rid) if rid is not None else None
            if got is not None:
                out.append(got)
        return out


def _event_end(buffer: bytes) -> tuple[int, int]:
    """(index, separator length) of the first event boundary, or (-1, 0)."""
    lf, crlf = buffer.find(b"\n\n"), buffer.find(b"\r\n\r\n")
    if lf < 0 and crlf < 0:
        return -1, 0
    if crlf < 0 or (0 <= lf < crlf):
        return lf, 2
    return crlf, 4
