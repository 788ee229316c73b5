"""``dsse.keyids_named``: the key IDs a single POST's signing keys are read ahead for
(a hint only: ``ReadKeys.keyring`` refuses to answer for a key ID it did not look up, and
the route then reads it)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from ledger.core import dsse
from ledger.core.keys import generate_private_key
from ledger.producer import envelope_to_json
from ledger.services.keys import ReadKeys, TrustedKey

A, B = "a" * 64, "0123456789abcdef" * 4


def test_finds_the_keyids_a_compact_envelope_names() -> None:
    keys = [generate_private_key(), generate_private_key()]
    signed = envelope_to_json(dsse.sign_envelope(b"{}", keys))
    compact = json.dumps(signed, separators=(",", ":")).encode()
    assert dsse.keyids_named(compact) == [s["keyid"] for s in signed["signatures"]]
    # what the search cannot see it leaves out (the route reads those keys afterwards)
    assert dsse.keyids_named(json.dumps(signed, indent=2).encode()) == []


def test_takes_only_64_lowercase_hex_and_at_most_eight() -> None:
    def named(kid: str) -> bytes:
        return b'{"keyid":"' + kid.encode() + b'"}'

    assert dsse.keyids_named(named(A)) == [A]
    for bad in (A[:63], A.upper(), "g" * 64, A + "0"):
        assert dsse.keyids_named(named(bad)) == [], bad
    many = b",".join(named(B) for _ in range(20))
    assert dsse.keyids_named(many) == [B] * dsse.MAX_SIGNATURES
    # only the first marks are looked at, found or not: bounded work for any body
    decoys = b",".join(named("x" * 64) for _ in range(dsse.MAX_SIGNATURES))
    assert dsse.keyids_named(decoys + b"," + named(A)) == []
    assert dsse.keyids_named(b'"keyid":"' * 500_000) == []
    assert dsse.keyids_named(b"") == [] and dsse.keyids_named(b'"keyid":"') == []


def test_read_keys_answer_only_for_key_ids_they_looked_up() -> None:
    now = datetime.now(UTC)
    row = TrustedKey(A, b"\x01" * 32, "producer", "active", now, None)
    read = ReadKeys(frozenset({A, B}), (row,), now)
    ring = read.keyring({A}, purpose="producer")
    assert ring is not None and ring.public_key_for(A) == row.public_key
    unregistered = read.keyring({B}, purpose="producer")  # looked up, not found
    assert unregistered is not None and unregistered.not_before() == {}
    assert read.keyring({A, "c" * 64}, purpose="producer") is None  # not looked up
