"""Strict Ed25519: published vectors (Wycheproof, speccheck) through the one verify
function, the small-order blocklist recomputed from the curve, and forgeries that OpenSSL
alone accepts refused by keys, notes and checkpoints."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ledger.core import ed25519_strict as strict
from ledger.core.errors import (
    KeyError_,
    LedgerError,
    NonCanonicalKeyError,
    NonCanonicalSignatureError,
    NoteSignatureError,
    OffCurveKeyError,
    SignatureError,
    WeakKeyError,
    WeakSignatureError,
)
from ledger.core.keys import parse_public_key, public_raw, verify_ed25519
from ledger.core.note import Checkpoint, NoteVerifier, format_checkpoint, open_checkpoint, open_note

DATA = Path(__file__).resolve().parents[1] / "data" / "ed25519"
P = 2**255 - 19
L = 2**252 + 27742317777372353535851937790883648493
IDENTITY = (1).to_bytes(32, "little")
SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")


# --- an independent affine implementation (not the module's extended coordinates) ---

D = (-121665 * pow(121666, -1, P)) % P


def _affine_add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    (x1, y1), (x2, y2) = a, b
    t = D * x1 * x2 * y1 * y2 % P
    return ((x1 * y2 + x2 * y1) * pow(1 + t, -1, P) % P,
            (y1 * y2 + x1 * x2) * pow(1 - t, -1, P) % P)


def _affine_mul(k: int, pt: tuple[int, int]) -> tuple[int, int]:
    out = (0, 1)
    while k:
        if k & 1:
            out = _affine_add(out, pt)
        pt = _affine_add(pt, pt)
        k >>= 1
    return out


def _x_for(y: int) -> int | None:
    u, v = (y * y - 1) % P, (D * y * y + 1) % P
    x2 = u * pow(v, -1, P) % P
    x = pow(x2, (P + 3) // 8, P)
    if (x * x - x2) % P:
        x = x * pow(2, (P - 1) // 4, P) % P
    return x if (x * x - x2) % P == 0 else None


def _encode(pt: tuple[int, int]) -> bytes:
    x, y = pt
    return (y | ((x & 1) << 255)).to_bytes(32, "little")


def torsion_points() -> list[tuple[int, int]]:
    """The 8 points of order dividing 8, as the multiples of one point of order 8."""
    for i in range(1000):
        y = int.from_bytes(hashlib.sha256(b"torsion %d" % i).digest(), "little") % P
        x = _x_for(y)
        if x is None:
            continue
        t = _affine_mul(L, (x, y))  # kills the prime-order part
        if _affine_mul(4, t) != (0, 1):  # order exactly 8
            return [_affine_mul(k, t) for k in range(8)]
    raise AssertionError("no point of order 8 found")


TORSION = torsion_points()


def test_blocklist_is_exactly_every_encoding_of_the_eight_torsion_points() -> None:
    assert len(set(TORSION)) == 8
    expected = set()
    for x, y in TORSION:
        for spelled in (y, y + P):
            if spelled < 2**255:
                expected.add((spelled | ((x & 1) << 255)).to_bytes(32, "little"))
                if x == 0:  # "negative zero": x = 0 with the sign bit set
                    expected.add((spelled | (1 << 255)).to_bytes(32, "little"))
    # (y = 0, the two points of order 4, has x = +-i: both sign bits are real points)
    assert frozenset(expected) == strict.SMALL_ORDER_ENCODINGS
    assert len(strict.SMALL_ORDER_ENCODINGS) == 14
    # the two order-8 encodings libsodium's blocklist names
    assert bytes.fromhex("26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05") \
        in strict.SMALL_ORDER_ENCODINGS
    assert bytes.fromhex("c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a") \
        in strict.SMALL_ORDER_ENCODINGS


def _openssl_accepts(pk: bytes, msg: bytes, sig: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(pk).verify(sig, msg)
    except InvalidSignature:
        return False
    return True


def forge(pk: bytes) -> tuple[bytes, bytes] | None:
    """A (message, signature) that OpenSSL accepts for the small-order key ``pk`` with S = 0
    and a small-order R, found without any private key, or None."""
    for n in range(200):
        msg = b"forged %d" % n
        for pt in TORSION:
            sig = _encode(pt) + bytes(32)
            if _openssl_accepts(pk, msg, sig):
                return msg, sig
    return None


def non_canonical_encodings() -> list[bytes]:
    """Every 32-byte string whose y is p..2^255-1, with either sign bit (38 strings)."""
    return [(y | (s << 255)).to_bytes(32, "little") for y in range(P, 2**255) for s in (0, 1)]


# --- the forgery that motivated all of this ---


def test_openssl_alone_accepts_a_signature_without_private_key_and_we_refuse_it() -> None:
    msg = b"any payload at all"
    forged = IDENTITY + bytes(32)  # R = identity, S = 0
    assert _openssl_accepts(IDENTITY, msg, forged)  # the hole, measured on this OpenSSL
    with pytest.raises(WeakKeyError) as err:
        verify_ed25519(IDENTITY, msg, forged)
    assert err.value.code == "weak_public_key"


@pytest.mark.parametrize("pk", sorted(strict.SMALL_ORDER_ENCODINGS), ids=lambda b: b.hex()[:8] +
                         b.hex()[-2:])
def test_every_small_order_key_is_refused_even_where_openssl_takes_a_forgery(pk: bytes) -> None:
    found = forge(pk)
    msg, sig = found if found else (b"m", IDENTITY + bytes(32))
    with pytest.raises(WeakKeyError):
        verify_ed25519(pk, msg, sig)
    with pytest.raises(WeakKeyError):
        strict.check_public_key(pk)
    with pytest.raises(WeakKeyError):
        parse_public_key(base64.b64encode(pk).decode())
    pem = ("-----BEGIN PUBLIC KEY-----\n" + base64.b64encode(SPKI_PREFIX + pk).decode()
           + "\n-----END PUBLIC KEY-----\n")
    with pytest.raises(WeakKeyError):
        parse_public_key(pem)


def test_forgeries_exist_for_the_canonical_small_order_keys() -> None:
    """Not hypothetical: for every canonical small-order key OpenSSL takes a forgery."""
    canonical = [_encode(pt) for pt in TORSION]
    assert all(forge(pk) is not None for pk in canonical)


@pytest.mark.parametrize("pk", non_canonical_encodings(), ids=lambda b: b.hex()[:2] +
                         b.hex()[-2:])
def test_every_non_canonical_key_is_refused(pk: bytes) -> None:
    with pytest.raises(KeyError_) as err:
        strict.check_public_key(pk)
    if pk in strict.SMALL_ORDER_ENCODINGS:  # y = p, p + 1: spellings of 0 and 1
        assert isinstance(err.value, WeakKeyError)
    else:
        assert isinstance(err.value, NonCanonicalKeyError)
        assert err.value.code == "non_canonical_public_key"
    with pytest.raises(KeyError_):
        verify_ed25519(pk, b"m", IDENTITY + bytes(32))
    with pytest.raises(KeyError_):
        parse_public_key(base64.b64encode(pk).decode())


def test_small_order_and_non_canonical_r_and_s_at_or_above_l_are_refused() -> None:
    key = Ed25519PrivateKey.generate()
    pk, msg = public_raw(key), b"hello"
    sig = key.sign(msg)
    verify_ed25519(pk, msg, sig)
    for r in sorted(strict.SMALL_ORDER_ENCODINGS):
        with pytest.raises(WeakSignatureError) as err:
            verify_ed25519(pk, msg, r + sig[32:])
        assert err.value.code == "weak_signature"
    for r in non_canonical_encodings():
        if r in strict.SMALL_ORDER_ENCODINGS:
            continue
        with pytest.raises(NonCanonicalSignatureError):
            verify_ed25519(pk, msg, r + sig[32:])
    s = int.from_bytes(sig[32:], "little")
    for bad_s in (s + L, L, 2**253, 2**256 - 1):
        with pytest.raises(NonCanonicalSignatureError) as err2:
            verify_ed25519(pk, msg, sig[:32] + bad_s.to_bytes(32, "little"))
        assert err2.value.code == "non_canonical_signature"
    # S = L - 1 is in range: refused by the equation, not by the range check
    with pytest.raises(SignatureError) as err3:
        verify_ed25519(pk, msg, sig[:32] + (L - 1).to_bytes(32, "little"))
    assert type(err3.value) is SignatureError


def test_registration_refuses_off_curve_and_mixed_order_keys_and_takes_honest_ones() -> None:
    for _ in range(50):
        raw = public_raw(Ed25519PrivateKey.generate())
        assert parse_public_key(base64.b64encode(raw).decode()) == raw
    # y = 2 is not on the curve (x^2 = 3 / (4d + 1) is a non-residue)
    off = None
    for y in range(2, 100):
        if _x_for(y) is None:
            off = y.to_bytes(32, "little")
            break
    assert off is not None
    with pytest.raises(OffCurveKeyError):
        parse_public_key(base64.b64encode(off).decode())
    # an honest key plus a point of order 8: mixed order
    honest = public_raw(Ed25519PrivateKey.generate())
    y = int.from_bytes(honest, "little") & (2**255 - 1)
    x = _x_for(y)
    assert x is not None
    if x & 1 != honest[31] >> 7:
        x = P - x
    mixed = _encode(_affine_add((x, y), TORSION[1]))
    strict.check_public_key(mixed)  # passes the cheap byte checks
    with pytest.raises(WeakKeyError):
        parse_public_key(base64.b64encode(mixed).decode())
    # negative zero is non-canonical for decode (it is also in the blocklist)
    with pytest.raises(KeyError_):
        strict.decode_point(IDENTITY[:31] + b"\x80")


# --- published vectors ---


def _wycheproof() -> list[tuple[str, dict[str, Any], bytes]]:
    data = json.loads((DATA / "wycheproof_ed25519_test.json").read_text())
    cases = [(f"tc{t['tcId']}", t, bytes.fromhex(g["publicKey"]["pk"]))
             for g in data["testGroups"] for t in g["tests"]]
    assert len(cases) == data["numberOfTests"] == 151
    return cases


@pytest.mark.parametrize(("tc", "case", "pk"), _wycheproof(), ids=lambda v: v if
                         isinstance(v, str) else "")
def test_wycheproof(tc: str, case: dict[str, Any], pk: bytes) -> None:
    msg, sig = bytes.fromhex(case["msg"]), bytes.fromhex(case["sig"])
    assert case["result"] in ("valid", "invalid"), tc
    if case["result"] == "valid":
        verify_ed25519(pk, msg, sig)
    else:
        with pytest.raises((SignatureError, KeyError_)):
            verify_ed25519(pk, msg, sig)


def _speccheck() -> list[dict[str, Any]]:
    expected = json.loads((DATA / "speccheck_expected.json").read_text())["cases"]
    published = json.loads((DATA / "speccheck_cases.json").read_text())
    assert len(expected) == len(published) == 12
    for row, case in zip(expected, published, strict=True):
        assert (row["message"], row["pub_key"], row["signature"]) == (
            case["message"], case["pub_key"], case["signature"])
    return list(expected)


@pytest.mark.parametrize("row", _speccheck(), ids=lambda r: f"case{r['index']}")
def test_speccheck(row: dict[str, Any]) -> None:
    pk, msg, sig = (bytes.fromhex(row[k]) for k in ("pub_key", "message", "signature"))
    if row["expected_verify"] == "accept":
        verify_ed25519(pk, msg, sig)
    else:
        with pytest.raises(LedgerError) as err:
            verify_ed25519(pk, msg, sig)
        assert err.value.code == row["expected_verify"], row["why"]
    if row["expected_registration"] == "accept":
        parse_public_key(base64.b64encode(pk).decode())
    else:
        with pytest.raises(KeyError_) as err2:
            parse_public_key(base64.b64encode(pk).decode())
        assert err2.value.code == row["expected_registration"]


def test_speccheck_accepts_only_case_3_like_libsodium() -> None:
    rows = _speccheck()
    assert [r["index"] for r in rows if r["expected_verify"] == "accept"] == [3]
    # the cases OpenSSL (PyCA) accepts on its own, per the speccheck results table
    openssl = [r["index"] for r in rows if _openssl_accepts(
        *(bytes.fromhex(r[k]) for k in ("pub_key", "message", "signature")))]
    assert openssl == [0, 1, 2, 3, 11]


# --- signed notes and checkpoints ---


def test_a_note_signed_by_a_small_order_key_is_refused() -> None:
    verifier = NoteVerifier.from_public_key("ledger.test/forged", IDENTITY)
    text = "anything the forger wants\n"
    sig = IDENTITY + bytes(32)
    assert _openssl_accepts(IDENTITY, text.encode(), sig)
    note = (text + "\n\u2014 ledger.test/forged "
            + base64.b64encode(verifier.key_id.to_bytes(4, "big") + sig).decode()
            + "\n").encode()
    with pytest.raises(NoteSignatureError) as err:
        open_note(note, [verifier])
    assert err.value.code == "weak_public_key"


def test_a_checkpoint_signed_by_a_small_order_key_is_refused() -> None:
    origin = "ledger.test/forged"
    for pk in sorted(strict.SMALL_ORDER_ENCODINGS):
        verifier = NoteVerifier.from_public_key(origin, pk)
        text = format_checkpoint(Checkpoint(origin, 10**6, bytes(32)))
        found = forge(pk)
        sig = found[1] if found else IDENTITY + bytes(32)
        note = (text + "\n\u2014 " + origin + " "
                + base64.b64encode(verifier.key_id.to_bytes(4, "big") + sig).decode()
                + "\n").encode()
        with pytest.raises(NoteSignatureError) as err:
            open_checkpoint(note, [verifier], origin=origin)
        assert err.value.code == "weak_public_key"


def test_a_note_with_r_small_order_or_s_not_reduced_is_refused_by_an_honest_key() -> None:
    key = Ed25519PrivateKey.generate()
    verifier = NoteVerifier.from_public_key("ledger.test/log", key.public_key())
    text = "body\n"
    good = key.sign(text.encode())
    s = int.from_bytes(good[32:], "little")
    for sig, code in ((IDENTITY + bytes(32), "weak_signature"),
                      (good[:32] + (s + L).to_bytes(32, "little"), "non_canonical_signature"),
                      (good[:31] + bytes([good[31] ^ 1]) + good[32:], "bad_note_signature")):
        note = (text + "\n\u2014 ledger.test/log "
                + base64.b64encode(verifier.key_id.to_bytes(4, "big") + sig).decode()
                + "\n").encode()
        with pytest.raises(NoteSignatureError) as err:
            open_note(note, [verifier])
        assert err.value.code == code
    ok = (text + "\n\u2014 ledger.test/log "
          + base64.b64encode(verifier.key_id.to_bytes(4, "big") + good).decode() + "\n").encode()
    assert open_note(ok, [verifier]).text == text


# --- the backend: libsodium behind our checks accepts what OpenSSL behind them accepts ---


def _openssl_path(pk: bytes, msg: bytes, sig: bytes) -> tuple[str, str]:
    """The verification before libsodium (strict checks, then OpenSSL), as a reference."""
    try:
        if len(pk) != 32:
            raise SignatureError("unusable public key")
        strict.check_public_key(pk)
        strict.check_signature(sig)
        Ed25519PublicKey.from_public_bytes(pk).verify(sig, msg)
    except InvalidSignature:
        return ("reject", "SignatureError/bad_signature")
    except ValueError as exc:
        return ("reject", f"SignatureError/{exc.__class__.__name__}")
    except LedgerError as exc:
        return ("reject", f"{type(exc).__name__}/{exc.code}")
    return ("accept", "")


def _ledger_path(pk: bytes, msg: bytes, sig: bytes) -> tuple[str, str]:
    try:
        verify_ed25519(pk, msg, sig)
    except LedgerError as exc:
        return ("reject", f"{type(exc).__name__}/{exc.code}")
    return ("accept", "")


def _sodium_alone_accepts(pk: bytes, msg: bytes, sig: bytes) -> bool:
    import nacl.bindings
    import nacl.exceptions

    try:
        nacl.bindings.crypto_sign_open(sig + msg, pk)
    except nacl.exceptions.BadSignatureError:
        return False
    return True


def every_vector() -> list[tuple[str, bytes, bytes, bytes]]:
    """(name, public key, message, signature): Wycheproof, speccheck, and the edge cases
    above (small-order and non-canonical keys and R, S out of range, forgeries), plus
    honest signatures and one-bit changes of them."""
    out = [(tc, pk, bytes.fromhex(c["msg"]), bytes.fromhex(c["sig"]))
           for tc, c, pk in _wycheproof()]
    out += [(f"speccheck{r['index']}", *(bytes.fromhex(r[k]) for k in
                                          ("pub_key", "message", "signature")))
            for r in _speccheck()]
    for pk in sorted(strict.SMALL_ORDER_ENCODINGS):
        found = forge(pk)
        msg, sig = found if found else (b"m", IDENTITY + bytes(32))
        out.append((f"small-order key {pk.hex()[:8]}", pk, msg, sig))
    for pk in non_canonical_encodings():
        out.append((f"non-canonical key {pk.hex()[:4]}", pk, b"m", IDENTITY + bytes(32)))
    key = Ed25519PrivateKey.generate()
    pk, msg = public_raw(key), b"hello"
    sig = key.sign(msg)
    s = int.from_bytes(sig[32:], "little")
    out.append(("honest", pk, msg, sig))
    for r in sorted(strict.SMALL_ORDER_ENCODINGS) + non_canonical_encodings():
        out.append((f"R {r.hex()[:4]}", pk, msg, r + sig[32:]))
    for bad_s in (s + L, L, L - 1, 2**253, 2**256 - 1, 0):
        out.append((f"S {bad_s:x}"[:12], pk, msg, sig[:32] + bad_s.to_bytes(32, "little")))
    for i in range(50):
        k = Ed25519PrivateKey.generate()
        m = hashlib.sha256(b"%d" % i).digest() * (i % 7)
        good = k.sign(m)
        out.append((f"honest {i}", public_raw(k), m, good))
        bit = i * 37 % 512
        flipped = bytearray(good)
        flipped[bit // 8] ^= 1 << (bit % 8)
        out.append((f"sig bit {bit}", public_raw(k), m, bytes(flipped)))
        out.append((f"message bit {i}", public_raw(k), m + b"\x00", good))
        other = public_raw(Ed25519PrivateKey.generate())
        out.append((f"other key {i}", other, m, good))
    # a mixed-order key (honest point + a point of order 8) signing with its own scalar is
    # not constructible without the torsion part's discrete log; speccheck cases 4-5 cover it
    return out


VECTORS = every_vector()


def test_libsodium_behind_our_checks_accepts_exactly_what_openssl_behind_them_does() -> None:
    """Same accept/reject, and the same error class and code, on every vector: changing the
    backend from OpenSSL to libsodium changed no decision."""
    assert len(VECTORS) > 151 + 12 + 14 + 38 + 200
    differ = [(name, _openssl_path(pk, m, s), _ledger_path(pk, m, s))
              for name, pk, m, s in VECTORS
              if _openssl_path(pk, m, s)[0] != _ledger_path(pk, m, s)[0]
              or (_openssl_path(pk, m, s)[1].split("/")[0]
                  != _ledger_path(pk, m, s)[1].split("/")[0])]
    assert differ == []
    accepted = sum(_ledger_path(pk, m, s)[0] == "accept" for _, pk, m, s in VECTORS)
    assert accepted == sum(c["result"] == "valid" for _, c, _ in _wycheproof()) + 1 + 1 + 50


def test_libsodium_alone_is_as_strict_as_our_checks_and_openssl_alone_is_not() -> None:
    """Both paths exercised on their own: libsodium without our checks already refuses
    every vector our checks refuse (they are kept for their error codes); OpenSSL without
    them takes the forgeries (the hole the checks close)."""
    ledger_accepts = [_ledger_path(pk, m, s)[0] == "accept" for _, pk, m, s in VECTORS]
    sodium = [_sodium_alone_accepts(pk, m, s) if len(pk) == 32 else False
              for _, pk, m, s in VECTORS]
    assert sodium == ledger_accepts
    openssl = [_openssl_accepts(pk, m, s) for _, pk, m, s in VECTORS]
    extra = [name for (name, *_), o, a in zip(VECTORS, openssl, ledger_accepts, strict=True)
             if o and not a]
    assert len(extra) >= 14 and "speccheck0" in extra
    assert not any(a and not o for o, a in zip(openssl, ledger_accepts, strict=True))


def test_verify_ed25519_runs_libsodium(monkeypatch: pytest.MonkeyPatch) -> None:
    import nacl.exceptions

    from ledger.core import keys

    key = Ed25519PrivateKey.generate()
    sig = key.sign(b"m")
    verify_ed25519(public_raw(key), b"m", sig)
    calls: list[bytes] = []

    def refuse(signed: bytes, pk: bytes) -> bytes:
        calls.append(signed)
        raise nacl.exceptions.BadSignatureError("refused")

    monkeypatch.setattr(keys, "_crypto_sign_open", refuse)
    with pytest.raises(SignatureError):
        verify_ed25519(public_raw(key), b"m", sig)
    assert calls == [sig + b"m"]


def test_signed_bytes_must_start_with_the_checked_signature() -> None:
    """``verify_ed25519(signed=)`` (signature || message made by the caller in one buffer):
    libsodium reads ``signed``, the strict rules read ``signature``; if they differ, it is
    refused, so the strict rules always judge the signature that is verified."""
    from ledger.core.errors import SignatureError as _SignatureError
    from ledger.core.keys import generate_private_key, public_raw, verify_ed25519

    key, other = generate_private_key(), generate_private_key()
    message = b"a message"
    good, theirs = key.sign(message), other.sign(message)
    verify_ed25519(public_raw(key), message, good, signed=good + message)
    with pytest.raises(_SignatureError, match="start with the signature"):
        verify_ed25519(public_raw(key), message, theirs, signed=good + message)
