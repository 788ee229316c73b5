"""cosignature/v1 lines made by ledger.core.cosignature, checked by the spec's second
implementation (spec_cosig), and the quorum check of the trust policy."""

from __future__ import annotations

import base64

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.core.cosignature import (
    CosignatureError,
    QuorumError,
    append_signature_lines,
    check_quorum,
    cosignature_message,
    format_witness_signer_key,
    generate_witness_key,
    parse_cosignature_line,
    parse_witness_signer_key,
    sign_cosignature,
    verified_witnesses,
)
from ledger.core.keys import public_raw
from ledger.core.note import (
    Checkpoint,
    NoteVerifier,
    format_checkpoint,
    open_note,
    sign_checkpoint,
    sign_note,
)
from ledger.core.trust import TrustPolicy, WitnessKey, parse_witness_key
from tests.witness import spec_cosig

ORIGIN = "ledger.test/log"
LOG_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
W1 = Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33)))
W2 = Ed25519PrivateKey.from_private_bytes(bytes(range(2, 34)))


def _note(size: int = 5, root: bytes = b"\x11" * 32) -> bytes:
    return sign_checkpoint(Checkpoint(ORIGIN, size, root), ORIGIN, LOG_KEY)


def _text(note: bytes) -> str:
    return spec_cosig.note_parts(note)[0]


def _policy(quorum: int, *keys: tuple[str, Ed25519PrivateKey]) -> TrustPolicy:
    return TrustPolicy(ORIGIN, (NoteVerifier.from_public_key(ORIGIN, public_raw(LOG_KEY)),),
                       (), tuple(WitnessKey.from_public_key(n, public_raw(k)) for n, k in keys),
                       quorum)


def test_message_is_exactly_the_spec_example_shape() -> None:
    text = "example.com/behind-the-sofa\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n"
    assert cosignature_message(text, 1679315147) == (
        b"cosignature/v1\ntime 1679315147\n" + text.encode())
    assert cosignature_message(text, 1679315147) == spec_cosig.signed_message(text, 1679315147)
    with pytest.raises(CosignatureError):
        cosignature_message(text, -1)
    with pytest.raises(CosignatureError):
        cosignature_message(text, 2**63)
    with pytest.raises(CosignatureError):
        cosignature_message(text.rstrip("\n"), 1)


@given(name=st.from_regex(r"[a-z0-9./-]{1,40}", fullmatch=True),
       timestamp=st.integers(0, 2**63 - 1), size=st.integers(0, 2**40),
       root=st.binary(min_size=32, max_size=32),
       extensions=st.lists(st.from_regex(r"[A-Za-z0-9 =:]{1,20}", fullmatch=True), max_size=2))
@settings(max_examples=60, deadline=None)
def test_our_lines_verify_under_the_spec_implementation(
        name: str, timestamp: int, size: int, root: bytes, extensions: list[str]) -> None:
    text = format_checkpoint(Checkpoint(ORIGIN, size, root, tuple(extensions)))
    note = append_signature_lines(sign_note(text, ORIGIN, LOG_KEY),
                                  [sign_cosignature(text, name, W1, timestamp)])
    assert spec_cosig.verify(note, name, public_raw(W1)) == timestamp
    # the key IDs agree, and so do the vkeys
    ours = WitnessKey.from_public_key(name, public_raw(W1))
    assert ours.key_id.to_bytes(4, "big") == spec_cosig.key_id(name, public_raw(W1))
    assert ours.verifier_key == spec_cosig.vkey(name, public_raw(W1))
    assert parse_witness_key(spec_cosig.vkey(name, public_raw(W1))) == ours


