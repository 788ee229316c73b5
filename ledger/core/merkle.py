"""RFC 9162 (Certificate Transparency v2) Merkle trees: hashing, proofs, verification.

References: RFC 9162 section 2.1 (RFC 6962 section 2.1 is the same tree), in particular
2.1.1 (Merkle Tree Hash), 2.1.3 (inclusion proofs) and 2.1.4 (consistency proofs).

- leaf hash  = SHA-256(0x00 || entry bytes)
- node hash  = SHA-256(0x01 || left || right)
- empty tree = SHA-256() (the hash of the empty string)

The generators here work on an in-memory list of leaf hashes: they are the reference
implementation that the tile-based generators in :mod:`ledger.core.tiles` are tested
against. The verifiers follow the RFC 9162 algorithms step by step and, like every check
in the core, return ``None`` or raise (:class:`InclusionProofError`,
:class:`ConsistencyProofError`); they never return a bool.

A proof does not authenticate the tree size on its own: two sizes whose proofs have the
same shape (the same left/right pattern) accept the same proof, in every RFC 9162
verifier. The size is bound to the root by the signed checkpoint, which is why a verifier
takes ``size`` and ``root`` from one verified checkpoint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from ledger.core.errors import ConsistencyProofError, InclusionProofError, TreeRangeError

HASH_SIZE = 32
LEAF_PREFIX = b"\x00"
NODE_PREFIX = b"\x01"
EMPTY_ROOT = hashlib.sha256(b"").digest()
"""MTH({}): the root hash of the empty tree (RFC 9162 section 2.1.1)."""

MAX_TREE_SIZE = (1 << 63) - 1
"""Largest tree size we accept: Go's ``tlog`` (and most tooling) uses a signed int64."""

_sha256 = hashlib.sha256


def leaf_hash(entry: bytes) -> bytes:
    """RFC 9162 leaf hash: SHA-256(0x00 || entry)."""
    return _sha256(LEAF_PREFIX + entry).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """RFC 9162 interior node hash: SHA-256(0x01 || left || right)."""
    return _sha256(NODE_PREFIX + left + right).digest()


