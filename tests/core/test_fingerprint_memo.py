"""The memoised fingerprint of a runtime is the fingerprint of its JSON form, for runtimes
that differ only in a value's type (1, 1.0, True), its place or an engine flag."""

from __future__ import annotations

from typing import Any

import pytest

from ledger.core import envelope
from ledger.core.envelope import Runtime, _fingerprint_of
from ledger.core.fingerprint import fingerprint_id

BASE: dict[str, Any] = {"engine": "reference", "engine_version": "0.1.0", "device": "cpu",
                        "dtype": "float32", "batch_invariant": True}


@pytest.mark.parametrize("extra", [
    {}, {"threads": 1}, {"threads": 1.0}, {"threads": True}, {"threads": "1"},
    {"threads": None}, {"engine_flags": {"a": 1}}, {"engine_flags": {"a": 1.0}},
    {"engine_flags": {"a": ["1", "2"]}}, {"engine_flags": {"a": ["1"]}},
    {"engine_flags": {"a": True}},
    {"cpu_threads": 2}, {"batch_invariant": False},
])
def test_the_memo_answers_what_the_json_form_gives(extra: dict[str, Any]) -> None:
    runtime = Runtime.model_validate({**BASE, **extra})
    want = fingerprint_id(runtime.model_dump(mode="json"))
    assert _fingerprint_of(runtime) == want
    assert _fingerprint_of(runtime) == want  # from the memo


def test_runtimes_whose_json_differs_never_share_a_memo_entry() -> None:
    """Pairs that a looser key (``str``, or values compared with ``==``: ``1 == True ==
    1.0``) would take for one runtime, in both orders, from an empty memo: each gets the
    fingerprint of its own JSON form (engine flags are part of it)."""
    pairs = [({"a": 1}, {"a": True}), ({"a": 1}, {"a": 1.5}), ({"a": "1"}, {"a": 1}),
             ({"a": ["x"]}, {"a": "x"}), ({"a": 0}, {"a": False})]
    for left, right in pairs:
        for order in ((left, right), (right, left)):
            envelope._FP_CACHE.clear()
            for flags in order:
                runtime = Runtime.model_validate({**BASE, "engine_flags": flags})
                assert _fingerprint_of(runtime) == fingerprint_id(
                    runtime.model_dump(mode="json")), flags
        assert fingerprint_id(Runtime.model_validate(
            {**BASE, "engine_flags": left}).model_dump(mode="json")) != fingerprint_id(
            Runtime.model_validate({**BASE, "engine_flags": right}).model_dump(mode="json"))
