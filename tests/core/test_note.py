"""C2SP signed notes and tlog-checkpoints: Go ``note`` golden vectors, strict parsing, and
rejection of every single-bit change to a signed checkpoint."""

from __future__ import annotations

import base64

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.core.errors import (
    CheckpointError,
    CheckpointOriginError,
    MalformedCheckpointError,
    MalformedNoteError,
    NoteSignatureError,
    UnverifiedNoteError,
)
from ledger.core.merkle import EMPTY_ROOT, leaf_hash
from ledger.core.note import (
    Checkpoint,
    NoteVerifier,
    format_checkpoint,
    format_signer_key,
    format_verifier_key,
    generate_signer_key,
    note_key_id,
    open_checkpoint,
    open_note,
    parse_checkpoint,
    parse_signer_key,
    parse_verifier_key,
    sign_checkpoint,
    sign_note,
)

# Golden vectors from golang.org/x/mod/sumdb/note (note_test.go, example_test.go).
PETER_SKEY = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz"
PETER_VKEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
ENOCH_VKEY = "EnochRoot+af0cfe78+ATtqJ7zOtqQtYqOo0CpvDXNlMhV3HeJDpjrASKGLWdop"
TEXT = (
    "If you think cryptography is the answer to your problem,\n"
    "then you don't know what your problem is.\n"
)
PETER_SIG = (
    "\u2014 PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngo"
    "tpRZb6KE6RyyBwJnAM=\n"
)
ENOCH_SIG = (
    "\u2014 EnochRoot rwz+eBzmZa0SO3NbfRGzPCpDckykFXSdeX+MNtCOXm2/5n2tiOHp+vAF1aGrQ5ovTG01oOTGwnWL"
    "ox33WWd1RvMc+QQ=\n"
)
PETER = parse_verifier_key(PETER_VKEY)
ENOCH = parse_verifier_key(ENOCH_VKEY)

LOG = "ledger.example/log"
LOG_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
LOG_VERIFIER = NoteVerifier.from_public_key(LOG, LOG_KEY.public_key())


def test_go_golden_keys() -> None:
    signer = parse_signer_key(PETER_SKEY)
    assert signer.key_id == PETER.key_id == 0xC74F20A3
    assert signer.verifier == PETER
    assert format_signer_key("PeterNeumann", signer.private_key) == PETER_SKEY
    assert format_verifier_key("PeterNeumann", PETER.public_key) == PETER_VKEY
    assert PETER.verifier_key == PETER_VKEY
    assert note_key_id("EnochRoot", ENOCH.public_key) == 0xAF0CFE78


def test_go_golden_signature() -> None:
    signer = parse_signer_key(PETER_SKEY)
    note = sign_note(TEXT, signer.name, signer.private_key)
    assert note == (TEXT + "\n" + PETER_SIG).encode()
    opened = open_note(note, [PETER])
    assert opened.text == TEXT
    assert [(s.name, s.key_id) for s in opened.signatures] == [("PeterNeumann", 0xC74F20A3)]


def test_go_golden_open() -> None:
    msg = (TEXT + "\n" + PETER_SIG + ENOCH_SIG).encode()
    one = open_note(msg, [PETER])
    assert [s.name for s in one.signatures] == ["PeterNeumann"]
    assert [s.line for s in one.unverified] == [ENOCH_SIG]
    both = open_note(msg, [PETER, ENOCH])
    assert [s.line for s in both.signatures] == [PETER_SIG, ENOCH_SIG]
    assert both.unverified == ()
    with pytest.raises(UnverifiedNoteError):
        open_note(msg, [])
    with pytest.raises(MalformedNoteError):  # more than 100 signatures
        open_note((TEXT + "\n" + PETER_SIG * 101).encode(), [PETER])
    bad = PETER_SIG[:60] + "ABCD" + PETER_SIG[60:]
    with pytest.raises(NoteSignatureError):
        open_note((TEXT + "\n" + bad).encode(), [PETER])
    # Repeated signatures collapse; an unknown key's bad signature is just unverified.
    enoch_bad = ENOCH_SIG[:60] + "ABCD" + ENOCH_SIG[60:]
    many = (TEXT + "\n" + PETER_SIG * 2 + ENOCH_SIG * 2 + enoch_bad).encode()
    opened = open_note(many, [PETER])
    assert len(opened.signatures) == 1
    assert [s.line for s in opened.unverified] == [ENOCH_SIG, enoch_bad]


