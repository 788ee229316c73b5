"""The leaf entry bytes: the fast path equals RFC 8785 for every input it takes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.core.canonical import canonical_json
from ledger.core.logentry import log_entry_bytes, parse_log_entry

refs = st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=60)
safe_refs = st.from_regex(r"[A-Za-z0-9._:@+=-]{1,200}", fullmatch=True)
digests = st.binary(min_size=32, max_size=32).map(bytes.hex)
kinds = st.sampled_from(["envelope", "verdict", "dispute_event"])


@settings(max_examples=300, deadline=None)
@given(kinds, st.one_of(refs, safe_refs), digests)
def test_entry_bytes_are_rfc8785_and_parse_back(kind: str, ref: str, digest: str) -> None:
    entry = log_entry_bytes(kind, ref, digest)
    assert entry == canonical_json({"dsse_sha256": digest, "kind": kind, "ref": ref})
    assert parse_log_entry(entry) == (kind, ref, digest)
