"""Strict Ed25519 encodings: the checks we run before any signature is believed.

RFC 8032 verification, as OpenSSL (and so ``cryptography``) implements it, accepts public
keys and signature ``R`` values of small order. With a small-order key ``A`` and
``R = identity, S = 0`` the equation ``[S]B = R + [k]A`` holds for every message, so a
"signature" needs no private key at all and proves nothing about who signed. Different
libraries also disagree about non-canonical encodings ("Taming the many EdDSAs",
Chalkias, Garillot, Nikolaenko, SSR 2020; https://eprint.iacr.org/2020/1244), so a signature
one verifier accepts another may refuse.

Our policy, stricter than RFC 8032 cofactored verification (on the 12 speccheck cases it
accepts exactly what libsodium's ``crypto_sign_verify_detached`` and ed25519-dalek's
``verify_strict`` accept: case 3 only):

- a public key or an ``R`` whose encoding is one of the small-order points (the eight
  torsion points, with either sign bit, and the non-canonical ``y + p`` spellings) is
  refused;
- a public key or an ``R`` whose ``y`` coordinate is not reduced (``y >= p``) is refused;
- ``S`` must be reduced (``S < L``);
- then the signature must pass cofactorless verification (libsodium, as
  :func:`ledger.core.keys.verify_ed25519` calls it; OpenSSL before, with the same
  decisions on every test vector), which holds only if the cofactored equation holds too,
  so every signature we accept is accepted by every RFC 8032 verifier.

These are byte comparisons (no curve arithmetic), cheap enough for every verification.
Registration runs :func:`check_public_key_on_registration`, which also decodes the point
(it must be on the curve) and refuses keys with a small-order component (mixed order):
no honestly generated key (``A = [a]B``) is ever refused by it. It costs a scalar
multiplication in pure Python (milliseconds), so it runs when a key enters the ledger,
not on every signature.

Pure functions over bytes; every error is a :class:`ledger.core.errors.KeyError_` or
:class:`ledger.core.errors.SignatureError` subclass with its own ``code``.
"""

from __future__ import annotations

from ledger.core.errors import (
    NonCanonicalKeyError,
    NonCanonicalSignatureError,
    OffCurveKeyError,
    SignatureError,
    WeakKeyError,
    WeakSignatureError,
)