@pytest.mark.parametrize(
    "msg",
    [
        TEXT,
        TEXT + "\n",
        TEXT + "\n" + PETER_SIG[:-1],
        "\x01" + TEXT + "\n" + PETER_SIG,
        TEXT + "\n" + PETER_SIG.replace("PeterNeumann", "Bad Name")[:-1],
        TEXT + "\n" + PETER_SIG + "Unexpected line.\n",
        TEXT + "\n" + PETER_SIG.replace("\u2014", "-"),
        TEXT + "\n" + PETER_SIG.replace("AM=", "AN="),  # non-canonical base64 (unused bits)
        TEXT + "\n" + "\u2014 PeterNeumann AAAA\n",  # shorter than key ID + 1 byte
        TEXT + "\r\n" + PETER_SIG,
    ],
)
def test_go_bad_messages(msg: str) -> None:
    with pytest.raises(MalformedNoteError):
        open_note(msg.encode(), [PETER])


def test_invalid_utf8_is_rejected() -> None:
    with pytest.raises(MalformedNoteError):
        open_note(b"\xff" + (TEXT + "\n" + PETER_SIG).encode(), [PETER])


def test_verifier_key_manglings_are_rejected() -> None:
    """Like Go's TestNewVerifier: every proper substring and every byte+1 fails."""
    for i in range(len(PETER_VKEY) + 1):
        for j in range(i + 1, len(PETER_VKEY) + 1):
            if (i, j) != (0, len(PETER_VKEY)):
                with pytest.raises(MalformedNoteError):
                    parse_verifier_key(PETER_VKEY[i:j])
    for i in range(len(PETER_VKEY)):
        mangled = PETER_VKEY[:i] + chr(ord(PETER_VKEY[i]) + 1) + PETER_VKEY[i + 1 :]
        with pytest.raises(MalformedNoteError):
            parse_verifier_key(mangled)
    for i in range(len(PETER_SKEY)):
        mangled = PETER_SKEY[:i] + chr(ord(PETER_SKEY[i]) + 1) + PETER_SKEY[i + 1 :]
        with pytest.raises(MalformedNoteError):
            parse_signer_key(mangled)
    # Go's wrong-length and unknown-algorithm keys, with adjusted key IDs.
    for bad in (
        "PeterNeumann+cc469956+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TWBADKEY==",
        "PeterNeumann+173116ae+ZRpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",
    ):
        with pytest.raises(MalformedNoteError):
            parse_verifier_key(bad)


def test_generated_keys_round_trip() -> None:
    skey, vkey = generate_signer_key("example.com/log42")
    signer, verifier = parse_signer_key(skey), parse_verifier_key(vkey)
    assert signer.verifier == verifier
    note = sign_note("hello\n", signer.name, signer.private_key)
    assert open_note(note, [verifier]).text == "hello\n"
    with pytest.raises(UnverifiedNoteError):
        open_note(note, [PETER])


@pytest.mark.parametrize("name", ["", "a b", "a+b", "a\u00a0b", "a\u3000b", "a\nb"])
def test_key_names(name: str) -> None:
    with pytest.raises(MalformedNoteError):
        sign_note("x\n", name, LOG_KEY)


