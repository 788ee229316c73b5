"""Go's golang.org/x/mod/sumdb/note still opens a checkpoint carrying cosignature/v1 lines
under the log key alone (skipped without the Go toolchain, like tests/interop)."""

from __future__ import annotations

import base64
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.core.cosignature import append_signature_lines, sign_cosignature
from ledger.core.merkle import leaf_hash, root_hash
from ledger.core.note import Checkpoint, format_checkpoint, format_verifier_key, sign_checkpoint
from tests.interop.test_go_tlog import run_items, tlogcheck  # noqa: F401 - fixture

ORIGIN = "ledger.test/go-cosigned"
LOG_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(7, 39)))


def test_go_opens_a_cosigned_checkpoint(tlogcheck: Path) -> None:  # noqa: F811
    tree = [leaf_hash(b"%d" % i) for i in range(9)]
    cp = Checkpoint(ORIGIN, 9, root_hash(tree))
    note = sign_checkpoint(cp, ORIGIN, LOG_KEY)
    text = format_checkpoint(cp)
    cosigned = append_signature_lines(note, [
        sign_cosignature(text, "witness.test/a", Ed25519PrivateKey.generate(), 1_700_000_000),
        sign_cosignature(text, "witness.test/b", Ed25519PrivateKey.generate(), 1_700_000_001),
    ])
    item = {"name": "cosigned", "note": cosigned.decode(),
            "verifier_key": format_verifier_key(ORIGIN, LOG_KEY.public_key()),
            "origin": ORIGIN, "size": 9, "root": base64.b64encode(cp.root_hash).decode()}
    code, lines = run_items(tlogcheck, {"inclusion": [], "consistency": [],
                                        "checkpoints": [item]})
    assert code == 0, lines
    assert len(lines) == 1 and lines[0].startswith("OK ") and lines[0].endswith(" cosigned")
