"""A byte-level tokenizer and a trivial chat template for the ``tiny-demo`` model.

tiny-demo's vocabulary is the 256 byte values (ids 0-255) plus ``<bos>`` (256), ``<eos>``
(257), ``<pad>`` (258) and ``<unk>`` (259). Text is encoded as its UTF-8 bytes, so every
string has exactly one token sequence and decoding is exact (invalid UTF-8 in generated
bytes decodes to U+FFFD, as ``bytes.decode(errors="replace")`` does).

The chat template is deliberately plain (the model is random; it exists to exercise the
serving path): ``<bos>`` then ``"{role}: {content}\\n"`` per message, then ``"assistant: "``
when a generation prompt is asked for. :data:`CHAT_TEMPLATE` is its Jinja text, so its
SHA-256 can be published like any model's ``chat_template.jinja``; the rendering below is
the same thing in Python (no Jinja dependency at serve time).
"""

from __future__ import annotations

import codecs
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

BOS, EOS, PAD, UNK = 256, 257, 258, 259
VOCAB_SIZE = 260
SPECIAL_TOKENS = {BOS: "<bos>", EOS: "<eos>", PAD: "<pad>", UNK: "<unk>"}

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
CHAT_TEMPLATE_SHA256 = hashlib.sha256(CHAT_TEMPLATE.encode("utf-8")).hexdigest()


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus tiny-demo's four special tokens."""

    vocab_size = VOCAB_SIZE
    bos_token_id = BOS
    eos_token_id = EOS

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS, *ids] if add_special_tokens else ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (special tokens stand for none)."""
        return bytes((token_id,)) if 0 <= token_id < 256 else b""

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for t in ids:
            if 0 <= t < 256:
                out.append(t)
            elif not skip_special_tokens:
                out += SPECIAL_TOKENS.get(t, "<unk>").encode()
        return out.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """One token shown on its own (logprobs ``token`` strings), like
        ``tokenizer.decode([id])`` in vLLM: a lone non-ASCII byte shows as U+FFFD."""
        if 0 <= token_id < 256:
            return bytes((token_id,)).decode("utf-8", errors="replace")
        return SPECIAL_TOKENS.get(token_id, "<unk>")

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of the rendered :data:`CHAT_TEMPLATE` (content must be text)."""
        parts: list[str] = []
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str):
                raise ValueError(f"messages[{i}].role must be a string")
            content = _text_content(content, i)
            last = i == len(messages) - 1
            parts.append(f"{role}: {content}" if continue_final_message and last
                         else f"{role}: {content}\n")
        if add_generation_prompt and not continue_final_message:
            parts.append("assistant: ")
        return [BOS, *"".join(parts).encode("utf-8")]


def _text_content(content: Any, index: int) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ValueError(f"messages[{index}].content: only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"messages[{index}].content must be a string or a list of text parts")


class IncrementalDecoder:
    """Text deltas for a growing token sequence, holding back incomplete UTF-8 sequences
    (vLLM's incremental detokenizer does the same), so the deltas join to ``decode(ids)``."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int, *, final: bool = False) -> str:
        return self._utf8.decode(self._tok.token_bytes(token_id), final=final)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