P = 2**255 - 19
"""The field prime."""
L = 2**252 + 27742317777372353535851937790883648493
"""The order of the prime-order subgroup (of the base point B)."""
D = (-121665 * pow(121666, P - 2, P)) % P
"""The curve constant d of -x^2 + y^2 = 1 + d x^2 y^2."""
_SQRT_M1 = pow(2, (P - 1) // 4, P)
_Y_MASK = (1 << 255) - 1

# y coordinates of the eight points of order dividing 8 (identity, order 2, two of
# order 4 at y = 0, four of order 8); tests/core/test_ed25519_vectors.py recomputes them.
_SMALL_ORDER_Y = (
    0,
    1,
    P - 1,
    0x05FC536D880238B13933C6D305ACDFD5F098EFF289F4C345B027B2C28F95E826,
    0x7A03AC9277FDC74EC6CC392CFA53202A0F67100D760B3CBA4FD84D3D706A17C7,
)


def _small_order_encodings() -> frozenset[bytes]:
    out = set()
    for y in _SMALL_ORDER_Y:
        for spelled in (y, y + P):  # canonical, and non-canonical where it fits 255 bits
            if spelled >= 1 << 255:
                continue
            for sign in (0, 1):  # sign 1 on x = 0 is the "negative zero" non-canonical form
                out.add((spelled | (sign << 255)).to_bytes(32, "little"))
    return frozenset(out)


SMALL_ORDER_ENCODINGS: frozenset[bytes] = _small_order_encodings()
"""Every 32-byte encoding that decodes (canonically or leniently) to a small-order point:
5 y values x 2 sign bits, plus y + p for y in {0, 1} x 2 sign bits = 14 encodings."""


def _y(encoding: bytes) -> int:
    return int.from_bytes(encoding, "little") & _Y_MASK


def check_public_key(public_key: bytes) -> None:
    """Refuse a small-order or non-canonically encoded public key (byte checks only)."""
    if len(public_key) != 32:
        raise NonCanonicalKeyError(f"an Ed25519 public key is 32 bytes, got {len(public_key)}")
    if public_key in SMALL_ORDER_ENCODINGS:
        raise WeakKeyError("the public key is a small-order point: anyone could sign for it")
    if _y(public_key) >= P:
        raise NonCanonicalKeyError("the public key is not canonically encoded (y >= p)")


def check_signature(signature: bytes) -> None:
    """Refuse a signature whose R is small-order or non-canonical, or whose S >= L."""
    if len(signature) != 64:
        raise SignatureError(f"an Ed25519 signature is 64 bytes, got {len(signature)}")
    r = signature[:32]
    if r in SMALL_ORDER_ENCODINGS:
        raise WeakSignatureError("the signature's R is a small-order point")
    if _y(r) >= P:
        raise NonCanonicalSignatureError("the signature's R is not canonically encoded "
                                         "(y >= p)")
    if int.from_bytes(signature[32:], "little") >= L:
        raise NonCanonicalSignatureError("the signature's S is not reduced (S >= L)")


# --- curve arithmetic for the registration check (extended coordinates, RFC 8032 5.1) ---

_Point = tuple[int, int, int, int]
_IDENTITY: _Point = (0, 1, 1, 0)


def _add(p1: _Point, p2: _Point) -> _Point:
    x1, y1, z1, t1 = p1
    x2, y2, z2, t2 = p2
    a = (y1 - x1) * (y2 - x2) % P
    b = (y1 + x1) * (y2 + x2) % P
    c = 2 * t1 * t2 * D % P
    d = 2 * z1 * z2 % P
    e, f, g, h = b - a, d - c, d + c, b + a
    return (e * f % P, g * h % P, f * g % P, e * h % P)


def _multiply(k: int, point: _Point) -> _Point:
    result = _IDENTITY
    while k:
        if k & 1:
            result = _add(result, point)
        point = _add(point, point)
        k >>= 1
    return result


def _is_identity(point: _Point) -> bool:
    x, y, z, _ = point
    return x % P == 0 and (y - z) % P == 0


def decode_point(encoding: bytes) -> _Point:
    """RFC 8032 5.1.3 point decoding (strict: y < p, no negative zero); raises
    :class:`OffCurveKeyError` when no curve point has that encoding."""
    if len(encoding) != 32:
        raise NonCanonicalKeyError(f"an Ed25519 point is 32 bytes, got {len(encoding)}")
    y = _y(encoding)
    sign = encoding[31] >> 7
    if y >= P:
        raise NonCanonicalKeyError("the point is not canonically encoded (y >= p)")
    x2 = (y * y - 1) * pow(D * y * y + 1, P - 2, P) % P
    x = pow(x2, (P + 3) // 8, P)
    if (x * x - x2) % P:
        x = x * _SQRT_M1 % P
    if (x * x - x2) % P:
        raise OffCurveKeyError("the public key is not a point on Ed25519")
    if x == 0 and sign:
        raise NonCanonicalKeyError("the public key is not canonically encoded (x = 0, "
                                   "sign bit set)")
    if x & 1 != sign:
        x = P - x
    return (x, y, 1, x * y % P)


def check_public_key_on_registration(public_key: bytes) -> None:
    """Everything :func:`check_public_key` refuses, plus keys off the curve and keys with
    a small-order component (``[L]A`` is not the identity). Milliseconds, pure Python."""
    check_public_key(public_key)
    point = decode_point(public_key)
    if not _is_identity(_multiply(L, point)):
        raise WeakKeyError("the public key has a small-order component (it is not in the "
                           "prime-order subgroup); a key made from a private key never has")