def _largest_power_of_two_below(n: int) -> int:
    """The k of RFC 9162: the largest power of two strictly smaller than ``n`` (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def root_hash(leaf_hashes: Sequence[bytes]) -> bytes:
    """MTH of a list of leaf hashes (use a slice for the root of a range).

    Bottom-up: pair neighbours, carry an unpaired last node up unchanged. That builds the
    same left-balanced tree as the recursive RFC definition (split at the largest power of
    two below n) in one pass of n - 1 node hashes.
    """
    if not leaf_hashes:
        return EMPTY_ROOT
    level = list(leaf_hashes)
    while len(level) > 1:
        nxt = [
            _sha256(NODE_PREFIX + level[i] + level[i + 1]).digest()
            for i in range(0, len(level) - 1, 2)
        ]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def _check_size(size: int, available: int | None = None) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_TREE_SIZE:
        raise TreeRangeError(f"tree size {size!r} is not an integer in [0, 2**63)")
    if available is not None and size > available:
        raise TreeRangeError(f"tree size {size} is larger than the {available} leaves given")


def inclusion_proof_ranges(index: int, size: int) -> list[tuple[int, int]]:
    """The leaf ranges [lo, hi) whose MTH make up PATH(index, D[0:size]), leaf to root.

    RFC 9162 section 2.1.3.1, unrolled: each step splits the current range at k and keeps
    the half that holds ``index``; the other half is one proof element. Shared by the
    in-memory and the tile-based generators so the two cannot disagree on the shape.
    """
    _check_size(size)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < size:
        raise TreeRangeError(f"leaf index {index!r} is not in a tree of size {size}")
    ranges: list[tuple[int, int]] = []
    lo, hi = 0, size
    while hi - lo > 1:
        k = _largest_power_of_two_below(hi - lo)
        if index < lo + k:
            ranges.append((lo + k, hi))
            hi = lo + k
        else:
            ranges.append((lo, lo + k))
            lo += k
    ranges.reverse()
    return ranges


def consistency_proof_ranges(old_size: int, new_size: int) -> list[tuple[int, int]]:
    """The leaf ranges [lo, hi) whose MTH make up PROOF(m, D[0:n]) (RFC 9162 2.1.4.1).

    Empty when m == 0 or m == n. SUBPROOF's recursion is unrolled: elements are collected
    from the root down and reversed, so the result is in the RFC's (deepest first) order.
    """
    _check_size(old_size)
    _check_size(new_size)
    if old_size > new_size:
        raise TreeRangeError(f"old size {old_size} is larger than new size {new_size}")
    m, n = old_size, new_size
    if m == 0 or m == n:
        return []
    ranges: list[tuple[int, int]] = []
    lo, hi = 0, n
    complete = True  # SUBPROOF's flag b: is the old tree a complete subtree of this range?
    while True:
        if m == hi - lo:
            if not complete:
                ranges.append((lo, hi))
            break
        k = _largest_power_of_two_below(hi - lo)
        if m <= k:
            ranges.append((lo + k, hi))
            hi = lo + k
        else:
            ranges.append((lo, lo + k))
            m -= k
            lo += k
            complete = False
    ranges.reverse()
    return ranges


def inclusion_proof(index: int, size: int, leaf_hashes: Sequence[bytes]) -> list[bytes]:
    """PATH(index, D[0:size]) from in-memory leaf hashes (reference implementation)."""
    _check_size(size, len(leaf_hashes))
    return [root_hash(leaf_hashes[lo:hi]) for lo, hi in inclusion_proof_ranges(index, size)]


def consistency_proof(old_size: int, new_size: int, leaf_hashes: Sequence[bytes]) -> list[bytes]:
    """PROOF(m, D[0:n]) from in-memory leaf hashes (reference implementation)."""
    _check_size(new_size, len(leaf_hashes))
    return [
        root_hash(leaf_hashes[lo:hi]) for lo, hi in consistency_proof_ranges(old_size, new_size)
    ]


def _is_hash(value: object) -> bool:
    return isinstance(value, bytes) and len(value) == HASH_SIZE


def _is_size(value: object) -> bool:
    return (
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TREE_SIZE
    )


def verify_inclusion(
    leaf_hash: bytes, index: int, size: int, proof: Sequence[bytes], root: bytes
) -> None:
    """Check that ``leaf_hash`` is leaf ``index`` of the tree of ``size`` with ``root``.

    RFC 9162 section 2.1.3.2. Returns ``None`` or raises :class:`InclusionProofError`
    (wrong hash length, index outside the tree, a proof too long or too short, or a
    recomputed root that differs).
    """
    if not _is_hash(leaf_hash):
        raise InclusionProofError("the leaf hash is not 32 bytes")
    if not _is_hash(root):
        raise InclusionProofError("the root hash is not 32 bytes")
    if not _is_size(size) or not _is_size(index):
        raise InclusionProofError("index and size must be integers in [0, 2**63)")
    if index >= size:
        raise InclusionProofError(f"leaf index {index} is not in a tree of size {size}")
    if not all(_is_hash(p) for p in proof):
        raise InclusionProofError("every proof element must be 32 bytes")

    fn, sn = index, size - 1
    r = leaf_hash
    for p in proof:
        if sn == 0:
            raise InclusionProofError("the inclusion proof has more hashes than the tree needs")
        if fn & 1 or fn == sn:
            r = _sha256(NODE_PREFIX + p + r).digest()
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = _sha256(NODE_PREFIX + r + p).digest()
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise InclusionProofError("the inclusion proof has fewer hashes than the tree needs")
    if r != root:
        raise InclusionProofError("the inclusion proof does not lead to the root hash")


def verify_consistency(
    old_size: int, new_size: int, proof: Sequence[bytes], old_root: bytes, new_root: bytes
) -> None:
    """Check that the tree (old_size, old_root) is a prefix of (new_size, new_root).

    RFC 9162 section 2.1.4.2 for 0 < m < n. The cases the RFC leaves out: m == n needs an
    empty proof and equal roots; m == 0 needs an empty proof and ``old_root`` equal to
    the empty-tree hash (every tree extends the empty tree). Returns ``None`` or raises
    :class:`ConsistencyProofError`.
    """
    if not _is_hash(old_root) or not _is_hash(new_root):
        raise ConsistencyProofError("root hashes must be 32 bytes")
    if not _is_size(old_size) or not _is_size(new_size):
        raise ConsistencyProofError("sizes must be integers in [0, 2**63)")
    if old_size > new_size:
        raise ConsistencyProofError(f"old size {old_size} is larger than new size {new_size}")
    if not all(_is_hash(p) for p in proof):
        raise ConsistencyProofError("every proof element must be 32 bytes")
    if old_size == 0 or old_size == new_size:
        if proof:
            raise ConsistencyProofError("a proof from the empty tree or to the same size is empty")
        if old_size == 0 and old_root != EMPTY_ROOT:
            raise ConsistencyProofError("the root of the empty tree is SHA-256 of nothing")
        if old_size == new_size and old_root != new_root:
            raise ConsistencyProofError("equal sizes with different root hashes")
        return
    if not proof:
        raise ConsistencyProofError("the consistency proof is empty")

    path = list(proof)
    if old_size & (old_size - 1) == 0:  # m is a power of two: the old root is a node
        path.insert(0, old_root)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            raise ConsistencyProofError("the consistency proof has more hashes than needed")
        if fn & 1 or fn == sn:
            fr = _sha256(NODE_PREFIX + c + fr).digest()
            sr = _sha256(NODE_PREFIX + c + sr).digest()
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = _sha256(NODE_PREFIX + sr + c).digest()
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise ConsistencyProofError("the consistency proof has fewer hashes than needed")
    if fr != old_root:
        raise ConsistencyProofError("the consistency proof does not lead to the old root")
    if sr != new_root:
        raise ConsistencyProofError("the consistency proof does not lead to the new root")
