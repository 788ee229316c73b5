"""Registered tokenizers: token IDs shown as text in the console.

An admin registers a ``tokenizer.json`` (the Hugging Face ``tokenizers`` format); it is
stored under the SHA-256 of its bytes, which is what an envelope names in
``artifacts.tokenizer_sha256``. Before a tokenizer is used its bytes are hashed again, so
a row edited in the database decodes nothing (the page says why). Decoding is display
only: every verdict is computed on token IDs, never on this text.

The ``tokenizers`` library is Rust with Python bindings: no torch in the API process.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from ledger.core.errors import ValidationFailed
from ledger.db.models import Tokenizer
from ledger.services import audit
from ledger.services.apikeys import Principal

MAX_TOKENIZER_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Piece:
    """One token as shown: its ID and the text it adds (``""`` while a multi-byte
    character is incomplete; the rest of it shows on a later token)."""

    token_id: int
    text: str


@dataclass(frozen=True, slots=True)
class Decoded:
    pieces: list[Piece] | None
    reason: str | None = None      # why there is no text (unregistered, tampered, ...)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces or [])


def _load(content: bytes) -> Any:
    from tokenizers import Tokenizer as HfTokenizer

    try:
        return HfTokenizer.from_str(content.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - the library raises bare Exceptions on bad JSON
        raise ValidationFailed(f"not a tokenizers tokenizer.json: {str(exc)[:200]}",
                               code="invalid_tokenizer") from None


def register(session: Session, content: bytes, *, name: str,
             principal: Principal) -> tuple[Tokenizer, bool]:
    """Store ``content`` under its SHA-256; (row, created). Recorded in the audit trail."""
    if not content or len(content) > MAX_TOKENIZER_BYTES:
        raise ValidationFailed(f"tokenizer.json must be 1 to {MAX_TOKENIZER_BYTES} bytes",
                               code="invalid_tokenizer")
    tok = _load(content)
    digest = hashlib.sha256(content).hexdigest()
    result = session.execute(insert(Tokenizer).values(
        tokenizer_sha256=digest, content=content, name=name[:200] or digest[:12],
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        registered_by=f"{principal.name} ({principal.role})",
    ).on_conflict_do_nothing(index_elements=["tokenizer_sha256"])
        .returning(Tokenizer.tokenizer_sha256))
    created = result.first() is not None
    if created:
        audit.record(session, principal, "tokenizer.register", digest, name=name[:200])
    row = session.get(Tokenizer, digest)
    assert row is not None
    return row, created


def list_tokenizers(session: Session) -> list[Tokenizer]:
    return list(session.scalars(select(Tokenizer).order_by(Tokenizer.registered_at)))


class _Cache:
    """Loaded tokenizers by digest (a few; loading a large tokenizer.json costs ~100 ms)."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._items: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, digest: str) -> Any:
        with self._lock:
            if digest in self._items:
                self._items.move_to_end(digest)
                return self._items[digest]
        return None

    def put(self, digest: str, tok: Any) -> None:
        with self._lock:
            self._items[digest] = tok
            while len(self._items) > self.size:
                self._items.popitem(last=False)


_CACHE = _Cache()


def tokenizer_for(session: Session, digest: str | None) -> tuple[Any, str | None]:
    """(tokenizer, None) or (None, the reason there is none)."""
    if digest is None:
        return None, "this record names no tokenizer (artifacts.tokenizer_sha256 is null)"
    tok = _CACHE.get(digest)
    if tok is not None:
        return tok, None
    content = session.scalar(select(Tokenizer.content).where(
        Tokenizer.tokenizer_sha256 == digest))
    if content is None:
        return None, (f"tokenizer {digest[:12]}… is not registered: an admin can register "
                      "its tokenizer.json on the Tokenizers page")
    content = bytes(content)
    if hashlib.sha256(content).hexdigest() != digest:
        return None, (f"the stored tokenizer {digest[:12]}… does not hash to its name: "
                      "the row was altered, nothing is decoded")
    try:
        tok = _load(content)
    except ValidationFailed as exc:
        return None, str(exc)
    _CACHE.put(digest, tok)
    return tok, None


def decode(tok: Any, token_ids: list[int]) -> list[Piece]:
    """Each token with the text it adds, so the pieces join to the whole text (a token
    that ends inside a multi-byte character adds nothing until the character is whole)."""
    from tokenizers.decoders import DecodeStream

    vocab = tok.get_vocab_size(with_added_tokens=True)
    stream = DecodeStream(skip_special_tokens=False)
    out = []
    for t in token_ids:
        if not 0 <= t < vocab:
            out.append(Piece(t, "\N{REPLACEMENT CHARACTER}"))
            continue
        try:
            text = stream.step(tok, t)
        except Exception:  # noqa: BLE001 - a token the decoder cannot place
            text = "\N{REPLACEMENT CHARACTER}"
        out.append(Piece(t, text or ""))
    return out


def token_text(tok: Any, token_id: int) -> str:
    """One token on its own: its text, or its vocabulary entry when it is part of a
    character (a lone UTF-8 byte decodes to U+FFFD, which would hide which byte it is)."""
    text = tok.decode([token_id], skip_special_tokens=False)
    if "\N{REPLACEMENT CHARACTER}" in text or not text:
        raw = tok.id_to_token(token_id)
        if raw:
            inverse = _unicode_to_bytes()
            if all(c in inverse for c in raw):  # byte-level BPE: the bytes it stands for
                return "<" + " ".join(f"0x{inverse[c]:02X}" for c in raw) + ">"
            return str(raw)
    return str(text)


def _unicode_to_bytes() -> dict[str, int]:
    return {ch: b for b, ch in _bytes_to_unicode().items()}


def decoded(session: Session, digest: str | None, token_ids: list[int]) -> Decoded:
    tok, reason = tokenizer_for(session, digest)
    if tok is None:
        return Decoded(None, reason)
    return Decoded(decode(tok, token_ids))


# --- the tiny-demo model's tokenizer -------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte value (what ByteLevel decoding reverses)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_level_tokenizer_json(tokens: Mapping[int, str], special: Iterable[int] = ()) -> bytes:
    """A ``tokenizer.json`` whose ids 0-255 are the byte values and ``tokens`` the rest
    (``special``: the ids marked special, e.g. BOS and EOS), built the same way every time
    (sorted keys, no spaces), so its SHA-256 is stable. Text encodes byte by byte."""
    special = set(special)
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab.update({content: i for i, content in tokens.items()})
    doc: dict[str, Any] = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": tokens[i], "single_word": False,
                          "lstrip": False, "rstrip": False, "normalized": False,
                          "special": True} for i in sorted(special)],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                          "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def tiny_demo_tokenizer_json() -> bytes:
    """tiny-demo's vocabulary (ids 0-255 the byte values, 256-259 ``<bos>``, ``<eos>``,
    ``<pad>``, ``<unk>``: :mod:`workers.serve.tokenizer`) as a ``tokenizer.json``."""
    specials = {256 + i: s for i, s in enumerate(["<bos>", "<eos>", "<pad>", "<unk>"])}
    return byte_level_tokenizer_json(specials, specials)


TINY_DEMO_TOKENIZER_SHA256 = hashlib.sha256(tiny_demo_tokenizer_json()).hexdigest()
