"""The memoised fingerprint of a runtime is the fingerprint of its JSON form, for runtimes
that differ only in a value's type (1, 1.0, True), its place or an engine flag."""

from __future__ import annotations

from typing import Any

import pytest

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
