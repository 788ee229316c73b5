"""The bundle verifier's shortcut (:class:`ledger.core.bundle.ProvenNodes`: hash a
record's path only up to a subtree an earlier record proved) accepts exactly what
:func:`verify_inclusion` accepts on each proof alone, in any order, after any mix of good
and bad proofs; and DSSE's base64 decoding accepts exactly what ``b64decode(validate=True)``
accepts."""

from __future__ import annotations

import base64
import binascii
import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.core import dsse
from ledger.core.bundle import ProvenNodes
from ledger.core.errors import FormatError, LedgerError
from ledger.core.merkle import inclusion_proof, root_hash, verify_inclusion

LEAVES = [hashlib.sha256(b"leaf %d" % i).digest() for i in range(1100)]


def _alone(leaf: bytes, index: object, size: int, items: list[object], root: bytes) -> bool:
    try:
        proof = [base64.b64decode(x, validate=True) for x in items]  # type: ignore[arg-type]
        verify_inclusion(leaf, index, size, proof, root)  # type: ignore[arg-type]
    except (LedgerError, ValueError, TypeError, binascii.Error):
        return False
    return True


def _shortcut(nodes: ProvenNodes, leaf: bytes, index: object, items: list[object]) -> bool:
    try:
        nodes.check(leaf, index, items)  # type: ignore[arg-type]
    except LedgerError:
        return False
    return True


def _b64(h: bytes) -> str:
    return base64.b64encode(h).decode()


MUTATIONS = ("none", "item", "leaf", "drop", "extra", "swap", "spelling", "index", "type")


@settings(max_examples=60, deadline=None)
@given(size=st.sampled_from([1, 2, 3, 7, 8, 9, 255, 256, 257, 1024, 1025, 1100]),
       steps=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(MUTATIONS)),
                      min_size=1, max_size=60))
def test_shortcut_accepts_exactly_what_each_proof_alone_does(
        size: int, steps: list[tuple[int, str]]) -> None:
    root = root_hash(LEAVES[:size])
    nodes = ProvenNodes(size, root)
    accepted = 0
    for seed, mutation in sorted(steps):  # mostly ascending indices, as in a bundle
        index: object = seed % size
        assert isinstance(index, int)
        leaf = LEAVES[index]
        items: list[object] = [_b64(h) for h in inclusion_proof(index, size, LEAVES)]
        if mutation == "item" and items:
            items[seed % len(items)] = _b64(bytes(32))
        elif mutation == "leaf":
            leaf = LEAVES[(index + 1) % size] if size > 1 else bytes(32)
        elif mutation == "drop" and items:
            items.pop(seed % len(items))
        elif mutation == "extra":
            items.append(items[0] if items else _b64(bytes(32)))
        elif mutation == "swap" and len(items) > 1:
            items[0], items[1] = items[1], items[0]
        elif mutation == "spelling" and items:  # the same hash, unused bits set
            last = str(items[-1])
            items[-1] = last[:-2] + "ABCDEFGHIJKLMNOP"[("ABCDEFGHIJKLMNOP".index(last[-2])
                                                         ^ 1) % 16] + "=" \
                if last[-2] in "ABCDEFGHIJKLMNOP" else last
        elif mutation == "index":
            index = size + seed % 3 if seed % 2 else -1 - seed % 3
        elif mutation == "type" and items:
            items[seed % len(items)] = seed
        want = _alone(leaf, index, size, items, root)
        assert _shortcut(nodes, leaf, index, items) == want, (size, index, mutation)
        accepted += want
    assert accepted or any(m != "none" for _, m in steps)


def test_a_proven_prefix_does_not_vouch_for_a_wrong_tail() -> None:
    """Once leaf 4's path is proven, leaf 5's proof with a wrong hash above their common
    node must still fail: the shortcut compares the rest of the items."""
    size = 1100
    root = root_hash(LEAVES[:size])
    nodes = ProvenNodes(size, root)
    nodes.check(LEAVES[4], 4, [_b64(h) for h in inclusion_proof(4, size, LEAVES)])
    items = [_b64(h) for h in inclusion_proof(5, size, LEAVES)]
    items[-1] = _b64(bytes(32))
    with pytest.raises(LedgerError):
        nodes.check(LEAVES[5], 5, items)
    nodes.check(LEAVES[5], 5, [_b64(h) for h in inclusion_proof(5, size, LEAVES)])


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(
    st.binary(max_size=40).map(lambda b: base64.b64encode(b).decode()),
    st.text(alphabet="ABCDabcd0123+/=-_ \n\u00e9", max_size=24)))
def test_dsse_base64_accepts_what_validate_true_accepts(text: str) -> None:
    try:
        want: bytes | None = base64.b64decode(text, validate=True) if len(text) % 4 == 0 \
            else None
    except (binascii.Error, ValueError):
        want = None
    try:
        got: bytes | None = dsse._b64(text, "payload")
    except FormatError:
        got = None
    assert got == want


def _mangled() -> st.SearchStrategy[str]:
    """Base64 of random bytes with characters replaced or inserted from an alphabet of
    padding, other alphabets, whitespace and non-ASCII: the corners where decoders differ."""
    alphabet = "ABCDabcd0123+/=-_ \n\u00e9\x00"
    edits = st.lists(st.tuples(st.integers(0, 60), st.sampled_from(alphabet), st.booleans()),
                     max_size=3)

    def apply(raw: bytes, changes: list[tuple[int, str, bool]]) -> str:
        s = list(base64.b64encode(raw).decode())
        for at, ch, insert in changes:
            if insert:
                s.insert(at % (len(s) + 1), ch)
            elif s:
                s[at % len(s)] = ch
        return "".join(s)

    return st.builds(apply, st.binary(max_size=40), edits)


@settings(max_examples=1500, deadline=None)
@given(text=st.one_of(_mangled(), st.just("qZjj===="), st.just("qZg====="),
                      st.text(alphabet="ABCDabcd0123+/=-_ \n\u00e9", max_size=24)))
def test_the_fast_base64_path_never_accepts_more_or_decodes_otherwise(text: str) -> None:
    """pybase64, the fast path of ``dsse._b64``, accepts a subset of what binascii's
    strict mode accepts and decodes it to the same bytes: so with binascii deciding every
    refusal, what DSSE decoding accepts did not change."""
    import pybase64

    try:
        fast: bytes | None = pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        fast = None
    try:
        slow: bytes | None = binascii.a2b_base64(text.encode("ascii"), strict_mode=True)
    except (binascii.Error, ValueError):
        slow = None
    if fast is not None:
        assert fast == slow
    if len(text) % 4 == 0:
        try:
            got: bytes | None = dsse._b64(text, "payload")
        except FormatError:
            got = None
        assert got == slow


def test_binascii_decides_what_the_fast_path_refuses() -> None:
    import pybase64

    with pytest.raises(binascii.Error):
        pybase64.b64decode("qZjj====", validate=True)
    assert dsse._b64("qZjj====", "payload") == base64.b64decode("qZjj====", validate=True)