def test_note_text_rules() -> None:
    for text in ("no newline", "tab\there\n", ""):
        with pytest.raises(MalformedNoteError):
            sign_note(text, LOG, LOG_KEY)
    # The text may contain blank lines: signatures follow the *last* blank line.
    note = sign_note("a\n\nb\n", LOG, LOG_KEY)
    assert open_note(note, [LOG_VERIFIER]).text == "a\n\nb\n"


def test_every_signature_by_a_known_key_must_verify() -> None:
    """Stricter than Go (which checks only the first of repeated signatures by a key)."""
    note = sign_note(TEXT, LOG, LOG_KEY).decode()
    sig_line = note[len(TEXT) + 1 :]
    raw = base64.b64decode(sig_line.split(" ")[2])
    forged = raw[:4] + bytes(64)
    bad_line = f"\u2014 {LOG} {base64.b64encode(forged).decode()}\n"
    with pytest.raises(NoteSignatureError):
        open_note((note + bad_line).encode(), [LOG_VERIFIER])


def test_ambiguous_verifiers() -> None:
    other = NoteVerifier(LOG, LOG_VERIFIER.key_id, bytes(32))
    with pytest.raises(CheckpointError):
        open_note(sign_note(TEXT, LOG, LOG_KEY), [LOG_VERIFIER, other])
    open_note(sign_note(TEXT, LOG, LOG_KEY), [LOG_VERIFIER, LOG_VERIFIER])


# --- checkpoints ---


def test_checkpoint_golden_formats() -> None:
    # Go's tlog.FormatTree golden (tlog/note_test.go): the same three-line body.
    cp = Checkpoint("go.sum database tree", 123456789012, leaf_hash(b"hello world"))
    golden = "go.sum database tree\n123456789012\nTszzRgjTG6xce+z2AG31kAXYKBgQVtCSCE40HmuwBb0=\n"
    assert format_checkpoint(cp) == golden
    assert parse_checkpoint(golden) == cp
    # The tlog-checkpoint spec's example (signed by a key we do not have).
    example = (
        "example.com/behind-the-sofa\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n\n"
        "\u2014 example.com/behind-the-sofa Az3grlgtzPICa5OS8npVmf1Myq/5IZniMp+ZJurmRDeOoRDe4URYN7"
        "u5/Zhcyv2q1gGzGku9nTo+zyWE+xeMcTOAYQ8=\n"
    )
    with pytest.raises(UnverifiedNoteError):
        open_checkpoint(example.encode(), [LOG_VERIFIER], origin="example.com/behind-the-sofa")
    text = example.split("\n\n")[0] + "\n"
    parsed = parse_checkpoint(text, origin="example.com/behind-the-sofa")
    assert parsed.size == 20852163
    assert format_checkpoint(parsed) == text


ROOT_B64 = base64.b64encode(EMPTY_ROOT).decode()


@pytest.mark.parametrize(
    "text",
    [
        f"{LOG}\n0\n{ROOT_B64}",  # no final newline
        f"{LOG}\n0\n",  # two lines
        f"\n0\n{ROOT_B64}\n",  # empty origin
        f"{LOG}\n00\n{ROOT_B64}\n",
        f"{LOG}\n01\n{ROOT_B64}\n",
        f"{LOG}\n+1\n{ROOT_B64}\n",
        f"{LOG}\n-1\n{ROOT_B64}\n",
        f"{LOG}\n 1\n{ROOT_B64}\n",
        f"{LOG}\n1 \n{ROOT_B64}\n",
        f"{LOG}\n0x10\n{ROOT_B64}\n",
        f"{LOG}\n\u0661\n{ROOT_B64}\n",  # Arabic-Indic digit: int() would take it
        f"{LOG}\n{2**63}\n{ROOT_B64}\n",
        f"{LOG}\n1\n{base64.b64encode(bytes(31)).decode()}\n",
        f"{LOG}\n1\n{base64.b64encode(bytes(33)).decode()}\n",
        f"{LOG}\n1\n{ROOT_B64[:-2]}9=\n",  # non-canonical: unused bits set
        f"{LOG}\n1\n{ROOT_B64.rstrip('=')}\n",  # missing padding
        f"{LOG}\n1\n{ROOT_B64}\n\n",  # empty extension line
        f"{LOG}\n1\n{ROOT_B64}\next\n\nmore\n",
        f"{LOG}\n1\n{ROOT_B64}\nbad\tline\n",
        f"{LOG}\n1\n{ROOT_B64}\r\n",
    ],
)
def test_malformed_checkpoints(text: str) -> None:
    with pytest.raises(MalformedCheckpointError):
        parse_checkpoint(text)


