"""RFC 9162 Merkle tree: golden vectors, properties against a naive recomputation, and
rejection of every single-bit change (acceptance 1 of issue 3).

The naive oracle below follows the recursive definitions of RFC 9162 section 2.1 literally
(MTH, PATH, SUBPROOF); the code under test uses the bottom-up / bit-twiddling forms.
"""

from __future__ import annotations

import base64
import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.core.errors import (
    ConsistencyProofError,
    InclusionProofError,
    ProofError,
    TreeRangeError,
)
from ledger.core.merkle import (
    EMPTY_ROOT,
    MAX_TREE_SIZE,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    node_hash,
    root_hash,
    verify_consistency,
    verify_inclusion,
)

MAX_SIZE = 4096
# Distinct leaves: with equal leaves, proofs for different indices really are the same.
LEAVES = [leaf_hash(b"leaf %d" % i) for i in range(MAX_SIZE + 1)]
OTHER = hashlib.sha256(b"some other hash").digest()


def naive_mth(hashes: list[bytes]) -> bytes:
    """MTH per RFC 9162 2.1.1, recursively (no shared code with the module under test)."""
    n = len(hashes)
    if n == 0:
        return hashlib.sha256(b"").digest()
    if n == 1:
        return hashes[0]
    k = 1
    while k * 2 < n:
        k *= 2
    left, right = naive_mth(hashes[:k]), naive_mth(hashes[k:])
    return hashlib.sha256(b"\x01" + left + right).digest()


def _k(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def inclusion_shape(index: int, size: int) -> tuple[str, ...]:
    """Which side each PATH element joins on, leaf to root (RFC 9162 2.1.3.1)."""
    if size == 1:
        return ()
    k = _k(size)
    if index < k:
        return (*inclusion_shape(index, k), "R")
    return (*inclusion_shape(index - k, size - k), "L")


def consistency_shape(m: int, n: int, complete: bool = True) -> tuple[str, ...]:
    """SUBPROOF's structure (RFC 9162 2.1.4.1): where each element goes, deepest first."""
    if m == n:
        return ("OLD_ROOT",) if complete else ("SEED",)
    k = _k(n)
    if m <= k:
        return (*consistency_shape(m, k, complete), "R")
    return (*consistency_shape(m - k, n - k, False), "L")


def flip(value: bytes, bit: int) -> bytes:
    b = bytearray(value)
    b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b)


sizes = st.one_of(
    st.integers(min_value=1, max_value=MAX_SIZE),
    st.sampled_from([1, 2, 3, 4, 5, 7, 8, 9, 255, 256, 257, 1023, 1024, 1025, 4095, 4096]),
)


# --- golden vectors (transparency-dev/merkle proof/verify_test.go, RFC 6962 test data) ---

