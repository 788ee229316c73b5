"""The strict JSON reader's fast path (orjson) gives exactly what the reference parser
(the standard library with a duplicate-key hook) gives: the same value, of the same
types, or the same error code and message, on generated documents and on mutations of
them that hit each rule (duplicates, NaN, surrogates, long integers, depth, bad bytes)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ledger.core import jsonstrict
from ledger.core.errors import FormatError


def _outcome(fn: Any, data: bytes, max_depth: int) -> tuple[str, Any]:
    try:
        return "ok", _typed(fn(data, what="doc", max_depth=max_depth))
    except FormatError as exc:
        return "error", (exc.code, str(exc))


def _typed(v: Any) -> Any:
    """A comparable form that tells int from float from bool, and 0.0 from -0.0."""
    if isinstance(v, dict):
        return ("dict", tuple((k, _typed(x)) for k, x in v.items()))
    if isinstance(v, list):
        return ("list", tuple(_typed(x) for x in v))
    if isinstance(v, float):
        return ("float", v.hex() if math.isfinite(v) else repr(v))
    return (type(v).__name__, v)


def assert_same(data: bytes, max_depth: int = jsonstrict.MAX_DEPTH) -> None:
    got = _outcome(jsonstrict.loads, data, max_depth)
    want = _outcome(jsonstrict._loads_reference, data, max_depth)
    assert got == want, data[:300]


_text = st.text(alphabet=st.sampled_from('ab:"\\/ \x00\x1f\u00e9\u2028\U0001f600:{}[],'),
                max_size=8)
_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
            | st.floats(allow_nan=True, allow_infinity=True) | _text)
_values = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=5)
                       | st.dictionaries(_text, kids, max_size=5), max_leaves=30)


def _dump(value: Any, ensure_ascii: bool, indent: int | None) -> bytes:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      allow_nan=True).encode("utf-8", "surrogatepass")


_MUTATIONS = [
    lambda s: s.replace(b"{", b'{"k":1,"k":2,', 1),          # a duplicate key
    lambda s: s.replace(b"{", b'{"a:b":1,"a:b":2,', 1),      # one holding a colon
    lambda s: s.replace(b"{", b'{"x":{"y:":":"},"x":3,', 1),  # a merged nested member
    lambda s: s.replace(b"[", b"[NaN,", 1),
    lambda s: s.replace(b"[", b"[-Infinity,", 1),
    lambda s: s.replace(b"[", b"[1e400,", 1),
    lambda s: s.replace(b"[", b'["\\ud800",', 1),
    lambda s: s.replace(b"[", b'["\\u003a",', 1),
    lambda s: s.replace(b"[", b"[12345678901234567890123,", 1),
    lambda s: s.replace(b"[", b"[18446744073709551616,", 1),
    lambda s: s.replace(b"[", b"[-9223372036854775809,", 1),
    lambda s: b"[" * 40 + s + b"]" * 40,
    lambda s: b"\xef\xbb\xbf" + s,
    lambda s: s + b" x",
    lambda s: s[: len(s) // 2],
    lambda s: s.replace(b'"', b'"\xff', 1),
    lambda s: s.replace(b'"', b'"\xed\xa0\x80', 1),
    lambda s: s.replace(b":", b"::", 1),
    lambda s: s.replace(b",", b",,", 1),
    lambda s: s,
]


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_values, st.booleans(), st.sampled_from([None, 0, 2]),
       st.sampled_from(range(len(_MUTATIONS))), st.sampled_from([1, 3, 4, 32]))
@example({"a": 1}, False, None, 0, 32)
@example({"a:": ":", "b": [":"]}, False, None, 1, 32)
def test_fast_path_agrees_with_the_reference(value: Any, ensure_ascii: bool,
                                             indent: int | None, mutation: int,
                                             max_depth: int) -> None:
    assert_same(_MUTATIONS[mutation](_dump(value, ensure_ascii, indent)), max_depth)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=64))
def test_fast_path_agrees_on_arbitrary_bytes(data: bytes) -> None:
    assert_same(data)


@pytest.mark.parametrize("doc", [
    b'{"a":1,"a":1}', b'{"a":{"b":1},"a":{"b":1}}', b'{"p":":","p":":"}',
    b'[{"k":1,"k":2}]', b'{"x":[{"q":1,"q":1}]}',
])
def test_duplicates_are_refused_by_both(doc: bytes) -> None:
    with pytest.raises(FormatError) as exc:
        jsonstrict.loads(doc)
    assert exc.value.code == "duplicate_key"
    assert_same(doc)


def test_an_envelope_payload_takes_the_fast_path() -> None:
    """The case the fast path is for: the value comes from orjson, not the reference."""
    from ledger.core.keys import generate_private_key
    from ledger.producer import sign_statement
    from tests.helpers import statement

    env = sign_statement(statement(prompt_len=64, output_len=16), generate_private_key())
    found, value = jsonstrict._loads_fast(env.payload, jsonstrict.MAX_DEPTH)
    assert found and value == json.loads(env.payload)
    assert_same(env.payload)


@pytest.mark.parametrize("doc", [
    b"[1,2,18446744073709551616]", b"[1,2.5,-9223372036854775809]",
    b'{"t":[0,1,2,12345678901234567890123]}', b"[0.5,1e300,-1e300]",
    b'["a","b:c",":"]', b'{"d":["x:y","z"],"d":[]}', b'{"k":":","s":["a:","b"]}',
    b'[1,"a:b"]', b'["a",1,":"]', b"[1,[2,[3]]]", b'["a",{"b:":":"}]', b"[1,null,true]",
    b"[true,1,2]", b"[1.5,2,3]", b"[]", b'[[],[1],[":"]]',
])
def test_lists_of_one_kind_agree_with_the_reference(doc: bytes) -> None:
    """Lists of numbers only or strings only are read in C (sum, join): a long integer
    anywhere in one, or a colon in its strings, counts as in any other list."""
    for depth in (1, 2, 3, 32):
        assert_same(doc, depth)


def test_a_long_integer_after_short_ones_is_read_by_the_reference() -> None:
    found, _ = jsonstrict._loads_fast(b"[1,2,18446744073709551616]", 32)
    assert not found
    assert jsonstrict.loads(b"[1,2,18446744073709551616]") == [1, 2, 2**64]


@pytest.mark.parametrize("doc", [b'["a:b","c",":"]', b'{"s":["x:","y"],"n":[1,2.5,3]}'])
def test_lists_of_one_kind_take_the_fast_path(doc: bytes) -> None:
    found, value = jsonstrict._loads_fast(doc, 32)
    assert found and value == json.loads(doc)