def test_checkpoint_limits_and_origin() -> None:
    top = f"{LOG}\n{2**63 - 1}\n{ROOT_B64}\n"
    assert parse_checkpoint(top).size == 2**63 - 1
    with pytest.raises(CheckpointOriginError):
        parse_checkpoint(top, origin="another.example/log")
    with pytest.raises(MalformedCheckpointError):
        parse_checkpoint(f"{LOG}\n1\n{ROOT_B64}\n" + "x" * 1_000_001 + "\n")
    for bad in (
        Checkpoint("", 1, EMPTY_ROOT),
        Checkpoint("a\nb", 1, EMPTY_ROOT),
        Checkpoint(LOG, -1, EMPTY_ROOT),
        Checkpoint(LOG, 2**63, EMPTY_ROOT),
        Checkpoint(LOG, 1, EMPTY_ROOT[:31]),
        Checkpoint(LOG, 1, EMPTY_ROOT, ("",)),
        Checkpoint(LOG, 1, EMPTY_ROOT, ("a\nb",)),
    ):
        with pytest.raises(MalformedCheckpointError):
            format_checkpoint(bad)


origins = st.text(
    alphabet=st.characters(codec="utf-8", min_codepoint=0x20),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(
    origin=origins,
    size=st.integers(0, 2**63 - 1),
    root=st.binary(min_size=32, max_size=32),
    extensions=st.lists(origins, max_size=3),
)
def test_checkpoint_round_trip(origin: str, size: int, root: bytes, extensions: list[str]) -> None:
    cp = Checkpoint(origin, size, root, tuple(extensions))
    assert parse_checkpoint(format_checkpoint(cp), origin=origin) == cp
    note = sign_checkpoint(cp, LOG, LOG_KEY)
    assert open_checkpoint(note, [LOG_VERIFIER], origin=origin) == cp


@settings(max_examples=5, deadline=None)
@given(size=st.integers(0, 2**40), root=st.binary(min_size=32, max_size=32))
def test_every_bit_flip_of_a_signed_checkpoint_is_rejected(size: int, root: bytes) -> None:
    note = sign_checkpoint(Checkpoint(LOG, size, root), LOG, LOG_KEY)
    assert open_checkpoint(note, [LOG_VERIFIER], origin=LOG).size == size
    for bit in range(len(note) * 8):
        tampered = bytearray(note)
        tampered[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CheckpointError):
            open_checkpoint(bytes(tampered), [LOG_VERIFIER], origin=LOG)


def test_witness_cosignatures_are_kept_unverified() -> None:
    cp = Checkpoint(LOG, 10, EMPTY_ROOT)
    note = sign_checkpoint(cp, LOG, LOG_KEY)
    witness = Ed25519PrivateKey.from_private_bytes(bytes(32))
    cosigned = note + sign_note(format_checkpoint(cp), "witness.example", witness).split(b"\n\n")[1]
    opened = open_note(cosigned, [LOG_VERIFIER])
    assert [s.name for s in opened.unverified] == ["witness.example"]
    assert open_checkpoint(cosigned, [LOG_VERIFIER], origin=LOG) == cp
    with pytest.raises(UnverifiedNoteError):
        open_checkpoint(note, [PETER], origin=LOG)