GOLDEN_LEAVES = [
    bytes.fromhex(h)
    for h in [
        "", "00", "10", "2021", "3031", "40414243", "5051525354555657",
        "606162636465666768696a6b6c6d6e6f",
    ]
]
GOLDEN_ROOTS = [
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]
# (0-based leaf index, tree size, proof)
GOLDEN_INCLUSION = [
    (0, 1, []),
    (0, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (5, 8, ["bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
    (2, 3, ["fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"]),
    (1, 5, ["6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"]),
]
GOLDEN_CONSISTENCY = [
    (1, 1, []),
    (1, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (6, 8, ["0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
    (2, 5, ["5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"]),
    (6, 7, ["0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "b08693ec2e721597130641e8211e7eedccb4c26413963eee6c1e2ed16ffb1a5f",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
]


def test_golden_hashes() -> None:
    assert EMPTY_ROOT.hex() == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert leaf_hash(b"").hex() == GOLDEN_ROOTS[0]
    hashes = [leaf_hash(x) for x in GOLDEN_LEAVES]
    for n, want in enumerate(GOLDEN_ROOTS, start=1):
        assert root_hash(hashes[:n]).hex() == want
    assert node_hash(hashes[0], hashes[1]).hex() == GOLDEN_ROOTS[1]
    # Go's tlog golden: RecordHash("hello world") in tlog/note_test.go (base64 there).
    golden = base64.b64decode("TszzRgjTG6xce+z2AG31kAXYKBgQVtCSCE40HmuwBb0=")
    assert leaf_hash(b"hello world") == golden


@pytest.mark.parametrize(("index", "size", "proof"), GOLDEN_INCLUSION)
def test_golden_inclusion(index: int, size: int, proof: list[str]) -> None:
    hashes = [leaf_hash(x) for x in GOLDEN_LEAVES]
    want = [bytes.fromhex(p) for p in proof]
    assert inclusion_proof(index, size, hashes) == want
    verify_inclusion(hashes[index], index, size, want, bytes.fromhex(GOLDEN_ROOTS[size - 1]))


@pytest.mark.parametrize(("m", "n", "proof"), GOLDEN_CONSISTENCY)
def test_golden_consistency(m: int, n: int, proof: list[str]) -> None:
    hashes = [leaf_hash(x) for x in GOLDEN_LEAVES]
    want = [bytes.fromhex(p) for p in proof]
    assert consistency_proof(m, n, hashes) == want
    old, new = bytes.fromhex(GOLDEN_ROOTS[m - 1]), bytes.fromhex(GOLDEN_ROOTS[n - 1])
    verify_consistency(m, n, want, old, new)


# --- properties against the naive recomputation ---


@settings(max_examples=60, deadline=None)
@given(size=st.integers(min_value=0, max_value=MAX_SIZE))
def test_root_hash_matches_naive(size: int) -> None:
    assert root_hash(LEAVES[:size]) == naive_mth(LEAVES[:size])


@settings(max_examples=40, deadline=None)
@given(data=st.data(), size=sizes)
def test_inclusion_proof_verifies_and_every_bit_flip_is_rejected(
    data: st.DataObject, size: int
) -> None:
    index = data.draw(
        st.one_of(st.integers(0, size - 1), st.sampled_from([0, size - 1])), label="index"
    )
    root = naive_mth(LEAVES[:size])
    proof = inclusion_proof(index, size, LEAVES)
    leaf = LEAVES[index]
    assert len(proof) == len(inclusion_shape(index, size))
    verify_inclusion(leaf, index, size, proof, root)

    def rejected(leaf_: bytes, index_: int, size_: int, proof_: list[bytes], root_: bytes) -> None:
        with pytest.raises(InclusionProofError):
            verify_inclusion(leaf_, index_, size_, proof_, root_)

    for i in range(len(proof)):
        for bit in range(256):
            rejected(leaf, index, size, [*proof[:i], flip(proof[i], bit), *proof[i + 1 :]], root)
    for bit in range(256):
        rejected(leaf, index, size, proof, flip(root, bit))
        rejected(flip(leaf, bit), index, size, proof, root)
    for bit in range(64):
        rejected(leaf, index ^ (1 << bit), size, proof, root)
        other = size ^ (1 << bit)
        if index < other and inclusion_shape(index, other) == inclusion_shape(index, size):
            # Same PATH shape: no verifier can tell these sizes apart from (proof, root);
            # the signed checkpoint binds size and root. The real tree of that size differs.
            verify_inclusion(leaf, index, other, proof, root)
            assert other > MAX_SIZE or naive_mth(LEAVES[:other]) != root
        else:
            rejected(leaf, index, other, proof, root)
    # Trailing, leading, missing and swapped hashes.
    for extra in (OTHER, root, leaf, *proof[:1]):
        rejected(leaf, index, size, [*proof, extra], root)
        rejected(leaf, index, size, [extra, *proof], root)
    if proof:
        rejected(leaf, index, size, proof[:-1], root)
        rejected(leaf, index, size, proof[1:], root)
    if len(proof) > 1:
        rejected(leaf, index, size, [proof[1], proof[0], *proof[2:]], root)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), n=sizes.filter(lambda n: n >= 2))
def test_consistency_proof_verifies_and_every_bit_flip_is_rejected(
    data: st.DataObject, n: int
) -> None:
    m = data.draw(st.one_of(st.integers(1, n - 1), st.sampled_from([1, n - 1])), label="m")
    old_root, new_root = naive_mth(LEAVES[:m]), naive_mth(LEAVES[:n])
    proof = consistency_proof(m, n, LEAVES)
    implicit_old_root = m & (m - 1) == 0  # m a power of two: the old root is not sent
    assert len(proof) == len(consistency_shape(m, n)) - implicit_old_root
    verify_consistency(m, n, proof, old_root, new_root)

    def rejected(m_: int, n_: int, proof_: list[bytes], old_: bytes, new_: bytes) -> None:
        with pytest.raises(ConsistencyProofError):
            verify_consistency(m_, n_, proof_, old_, new_)

    for i in range(len(proof)):
        for bit in range(256):
            rejected(m, n, [*proof[:i], flip(proof[i], bit), *proof[i + 1 :]], old_root, new_root)
    for bit in range(256):
        rejected(m, n, proof, flip(old_root, bit), new_root)
        rejected(m, n, proof, old_root, flip(new_root, bit))
    shape = consistency_shape(m, n)
    for bit in range(64):
        for m2, n2 in ((m ^ (1 << bit), n), (m, n ^ (1 << bit))):
            if 0 < m2 < n2 and consistency_shape(m2, n2) == shape:
                # Same SUBPROOF shape: indistinguishable from (proof, roots) alone.
                verify_consistency(m2, n2, proof, old_root, new_root)
                assert n2 > MAX_SIZE or naive_mth(LEAVES[:m2]) != old_root or (
                    naive_mth(LEAVES[:n2]) != new_root
                )
            else:
                rejected(m2, n2, proof, old_root, new_root)
    for extra in (OTHER, old_root, new_root, proof[0]):
        rejected(m, n, [*proof, extra], old_root, new_root)
        rejected(m, n, [extra, *proof], old_root, new_root)
    rejected(m, n, proof[:-1], old_root, new_root)
    rejected(m, n, proof[1:], old_root, new_root)
    rejected(m, n, [], old_root, new_root)
    rejected(m, n, proof, new_root, old_root)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), size=sizes)
def test_proofs_match_the_recursive_definitions(data: st.DataObject, size: int) -> None:
    """Each proof element is the MTH of the range the RFC's PATH/SUBPROOF name."""
    index = data.draw(st.integers(0, size - 1))
    m = data.draw(st.integers(0, size))

    def naive_path(i: int, hashes: list[bytes]) -> list[bytes]:
        if len(hashes) <= 1:
            return []
        k = _k(len(hashes))
        if i < k:
            return [*naive_path(i, hashes[:k]), naive_mth(hashes[k:])]
        return [*naive_path(i - k, hashes[k:]), naive_mth(hashes[:k])]

    def naive_subproof(m_: int, hashes: list[bytes], complete: bool) -> list[bytes]:
        n = len(hashes)
        if m_ == n:
            return [] if complete else [naive_mth(hashes)]
        k = _k(n)
        if m_ <= k:
            return [*naive_subproof(m_, hashes[:k], complete), naive_mth(hashes[k:])]
        return [*naive_subproof(m_ - k, hashes[k:], False), naive_mth(hashes[:k])]

    leaves = LEAVES[:size]
    assert inclusion_proof(index, size, LEAVES) == naive_path(index, leaves)
    want = [] if m == 0 else naive_subproof(m, leaves, True)
    assert consistency_proof(m, size, LEAVES) == want


# --- edge cases ---


def test_size_zero_has_no_leaves() -> None:
    assert root_hash([]) == EMPTY_ROOT
    for index in (0, 1):
        with pytest.raises(InclusionProofError):
            verify_inclusion(LEAVES[0], index, 0, [], EMPTY_ROOT)
    with pytest.raises(TreeRangeError):
        inclusion_proof(0, 0, LEAVES)


def test_size_one() -> None:
    assert inclusion_proof(0, 1, LEAVES) == []
    verify_inclusion(LEAVES[0], 0, 1, [], LEAVES[0])
    with pytest.raises(InclusionProofError):
        verify_inclusion(LEAVES[0], 0, 1, [LEAVES[1]], LEAVES[0])
    with pytest.raises(InclusionProofError):
        verify_inclusion(LEAVES[0], 1, 1, [], LEAVES[0])
    with pytest.raises(InclusionProofError):
        verify_inclusion(LEAVES[0], 0, 1, [], LEAVES[1])


@pytest.mark.parametrize("size", [2, 3, 5, 8, 255, 256, 257, 4096])
def test_index_at_the_right_edge(size: int) -> None:
    root = root_hash(LEAVES[:size])
    proof = inclusion_proof(size - 1, size, LEAVES)
    verify_inclusion(LEAVES[size - 1], size - 1, size, proof, root)
    with pytest.raises(InclusionProofError):
        verify_inclusion(LEAVES[size - 1], size, size, proof, root)
    with pytest.raises(TreeRangeError):
        inclusion_proof(size, size, LEAVES)


@pytest.mark.parametrize("n", [0, 1, 2, 7, 4096])
def test_equal_sizes(n: int) -> None:
    root = root_hash(LEAVES[:n])
    assert consistency_proof(n, n, LEAVES) == []
    verify_consistency(n, n, [], root, root)
    with pytest.raises(ConsistencyProofError):
        verify_consistency(n, n, [root], root, root)
    with pytest.raises(ConsistencyProofError):
        verify_consistency(n, n, [], root, OTHER)


@pytest.mark.parametrize("n", [0, 1, 2, 7, 4096])
def test_from_the_empty_tree(n: int) -> None:
    new_root = root_hash(LEAVES[:n])
    assert consistency_proof(0, n, LEAVES) == []
    verify_consistency(0, n, [], EMPTY_ROOT, new_root)
    with pytest.raises(ConsistencyProofError):
        verify_consistency(0, n, [new_root], EMPTY_ROOT, new_root)
    for bit in range(256):
        with pytest.raises(ConsistencyProofError):
            verify_consistency(0, n, [], flip(EMPTY_ROOT, bit), new_root)


def test_bad_arguments_are_rejected() -> None:
    root = root_hash(LEAVES[:8])
    proof = inclusion_proof(3, 8, LEAVES)
    for bad in (
        (LEAVES[3][:31], 3, 8, proof, root),
        (LEAVES[3], 3, 8, proof, root[:31]),
        (LEAVES[3], 3, 8, [*proof[:-1], proof[-1] + b"\0"], root),
        (LEAVES[3], -1, 8, proof, root),
        (LEAVES[3], 3, MAX_TREE_SIZE + 1, proof, root),
        (LEAVES[3], True, 8, proof, root),
    ):
        with pytest.raises(InclusionProofError):
            verify_inclusion(*bad)
    old = root_hash(LEAVES[:3])
    cproof = consistency_proof(3, 8, LEAVES)
    for cbad in (
        (8, 3, cproof, old, root),
        (-1, 8, cproof, old, root),
        (3, 8, cproof, old[:31], root),
        (3, 8, [b""], old, root),
    ):
        with pytest.raises(ConsistencyProofError):
            verify_consistency(*cbad)
    with pytest.raises(TreeRangeError):
        consistency_proof(9, 8, LEAVES)
    with pytest.raises(TreeRangeError):
        inclusion_proof(0, len(LEAVES) + 1, LEAVES)
    assert issubclass(InclusionProofError, ProofError)


def test_size_is_bound_by_the_checkpoint_not_the_proof() -> None:
    """Documented limit of every RFC 9162 verifier: the size-5 proof for leaf 0 has the
    same shape at size 7, so it verifies there against the size-5 root."""
    proof = inclusion_proof(0, 5, LEAVES)
    root5 = root_hash(LEAVES[:5])
    verify_inclusion(LEAVES[0], 0, 7, proof, root5)
    assert root_hash(LEAVES[:7]) != root5