def test_line_layout_and_a_flipped_bit_fails_both_implementations() -> None:
    note = _note()
    line = sign_cosignature(_text(note), "witness.test/w1", W1, 1_700_000_000)
    assert line.startswith("\u2014 witness.test/w1 ")
    blob = base64.b64decode(line.split(" ")[2])
    assert len(blob) == 76
    assert blob[:4] == spec_cosig.key_id("witness.test/w1", public_raw(W1))
    assert int.from_bytes(blob[4:12], "big") == 1_700_000_000
    cosig = parse_cosignature_line(line)
    assert cosig.line == line and cosig.timestamp == 1_700_000_000
    for i in (5, 20, 75):  # timestamp, signature
        bad = bytearray(blob)
        bad[i] ^= 1
        bad_line = "\u2014 witness.test/w1 " + base64.b64encode(bytes(bad)).decode()
        bad_note = append_signature_lines(note, [bad_line])
        with pytest.raises(InvalidSignature):
            spec_cosig.verify(bad_note, "witness.test/w1", public_raw(W1))
        with pytest.raises(CosignatureError):
            verified_witnesses(bad_note, [WitnessKey.from_public_key("witness.test/w1",
                                                                      public_raw(W1))])


def test_cosigned_note_still_opens_under_the_log_key_alone() -> None:
    note = _note()
    cosigned = append_signature_lines(note, [sign_cosignature(_text(note), "w.test/a", W1, 7)])
    opened = open_note(cosigned, [NoteVerifier.from_public_key(ORIGIN, public_raw(LOG_KEY))])
    assert opened.text == _text(note)
    assert len(opened.unverified) == 1  # the cosignature: an unknown key to a log-only reader


def test_quorum_one_rejects_without_and_accepts_with_a_valid_cosignature() -> None:
    policy = _policy(1, ("witness.test/w1", W1))
    note = _note()
    with pytest.raises(QuorumError):
        check_quorum(note, policy)
    # a cosignature by a witness the policy does not name does not count
    stranger = append_signature_lines(note, [sign_cosignature(_text(note), "witness.test/w2",
                                                              W2, 10)])
    with pytest.raises(QuorumError):
        check_quorum(stranger, policy)
    # nor does one by the right witness name signed with another key
    impostor = append_signature_lines(note, [sign_cosignature(_text(note), "witness.test/w1",
                                                              W2, 10)])
    with pytest.raises(QuorumError):
        check_quorum(impostor, policy)
    # nor one over another checkpoint
    other = _note(6)
    moved = append_signature_lines(note, [sign_cosignature(_text(other), "witness.test/w1",
                                                           W1, 10)])
    with pytest.raises(CosignatureError):
        check_quorum(moved, policy)
    good = append_signature_lines(note, [sign_cosignature(_text(note), "witness.test/w1",
                                                          W1, 10)])
    assert check_quorum(good, policy) == ["witness.test/w1"]
    assert check_quorum(note, _policy(0)) == []


def test_quorum_counts_distinct_witnesses() -> None:
    policy = _policy(2, ("witness.test/w1", W1), ("witness.test/w2", W2))
    note = _note()
    one = sign_cosignature(_text(note), "witness.test/w1", W1, 10)
    twice = append_signature_lines(note, [one, sign_cosignature(_text(note), "witness.test/w1",
                                                                 W1, 11)])
    with pytest.raises(QuorumError):
        check_quorum(twice, policy)
    both = append_signature_lines(note, [one, sign_cosignature(_text(note), "witness.test/w2",
                                                                W2, 12)])
    assert sorted(check_quorum(both, policy)) == ["witness.test/w1", "witness.test/w2"]


def test_signer_key_round_trip_and_checks() -> None:
    skey, vkey = generate_witness_key("witness.test/w9")
    signer = parse_witness_signer_key(skey)
    assert signer.key.verifier_key == vkey
    name, pub = spec_cosig.parse_vkey(vkey)
    assert (name, pub) == ("witness.test/w9", signer.key.public_key)
    assert parse_witness_signer_key(format_witness_signer_key("a.test", W1)).name == "a.test"
    wrong_id = skey.split("+")
    wrong_id[3] = "00000000"
    with pytest.raises(CosignatureError):
        parse_witness_signer_key("+".join(wrong_id))
    with pytest.raises(CosignatureError):
        parse_witness_signer_key(skey.replace("PRIVATE", "PUBLIC"))
