"""What ``ledger demo`` needs from the console: readable records.

tiny-demo ships no ``tokenizer.json`` (its vocabulary is the 256 byte values and four
special tokens, :mod:`workers.serve.tokenizer`), and its directory is hashed into the
published ``model_sha256``, so none is added there. The demo instead registers the same
vocabulary as a ``tokenizers`` file built deterministically
(:func:`ledger.console.tokenizers.tiny_demo_tokenizer_json`) and names it in its records'
``artifacts.tokenizer_sha256``, as a gateway with a real tokenizer would.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from ledger.console import tokenizers
from ledger.db.session import session_scope
from ledger.services.apikeys import Principal

DEMO_ADMIN = Principal("demo", "demo", "admin")


def readable_demo_artifacts(db: Engine, artifacts: dict[str, Any]) -> dict[str, Any]:
    """Register tiny-demo's tokenizer; ``artifacts`` naming it."""
    with session_scope(db) as session:
        tokenizers.register(session, tokenizers.tiny_demo_tokenizer_json(),
                            name="tiny-demo (bytes + 4 specials)", principal=DEMO_ADMIN)
    return {**artifacts, "tokenizer_sha256": tokenizers.TINY_DEMO_TOKENIZER_SHA256}
